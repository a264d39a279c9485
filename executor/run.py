"""``python -m executor.run``: run a plan written by ``sim.run`` on real devices and compare with the prediction.

Example::

    python -m sim.run --topology 2xcpu --model gpt:layers=4,hidden=256 --schedule 1f1b --microbatches 8 --out runs/c
    python -m executor.run --plan runs/c/plan.json --iterations 5 --out runs/c-real

Started by hand, it checks the plan (an invalid one, a model with no torch implementation, or more ranks than CUDA
devices is rejected with one ``error: ...`` line and status 2 before any process starts), then launches one process
per rank on this host with PyTorch's own launcher (``torch.distributed.launcher.elastic_launch``, the machinery of
``torchrun --standalone``), each of which re-enters this module as a worker. Started by ``torchrun`` itself (e.g.
``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint host:29500 -m executor.run --plan ...`` on every host),
it is already a worker. Backend: NCCL when CUDA is available, else gloo; ``--backend`` overrides.

Rank 0 writes ``plan.json``, ``metrics.json``, ``trace.json``, ``gantt.png`` (the median measured iteration, with the
simulator's own code) and ``compare.json`` into ``--out``. If a rank fails, every rank stops, and this command
prints the first failing rank's ``error: rank R failed at op X: ...`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from executor.interpreter import check_supported
from executor.optim import OPTIMIZERS
from executor.worker import FAILURE_DIR_ENV, RunOptions, worker_main
from sim.errors import SpecError, fail, run_cli
from sim.ir import Plan
from sim.validate import validate

__all__ = ["main", "make_parser", "load_checked_plan"]


class _Parser(argparse.ArgumentParser):
    """argparse with the house error format: one ``error: ...`` line, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        fail(message)


def make_parser() -> argparse.ArgumentParser:
    """The ``executor.run`` argument parser."""
    parser = _Parser(prog="python -m executor.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.json written by sim.run")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--iterations", type=int, default=5, help="measured iterations after warm-up (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations, trained but not measured "
                        "(default 2)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    parser.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores / ranks on the host)")
    parser.add_argument("--seed", type=int, default=0, help="parameter seed (default 0)")
    parser.add_argument("--data-seed", type=int, default=0, help="synthetic data seed (default 0)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="default adam")
    parser.add_argument("--lr", type=float, help="learning rate (default: 1e-3 for adam, 1e-2 for sgd)")
    parser.add_argument("--profile", help="profile JSON for the prediction (default: the one the plan was "
                        "simulated with, else the hardware catalog's roofline)")
    parser.add_argument("--calibrate-out", help="write a profile of the op costs measured in this run here")
    parser.add_argument("--save-state", help="directory to save each stage's final parameters (stage<v>.pt)")
    parser.add_argument("--inject-failure", metavar="RANK:OP", help="raise an error on RANK at op OP (to check "
                        "that a failure stops every rank), e.g. 1:1B0")
    parser.add_argument("--no-gantt", action="store_true", help="skip drawing gantt.png")
    parser.add_argument("--timeout", type=float, default=300.0, help="communication timeout in s (default 300)")
    return parser


def load_checked_plan(path: str) -> Plan:
    """Read a plan and check that the executor can run it: valid, lowered, known kinds, a torch model.

    Raises:
        SpecError: with the reason, naming the file or the value.
    """
    from executor.modules import boundary_specs  # builds nothing; checks the model has a torch implementation

    plan = Plan.loads(Path(path).read_text(), source=path)
    validate(plan)
    check_supported(plan)
    boundary_specs(plan.model, [0], 1)
    return plan


def _options(args: argparse.Namespace, plan: Plan) -> RunOptions:
    for name in ("iterations", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecError(f"--{name} must be >= 1, got {value}")
    if args.warmup < 0:
        raise SpecError(f"--warmup must be >= 0, got {args.warmup}")
    if args.lr is not None and not args.lr > 0:
        raise SpecError(f"--lr must be > 0, got {args.lr}")
    if not args.timeout > 0:
        raise SpecError(f"--timeout must be > 0, got {args.timeout}")
    inject = None
    if args.inject_failure:
        rank_text, _, op_id = args.inject_failure.partition(":")
        if not rank_text.isdigit() or int(rank_text) >= plan.num_ranks:
            raise SpecError(f"--inject-failure {args.inject_failure!r}: the rank must be 0..{plan.num_ranks - 1}")
        if op_id not in {op.id for op in plan.programs[int(rank_text)]}:
            raise SpecError(f"--inject-failure {args.inject_failure!r}: rank {rank_text} has no op {op_id!r}")
        inject = (int(rank_text), op_id)
    if args.profile:
        from sim.profile import load_profile

        load_profile(args.profile)
    elif plan.option("profile") and not Path(plan.option("profile")).is_file():
        raise SpecError(f"the plan was simulated with profile {plan.option('profile')!r}, which is not there; "
                        f"pass --profile")
    return RunOptions(
        plan_path=str(Path(args.plan).resolve()), out=str(Path(args.out).resolve()), iterations=args.iterations,
        warmup=args.warmup, backend=args.backend or "gloo", threads=args.threads, seed=args.seed,
        data_seed=args.data_seed, optimizer=args.optimizer, lr=args.lr, profile=args.profile,
        calibrate_out=str(Path(args.calibrate_out).resolve()) if args.calibrate_out else None,
        save_state=str(Path(args.save_state).resolve()) if args.save_state else None, inject_failure=inject,
        gantt=not args.no_gantt, timeout_s=args.timeout,
    )


def _choose_backend(requested: str | None, num_ranks: int) -> str:
    import torch

    backend = requested or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SpecError("--backend nccl needs CUDA, and torch sees no CUDA device here")
        if torch.cuda.device_count() < num_ranks:
            raise SpecError(f"the plan has {num_ranks} ranks but this host has {torch.cuda.device_count()} CUDA "
                            f"device(s) (one rank per GPU)")
    return backend


def _launch(options: RunOptions, argv: list[str], num_ranks: int) -> int:
    """Start ``num_ranks`` workers on this host with torchrun's launcher; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from executor.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="pipedejavu-failures-") as failures:
        os.environ[FAILURE_DIR_ENV] = failures
        os.environ.setdefault("OMP_NUM_THREADS", str(options.threads or 1))
        worker_argv = [*argv, "--backend", options.backend]
        try:
            launch_local("executor.run", worker_argv, num_ranks)
        except ChildFailedError as exc:
            records = [json.loads(p.read_text()) for p in sorted(Path(failures).glob("rank*.json"))]
            if records:
                first = min(records, key=lambda r: r["time"])
                print(f"error: {first['message']}", file=sys.stderr)
                bad_input = any(code == 2 for code in (f.exitcode for f in exc.failures.values()))
                return 2 if bad_input and first.get("op") is None else 1
            codes = sorted({f"rank {rank}: exit {f.exitcode}" for rank, f in exc.failures.items()})
            print(f"error: a worker failed without reporting why ({', '.join(codes)})", file=sys.stderr)
            return 1
    return 0


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    plan = load_checked_plan(args.plan)
    options = _options(args, plan)
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.backend is None:
            import torch

            options = replace(options, backend="nccl" if torch.cuda.is_available() else "gloo")
        return worker_main(options)  # started by torchrun: this process is one rank
    options = replace(options, backend=_choose_backend(args.backend, plan.num_ranks))
    print(f"running {plan.schedule} plan {args.plan}: {plan.num_ranks} ranks, backend {options.backend}, "
          f"{options.warmup} warm-up + {options.iterations} measured iterations")
    sys.stdout.flush()
    return _launch(options, argv, plan.num_ranks)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
