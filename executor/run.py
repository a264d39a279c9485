"""``python -m executor.run``: run a plan written by ``sim.run`` on real devices and compare with the prediction.

Example::

    python -m sim.run --topology 2xcpu --model gpt:layers=4,hidden=256 --schedule 1f1b --microbatches 8 --out runs/c
    python -m executor.run --plan runs/c/plan.json --iterations 5 --out runs/c-real

Started by hand, it checks the plan and the options before any process starts: an invalid plan, more ranks than its
topology has devices, a model with no torch implementation, more ranks than CUDA devices, a backend that does not fit
the plan's devices, an unusable ``--out``/``--calibrate-out``/``--save-state`` path (each is checked by creating and
removing a probe file where it will be written, so nothing is left behind), or a ``--calibrate-out`` that names the
plan or a file the run writes into ``--out`` is rejected with one ``error: ...`` line and status 2. It then launches
one process per rank on this host with the project's launcher (``executor.launch.run_ranks``: what ``torchrun
--standalone`` does on one host; gloo ranks forked with their code imported, NCCL ranks as fresh interpreters), each
of which re-enters this module as a worker. Started by ``torchrun``
itself (e.g. ``torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint host:29500 -m executor.run --plan ...`` on
every host), it is already a worker.

A 3D plan (``sim.run --tp/--dp/--cp``) runs ``plan.world_size`` = T·D·C·P processes, process ``layout.device(p, d,
t)`` running pipeline rank p's program as shard t of data-axis position d (``executor.parallel``); ranks in messages
and in ``--inject-failure`` are these global ranks. Refused before launch as well: a 3D plan whose devices do not fit
its topology, sequence parallelism, tensor parallelism of a model other than gpt and llama, context parallelism of a
model other than llama, HSDP, data parallelism with weight stashing, and ``--calibrate-out`` for a 3D plan.

``--slowdown RANK:FACTOR`` (repeatable, or comma-separated) emulates a slower device on those global ranks
(``executor.slowdown``): their compute ops are stretched by FACTOR. Refused before launch: a rank outside the plan, a
rank given twice, a factor that is not a finite number from 1 to 1000, and ``--slowdown`` with ``--calibrate-out``
(the profile would record emulated times) or with a csp plan.

Backend (:func:`executor.backend.choose_backend`) follows the plan's devices, not the host: gloo for a plan on
``cpu``, NCCL for a plan on GPUs when CUDA is there. A GPU plan on a host without CUDA runs every rank on the CPU with
gloo, after a ``warning:`` that the measurement describes this CPU; ``--backend`` overrides within those rules.

Rank 0 writes ``plan.json``, ``metrics.json``, ``trace.json``, ``gantt.png`` (the median measured iteration, with the
simulator's own code) and ``compare.json`` into ``--out``. If a rank fails, every rank stops, and this command
prints exactly one line, the first failing rank's ``error: rank R failed at op X: <its exception>``, and exits with
status 1; every rank's error and traceback (the first failure's echoes on other ranks included) is kept in
``--out/errors.log``.
"""

from __future__ import annotations

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

import argparse
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from executor.backend import check_calibration_device, check_cuda_graphs, choose_backend, planned_devices
from executor.interpreter import check_supported
from executor.launch import ATTEMPT_ENV
from executor.nn.optim import OPTIMIZERS
from executor.options import FAILURE_DIR_ENV, RunOptions
from executor.parallel import check_parallel
from executor.rank_process import worker_main
from executor.slowdown import parse_slowdown
from sim.core.cli import CliParser
from sim.core.errors import SpecError, run_cli
from sim.core.fileio import check_output_file, prepare_output_dir
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.plan.lower_collectives import EP_OVERLAP_OPTION
from sim.plan.validate import check_topology, validate

__all__ = ["main", "make_parser", "load_checked_plan", "check_output_path", "RUN_OUTPUT_FILES"]

#: Library arguments set from flags, and the flag an error about one is printed as (a plan's own fields are not).
FLAGS = {"slowdown": "--slowdown", "calibrate_out": "--calibrate-out"}

#: The files a run writes into ``--out`` (``executor.run_outputs``; ``errors.log`` when a rank fails).
#: Modules a rank imports beyond this one's own imports: the launcher imports them once before forking its ranks
#: (``executor.launch.run_ranks``'s ``preload``), so that no rank spends its own CPU on them.
RANK_MODULES = ("executor.csp.csp_plan_run",)
#: What ``torch.autograd.backward`` with given output gradients imports on its first call (with sympy, about 0.45 s
#: of CPU): a rank that runs a virtual stage other than the last one does. Preloaded where two or more ranks would
#: (:func:`_rank_modules`); for one, the rank's own import costs the same, and a plan without pipeline stages needs
#: none.
GRADIENT_BACKWARD_MODULE = "torch.fx.experimental.symbolic_shapes"

RUN_OUTPUT_FILES = ("plan.json", "metrics.json", "trace.json", "gantt.png", "compare.json", "errors.log")


def make_parser() -> argparse.ArgumentParser:
    """The ``executor.run`` argument parser."""
    parser = CliParser(prog="python -m executor.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.json written by sim.run")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--iterations", type=int, help="measured iterations after warm-up (default 5; a csp plan "
                        "trains its subnet sequence once)")
    parser.add_argument("--warmup", type=int, help="warm-up iterations, trained but not measured (default 2; none "
                        "for a csp plan)")
    parser.add_argument("--reference", action="store_true", help="csp plans: train the plan's subnets one by one "
                        "in this process instead (the oracle a CSP run must equal bitwise) and write its "
                        "metrics.json")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: gloo for a cpu plan, nccl for a GPU "
                        "plan on a host with CUDA, else gloo")
    parser.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores / ranks on the host)")
    parser.add_argument("--seed", type=int, default=0, help="parameter seed (default 0)")
    parser.add_argument("--data-seed", type=int, default=0, help="synthetic data seed (default 0)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="default adam")
    parser.add_argument("--lr", type=float, help="learning rate (default: 1e-3 for adam, 1e-2 for sgd)")
    parser.add_argument("--profile", help="profile JSON for the prediction (default: the one the plan was "
                        "simulated with, else the hardware catalog's costs: the GPU kernel model or the roofline)")
    parser.add_argument("--calibrate-out", help="write a profile of the op costs measured in this run here")
    parser.add_argument("--save-state", help="directory to save each stage's final parameters (stage<v>.pt)")
    parser.add_argument("--inject-failure", metavar="RANK:OP", help="raise an error on RANK at op OP (to check "
                        "that a failure stops every rank), e.g. 1:1B0; or RANK:checkpoint@ITERATION: RANK kills itself "
                        "(SIGKILL) halfway through writing the checkpoint after ITERATION iterations")
    parser.add_argument("--slowdown", action="append", metavar="RANK:FACTOR", help="emulate a slower device: "
                        "RANK stretches each compute op (F, B, I, W, R, optimizer step) to FACTOR (1 to 1000) times "
                        "its measured duration by sleeping after it; repeat the flag or join entries with commas, "
                        "e.g. 0:1.5,3:2; the outputs say so")
    parser.add_argument("--measure-memory", action="store_true", help="count each CPU rank's peak tensor memory "
                        "during the measured iterations (executor.memory; it slows every operator a few microseconds, "
                        "so it is off by default); compare.json lists it beside the predicted peak. CUDA ranks always "
                        "report theirs")
    parser.add_argument("--checkpoint-every", type=int, metavar="K", help="write a checkpoint of every rank's "
                        "training state after every K iterations, warm-up included (executor.checkpoint; a csp "
                        "plan's iterations are its subnets, and its pipeline drains at each); needs "
                        "--checkpoint-dir")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go (one step-N folder each; the two "
                        "newest complete ones are kept)")
    parser.add_argument("--resume", metavar="DIR", help="continue from the newest complete checkpoint in DIR up to "
                        "the run's total of --warmup + --iterations iterations; the plan, seeds and optimizer must be "
                        "the checkpointed run's. With --checkpoint-every, new checkpoints go to DIR unless "
                        "--checkpoint-dir says otherwise")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R", help="when a rank dies, restart the "
                        "group up to R times (0 to 10), each restart continuing from the newest complete checkpoint "
                        "of --checkpoint-dir (executor.restart); the outputs say what died and what it cost")
    parser.add_argument("--fail", metavar="RANK@ITERATION", help="RANK kills itself (SIGKILL) before iteration "
                        "ITERATION (0-based, warm-up included; a csp plan's subnet) on the first attempt: a crash to "
                        "test --max-restarts")
    parser.add_argument("--aggregate", default="mean", metavar="RULE", help="how data-parallel gradients "
                        "combine: mean (default), or zeno:B[:RHO], Zeno's suspicion-based aggregation dropping the B "
                        "lowest-scored of the replicas' gradients each step (executor.zeno; data parallelism only)")
    parser.add_argument("--byzantine", action="append", metavar="REPLICA:MODE[:STRENGTH]", help="a data-parallel "
                        "replica sends corrupted gradients: sign-flip (-4 times its gradient) or noise (Gaussian, "
                        "sigma 1) (repeatable; executor.byzantine)")
    parser.add_argument("--no-gantt", action="store_true", help="skip drawing gantt.png")
    parser.add_argument("--timeout", type=float, default=300.0, help="communication timeout in s (default 300)")
    return parser


def load_checked_plan(path: str) -> tuple[Plan, Topology]:
    """Read a plan and check that the executor can run it: valid, enough devices in its topology for its ranks,
    lowered, known kinds, a torch model.

    Returns:
        The plan and its topology, parsed once here (the launcher and rank 0's ``finish_run`` reuse it).

    Raises:
        SpecError: with the reason, naming the file or the value.
    """
    from executor.nn.stages import check_torch_model
    from sim.core.fileio import read_text

    plan = Plan.loads(read_text(path, "plan"), source=path)
    if plan.weight_policy == "csp":
        from sim.csp.csp_plan import check_csp_plan

        topology = check_csp_plan(plan).topology
    else:
        validate(plan)
        topology = check_topology(plan)
        check_supported(plan)
        check_parallel(plan)
    graph = check_torch_model(plan.model)
    if plan.placement.num_layers != len(graph):
        # An edited model or placement is refused here, not by an IndexError on some rank after launch.
        raise SpecError(f"the plan's placement covers {plan.placement.num_layers} layers "
                        f"({[list(r) for r in plan.placement.vstage_layers]}) but its model {plan.model} has "
                        f"{len(graph)}")
    return plan, topology


def _options(args: argparse.Namespace, plan: Plan, topology: Topology) -> RunOptions:
    csp = plan.weight_policy == "csp"
    if csp:
        _check_csp_flags(args)
    elif args.reference:
        raise SpecError(f"--reference trains a csp plan's subnets one by one; {args.plan} is a {plan.schedule} plan "
                        f"(its single-process reference is in the tests: executor.reference)")
    # A csp run's iterations are its subnets, each one training step (what checkpoints, --resume and --fail count).
    iterations = plan.num_microbatches if csp else args.iterations if args.iterations is not None else 5
    warmup = 0 if csp else args.warmup if args.warmup is not None else 2
    for name, value in (("iterations", iterations), ("threads", args.threads)):
        if value is not None and value < 1:
            raise SpecError(f"--{name} must be >= 1, got {value}")
    if warmup < 0:
        raise SpecError(f"--warmup must be >= 0, got {warmup}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise SpecError(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise SpecError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    inject, die_in_checkpoint = None, None
    if args.inject_failure:
        rank_text, _, op_id = args.inject_failure.partition(":")
        if not rank_text.isdigit() or int(rank_text) >= plan.world_size:
            raise SpecError(f"--inject-failure {args.inject_failure!r}: the rank must be 0..{plan.world_size - 1}")
        if op_id.startswith("checkpoint@"):
            when = op_id.partition("@")[2]
            if not when.isdigit() or not args.checkpoint_every or int(when) % args.checkpoint_every:
                raise SpecError(f"--inject-failure {args.inject_failure!r}: {'SUBNET' if csp else 'ITERATION'} must "
                                f"be one after which a checkpoint is written (a multiple of --checkpoint-every)")
            die_in_checkpoint = (int(rank_text), int(when))
        elif op_id not in {op.id for op in plan.programs[plan.layout.coords(int(rank_text))[0]]}:
            raise SpecError(f"--inject-failure {args.inject_failure!r}: rank {rank_text} has no op {op_id!r}")
        else:
            inject = (int(rank_text), op_id)
    unit = "subnets" if csp else "iterations"
    resume = _resume_point(args, plan, warmup, iterations, unit)
    fail = _fail_point(args, plan, resume.first_iteration, warmup + iterations, unit)
    byzantine = _aggregation(args, plan)
    if not 0 <= args.max_restarts <= 10:
        raise SpecError(f"--max-restarts must be 0 to 10, got {args.max_restarts}")
    # The launcher checks a fresh run's checkpoint folder; its workers (which it tells their attempt) find this run's
    # own checkpoints there once it has written some.
    if (args.max_restarts and args.resume is None and resume.checkpoint_dir and ATTEMPT_ENV not in os.environ
            and _has_checkpoint(resume.checkpoint_dir)):
        raise SpecError(f"--checkpoint-dir {args.checkpoint_dir} already holds a complete checkpoint; a restart would "
                        f"take it for this run's: continue it with --resume, or name an empty directory")
    slowdown = parse_slowdown(args.slowdown or (), plan.world_size)
    check_output_path("--out", args.out, directory=True)
    if args.calibrate_out and plan.parallel is not None:
        raise SpecError(f"--calibrate-out profiles whole layers on one device per pipeline rank; this plan is "
                        f"{plan.layout.describe()} (calibrate with a pure pipeline plan)")
    if args.calibrate_out and slowdown:
        raise SpecError(f"--calibrate-out with --slowdown {','.join(args.slowdown)}: the profile would record the "
                        f"emulated op times as this device's")
    if args.calibrate_out:
        check_output_path("--calibrate-out", args.calibrate_out, directory=False)
        _check_calibrate_out_is_its_own_file(args.calibrate_out, args.plan, args.out)
    if args.save_state:
        check_output_path("--save-state", args.save_state, directory=True)
    if not args.profile and plan.option("profile") and not Path(plan.option("profile")).is_file():
        raise SpecError(f"the plan was simulated with profile {plan.option('profile')!r}, which is not there; "
                        f"pass --profile")
    if args.profile or plan.option("profile"):
        _check_profile_fits(args.profile or plan.option("profile"), plan, topology)
    first, checkpoint_dir = resume.first_iteration, resume.checkpoint_dir
    left = warmup + iterations - first  # a resumed run runs what is left of the original run
    return RunOptions(
        plan_path=str(Path(args.plan).resolve()), out=str(Path(args.out).resolve()),
        iterations=left - max(0, warmup - first), warmup=max(0, warmup - first), backend=args.backend or "gloo",
        threads=args.threads or (1 if csp else None), seed=args.seed,
        data_seed=args.data_seed, optimizer=args.optimizer, lr=args.lr, profile=args.profile,
        calibrate_out=str(Path(args.calibrate_out).resolve()) if args.calibrate_out else None,
        save_state=str(Path(args.save_state).resolve()) if args.save_state else None, inject_failure=inject,
        gantt=not args.no_gantt, timeout_s=args.timeout, slowdown=slowdown, measure_memory=args.measure_memory,
        checkpoint_every=args.checkpoint_every or 0, checkpoint_dir=checkpoint_dir, resume_from=resume.step,
        first_iteration=first, identity=tuple(sorted(resume.identity.items())), die_in_checkpoint=die_in_checkpoint,
        max_restarts=args.max_restarts, fail=fail, aggregate=args.aggregate, byzantine=byzantine,
    )


def _aggregation(args: argparse.Namespace, plan: Plan) -> tuple[tuple[int, str, float], ...]:
    """``--aggregate`` and ``--byzantine`` checked against the plan; the Byzantine replicas.

    Raises:
        SpecError: naming the value and what would be valid.
    """
    from executor.byzantine import parse_byzantine
    from executor.zeno import parse_aggregate

    layout = plan.layout
    replicas = layout.data_ranks
    byzantine = tuple(parse_byzantine(entry, replicas) for flag in args.byzantine or () for entry in flag.split(",")
                      if entry.strip())
    if byzantine and (replicas < 2 or layout.zero >= 2):
        raise SpecError(f"--byzantine corrupts what a data-parallel replica sends at each step's gradient reduction; "
                        f"this plan ({layout.describe()}) has "
                        f"{'no replicas' if replicas < 2 else f'ZeRO-{layout.zero}, which reduces per microbatch'}")
    if len({b.rank for b in byzantine}) != len(byzantine):
        raise SpecError("--byzantine names a replica twice")
    rule = parse_aggregate(args.aggregate, max(replicas, 2))
    if rule is not None and (replicas < 2 or plan.num_ranks != 1 or layout.tp > 1 or layout.cp > 1 or layout.ep > 1
                             or layout.zero or plan.weight_policy != "flush"):
        raise SpecError(f"--aggregate {args.aggregate} scores each replica's gradient with the whole model: it runs "
                        f"on plain data parallelism (no pipeline, TP, CP, EP or ZeRO), not {layout.describe()}")
    return tuple((b.rank, b.mode, b.strength) for b in byzantine)


def _has_checkpoint(directory: str) -> bool:
    from executor.checkpoint import latest

    return latest(directory) is not None


def _fail_point(args: argparse.Namespace, plan: Plan, first: int, total: int, unit: str) -> tuple[int, int] | None:
    """``--fail RANK@ITERATION`` checked: a rank of the plan, an iteration (``unit``: a csp run's are subnets) this
    run will start.

    Raises:
        SpecError: naming the value and what would be valid.
    """
    if args.fail is None:
        return None
    rank_text, at, iteration_text = args.fail.partition("@")
    if not (at and rank_text.isdigit() and iteration_text.isdigit()):
        raise SpecError(f"--fail takes RANK@ITERATION, e.g. 1@3; got {args.fail!r}")
    rank, iteration = int(rank_text), int(iteration_text)
    if rank >= plan.world_size:
        raise SpecError(f"--fail {args.fail}: the rank must be 0..{plan.world_size - 1}")
    if not first <= iteration < total:
        raise SpecError(f"--fail {args.fail}: the run starts {unit} {first} to {total - 1}; name one of them")
    return rank, iteration


@dataclass(frozen=True)
class _ResumePoint:
    """Where a run starts and what its checkpoints record (``executor.checkpoint``)."""

    first_iteration: int
    step: str | None
    checkpoint_dir: str | None
    identity: dict


def _resume_point(args: argparse.Namespace, plan: Plan, warmup: int, iterations: int, unit: str) -> _ResumePoint:
    """Check ``--checkpoint-every``, ``--checkpoint-dir`` and ``--resume`` before launch, and find the checkpoint a
    resumed run continues from (``unit``: what the run's iterations are, ``"subnets"`` for a csp plan).

    Raises:
        SpecError: a flag without its partner, no complete checkpoint, a checkpoint of another run (naming what
            differs), or one that already reaches the run's total.
    """
    from executor.checkpoint import latest, run_identity

    every, directory = args.checkpoint_every, args.checkpoint_dir or args.resume
    if every is not None and every < 1:
        raise SpecError(f"--checkpoint-every must be >= 1, got {every}")
    if every is not None and directory is None:
        raise SpecError(f"--checkpoint-every {every} needs --checkpoint-dir DIR (where the checkpoints go)")
    if args.checkpoint_dir is not None and every is None:
        raise SpecError(f"--checkpoint-dir {args.checkpoint_dir} without --checkpoint-every K writes nothing")
    if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
        raise SpecError(f"checkpoint directory {directory} exists and is not a directory")
    identity = run_identity(plan.dumps(), world_size=plan.world_size, seed=args.seed, data_seed=args.data_seed,
                            optimizer=args.optimizer, lr=args.lr)
    if args.resume is None:
        return _ResumePoint(0, None, str(Path(directory).resolve()) if every else None, identity)
    if not Path(args.resume).is_dir():
        raise SpecError(f"--resume {args.resume}: no such directory")
    checkpoint = latest(args.resume)
    if checkpoint is None:
        raise SpecError(f"--resume {args.resume}: no complete checkpoint there (a step-N folder with COMPLETE.json)")
    differs = [f"{key} {checkpoint.identity.get(key)!r} there, {value!r} here" for key, value in identity.items()
               if checkpoint.identity.get(key) != value]
    if differs:
        raise SpecError(f"--resume {args.resume}: {checkpoint.path.name} is of another run ({'; '.join(differs)})")
    total = warmup + iterations
    if checkpoint.iteration >= total:
        of = f"the plan's {total} subnets" if unit == "subnets" else \
            f"the run's total is {total} (--warmup {warmup} + --iterations {iterations})"
        raise SpecError(f"--resume {args.resume}: {checkpoint.path.name} has done {checkpoint.iteration} {unit}, "
                        f"{of}; nothing is left")
    return _ResumePoint(checkpoint.iteration, str(checkpoint.path.resolve()),
                        str(Path(directory).resolve()) if every else None, identity)


def _check_csp_flags(args: argparse.Namespace) -> None:
    """A csp plan trains its subnet sequence once, online; flags about repeated iterations, calibration, a profile
    or a scripted failure at a fixed op have no meaning for it and are refused rather than ignored. (Checkpoints,
    resume, restarts and ``--fail`` count its subnets.)"""
    for flag, given, why in (
            ("--iterations", args.iterations not in (None, 1), "a csp plan trains its subnet sequence once"),
            ("--warmup", args.warmup not in (None, 0), "a csp plan trains its subnet sequence once"),
            ("--calibrate-out", args.calibrate_out, "a profile times one model's layers; subnets differ"),
            ("--profile", args.profile, "csp is predicted with the roofline of each subnet's candidates"),
            ("--inject-failure", args.inject_failure and ":checkpoint@" not in args.inject_failure,
             "a csp plan has no fixed ops to fail at (RANK:checkpoint@SUBNET applies; --fail RANK@SUBNET crashes a "
             "rank)"),
            ("--aggregate", args.aggregate != "mean", "a csp run trains one subnet at a time, without replicas"),
            ("--byzantine", args.byzantine, "a csp run trains one subnet at a time, without replicas"),
            ("--slowdown", args.slowdown, "the csp ranks (executor.csp) do not stretch their ops"),
            ("--measure-memory", args.measure_memory, "the csp ranks (executor.csp) do not count their memory")):
        if given:
            raise SpecError(f"{flag} does not apply to a csp plan ({why})")


def _check_profile_fits(path: str, plan: Plan, topology: Topology) -> None:
    """The prediction's profile must be for the plan's model where it applies: checked now, not after the run."""
    from sim.cost.oracle import CostOracle
    from sim.cost.profile import load_profile
    from sim.models import build_model

    oracle = CostOracle(build_model(plan.model), plan.microbatch_size, load_profile(path), topology)
    for rank in range(plan.world_size):
        oracle.layer_costs(topology.devices[rank])  # raises SpecError for another model's profile


def check_output_path(flag: str, path: str, *, directory: bool) -> None:
    """Check before launch that ``path`` can be written when the run ends, leaving nothing behind (the checks:
    :func:`sim.core.fileio.prepare_output_dir` without creating, for ``--out`` and ``--save-state``;
    :func:`sim.core.fileio.check_output_file` for a file such as ``--calibrate-out``).

    Raises:
        SpecError: naming the flag and the path.
    """
    if directory:
        prepare_output_dir(path, flag, create=False)
    else:
        check_output_file(path, flag)


def _check_calibrate_out_is_its_own_file(calibrate_out: str, plan: str, out: str) -> None:
    """``--calibrate-out`` must not name the plan or a file the run writes into ``--out`` (it would overwrite it).

    Raises:
        SpecError: naming the path and the file it would replace.
    """
    target = Path(calibrate_out).resolve()
    taken = {Path(plan).resolve(): f"the --plan file {plan!r}"}
    taken.update({(Path(out) / name).resolve(): f"the {name} this run writes into --out" for name in RUN_OUTPUT_FILES})
    for path, what in taken.items():
        if target == path or (target.exists() and path.exists() and os.path.samefile(target, path)):
            raise SpecError(f"--calibrate-out {calibrate_out!r} is {what}; name another file")


def _check_ep_overlap(plan: Plan) -> None:
    """A plan simulated with ``--ep-overlap`` is refused: the executor runs each expert all-to-all inside its
    layer's forward or backward, so a run could not do what the prediction assumed (another microbatch's compute
    beside the exchange, as DualPipe's paired chunks do), and the comparison would mislead."""
    if plan.option(EP_OVERLAP_OPTION, False):
        raise SpecError("the plan was simulated with --ep-overlap, and executor.run runs each expert all-to-all inside "
                        "its layer (no microbatch's compute beside another's exchange); simulate it without "
                        "--ep-overlap to compare a run")


def _rank_modules(plan: Plan) -> tuple[str, ...]:
    """What the launcher preloads for ``plan``'s ranks: :data:`RANK_MODULES`, and :data:`GRADIENT_BACKWARD_MODULE`
    where two or more ranks run a virtual stage whose backward is given its output's gradient (every one but the
    last; each of the plan's pipeline positions stands for ``world_size / num_ranks`` processes)."""
    last = plan.num_vstages - 1
    positions = sum(any(v != last for v in plan.placement.vstages_of(rank)) for rank in range(plan.num_ranks))
    processes = positions * (plan.world_size // plan.num_ranks)
    return RANK_MODULES + ((GRADIENT_BACKWARD_MODULE,) if processes >= 2 else ())


def _launch(options: RunOptions, argv: list[str], num_ranks: int, preload: tuple[str, ...]) -> int:
    """Start ``num_ranks`` workers on this host and report how they ended (``executor.launch.run_ranks``: one
    ``error:`` line for a failure, every rank's story in ``--out/errors.log``); returns the exit status."""
    from executor.launch import run_ranks

    os.environ.setdefault("OMP_NUM_THREADS", str(options.threads or 1))
    # CUDA cannot be used in a process forked after the driver was initialised here (torch.cuda.is_available()):
    # NCCL ranks start as fresh interpreters; gloo ranks are forked with the rank's code already imported.
    return run_ranks("executor.run", [*argv, "--backend", options.backend], num_ranks,
                     errors_log=Path(options.out, "errors.log"), max_restarts=options.max_restarts,
                     start="exec" if options.backend == "nccl" else "fork", preload=preload)


def _run(argv: list[str] | None) -> int:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    plan, topology = load_checked_plan(args.plan)
    _check_ep_overlap(plan)
    options = _options(args, plan, topology)
    if args.reference:
        return _run_reference(options, plan)
    planned = planned_devices(plan, topology)
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # Started by our launcher or a user's torchrun: this process is one rank. Its hosts' CUDA devices are not
        # visible from here, so the count is not checked (the worker fails on a missing device), nor is the
        # calibration device (finish_run).
        backend, warning = choose_backend(args.backend, planned, cuda_available=torch.cuda.is_available())
        if warning and os.environ.get("RANK") == "0" and FAILURE_DIR_ENV not in os.environ:
            print(warning, file=sys.stderr)  # under our own launcher, the launcher has said it already
        return worker_main(replace(options, backend=backend), plan, topology)
    cuda = torch.cuda.is_available()
    backend, warning = choose_backend(args.backend, planned, cuda_available=cuda,
                                      cuda_devices=torch.cuda.device_count() if cuda else 0)
    options = replace(options, backend=backend)
    check_cuda_graphs(plan, backend)
    if options.calibrate_out:
        check_calibration_device(backend, plan.world_size)
    if warning:
        print(warning, file=sys.stderr)
    if plan.weight_policy == "csp":
        # Bitwise equality with the reference needs the same kernels on every rank: one intra-op thread each.
        os.environ.setdefault("OMP_NUM_THREADS", str(options.threads))
        print(f"running csp plan {args.plan}: {plan.num_ranks} ranks, backend {options.backend}, "
              f"{plan.num_microbatches} subnets once"
              + (f", resuming after subnet {options.first_iteration} from {options.resume_from}"
                 if options.resume_from else "")
              + (f"; a checkpoint every {options.checkpoint_every} subnets into {options.checkpoint_dir} (the "
                 f"pipeline drains at each)" if options.checkpoint_every else ""))
    else:
        ranks = f"{plan.num_ranks} ranks" if plan.parallel is None else plan.layout.describe()
        print(f"running {plan.schedule} plan {args.plan}: {ranks}, backend {options.backend}, "
              f"{options.warmup} warm-up + {options.iterations} measured iterations"
              + (f", resuming after iteration {options.first_iteration} from {options.resume_from}"
                 if options.resume_from else "")
              + (f"; a checkpoint every {options.checkpoint_every} iterations into {options.checkpoint_dir}"
                 if options.checkpoint_every else ""))
    sys.stdout.flush()
    return _launch(options, argv, plan.world_size, _rank_modules(plan))


def _run_reference(options: RunOptions, plan: Plan) -> int:
    """``--reference``: the csp plan's subnets trained one by one in this process; writes ``metrics.json``."""
    from executor.csp.csp_plan_run import run_reference
    from sim.core.fileio import write_json_atomic

    record = run_reference(options, plan)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, out / "metrics.json")
    print(f"reference: {plan.num_microbatches} subnets one by one in {record['wall_s']:.2f} s, final parameters "
          f"sha256 {record['final_params_sha256']}")
    print(f"wrote {out}/{{metrics.json}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv), FLAGS)


if __name__ == "__main__":
    sys.exit(main())
