"""``python -m executor.naspipe``: train a supernet's subnet sequence with CSP on real ranks, or one by one.

Example::

    python -m executor.naspipe --space c3 --model-overrides hidden=64,blocks=8 --subnets 32 --stages 2 --out runs/n
    python -m executor.naspipe --space c3 --model-overrides hidden=64,blocks=8 --subnets 32 --sequential --out runs/s

Both write ``metrics.json`` with ``final_params_sha256`` and every subnet's loss: NASPipe's claim is that they are
equal, bitwise, for any number of stages. The pipelined run takes its plan — partition, subnet table — from
:func:`sim.csp.build.build_csp_problem`, exactly as ``sim.run --schedule csp`` does, and each rank decides online
with :func:`sim.csp.rules.csp_pick` (``executor.csp.runner``). Ranks are launched on this host with torch's elastic
launcher (as ``executor.run`` does), gloo on CPU, one intra-op thread each: bitwise equality needs the same kernels,
and a CPU kernel's reduction order can depend on its thread count. The embedding and head are frozen (see
``executor.csp.runner``). Bad input prints one ``error:`` line and exits with status 2.

Context switching: ``--device-param-budget BYTES`` (``sim.run``'s syntax and meaning: choice-block parameter bytes
as the plan counts them, parameters × the graph's ``dtype_bytes``) keeps the candidates' parameters and optimizer
state in host memory and at most that many bytes of them on each rank's device, with ``--prefetch on_demand`` or
``predict`` (``resident``: the budget is ignored); a budget below one subnet's layers on a stage is an error, as in
``sim.run``. The pipelined run also writes ``trace.json`` and ``gantt.png`` (``sim.report.outputs.write_run_outputs``), and
``metrics.json`` gains the simulator's trace metrics and, under a budget, ``csp.copies`` per stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from sim.core.cli import parse_byte_size
from sim.core.errors import SpecError, fail, run_cli
from sim.core.fileio import write_json_atomic
from sim.csp.problem import PREFETCH_POLICIES

__all__ = ["main", "SHARED_LAYERS", "params_sha256"]

#: Parameter-name prefixes of the layers every subnet uses; frozen under CSP.
SHARED_LAYERS = ("layers.embed.", "layers.head.")


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name and raw bytes, in name order: equal iff the parameters are bitwise equal."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m executor.naspipe", description=__doc__.split("\n\n")[0])
    parser.error = lambda message: fail(message)  # type: ignore[method-assign]
    parser.add_argument("--space", help="search space c0|c1|c2|c3")
    parser.add_argument("--model", help="a supernet:... spec (instead of --space)")
    parser.add_argument("--model-overrides", default="", help="key=value,... applied to the space's spec")
    parser.add_argument("--subnets", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="subnet sampler seed")
    parser.add_argument("--stages", type=int, default=2, help="ranks, one stage each")
    parser.add_argument("--lookahead", type=int, default=30)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--sequential", action="store_true", help="train the subnets one by one in this process")
    parser.add_argument("--device-param-budget", type=parse_byte_size, metavar="BYTES",
                        help="most choice-block parameter bytes per device, e.g. 60KB, 2GB or 3e8 (default: all "
                        "layers resident)")
    parser.add_argument("--prefetch", default="predict", choices=PREFETCH_POLICIES,
                        help="context switch under --device-param-budget (default predict)")
    parser.add_argument("--no-gantt", action="store_true", help="skip drawing gantt.png")
    parser.add_argument("--out", required=True)
    return parser


def _spec(args: argparse.Namespace) -> str:
    from sim.models.supernet_space import space_spec

    if (args.space is None) == (args.model is None):
        raise SpecError("give exactly one of --space and --model")
    if args.model:
        return args.model
    overrides = {}
    for item in filter(None, args.model_overrides.split(",")):
        key, _, value = item.partition("=")
        if not value.isdigit():
            raise SpecError(f"--model-overrides: expected key=integer, got {item!r}")
        overrides[key] = int(value)
    return space_spec(args.space, **overrides)


def _plan(args: argparse.Namespace, spec: str, stages: int):
    """``(layer ranges per stage, subnets, problem)``; the sequential run (one process) has no budget."""
    from sim.csp.build import CspInputs, build_csp_problem

    budget = None if args.sequential else args.device_param_budget
    plan, _, problem = build_csp_problem(CspInputs(
        model=spec, space=None, topology=f"{stages}xcpu", subnets=args.subnets, seed=args.seed,
        lookahead=args.lookahead, partition="uniform", device_param_budget_bytes=budget,
        prefetch=args.prefetch if budget is not None else None))
    return plan.placement.vstage_layers, plan.subnets, problem


def _stage(spec: str, start: int, end: int, subnets, optimizer: str):
    from executor.nn.optim import make_optimizer
    from executor.nn.stages import build_stage
    from executor.nn.supernet import freeze_shared, set_subnet, trainable

    stage = build_stage(spec, start, end, seed=0)
    freeze_shared(stage, SHARED_LAYERS)
    blocks = [i - 1 for i in range(start, end) if 1 <= i <= len(subnets[0])]

    def choose(subnet: int) -> None:
        set_subnet(stage, {b: subnets[subnet][b] for b in blocks})

    return stage, make_optimizer(optimizer, trainable(stage)), choose


def _sequential(args: argparse.Namespace, spec: str) -> dict:
    from executor.nn.stages import loss_fn, synthetic_batch
    from executor.reference import train_subnets_sequentially
    from sim.models import build_model

    torch.set_num_threads(1)
    stage_layers, subnets, _ = _plan(args, spec, 1)
    stage, optimizer, choose = _stage(spec, 0, len(build_model(spec)), subnets, args.optimizer)
    start = time.perf_counter()
    losses = train_subnets_sequentially(stage, len(subnets), choose, optimizer,
                                        lambda s: synthetic_batch(spec, 1, seed=args.seed, index=s), loss_fn(spec))
    return {"mode": "sequential", "wall_s": time.perf_counter() - start, "losses": losses,
            "final_params_sha256": params_sha256(stage.state_dict())}


def _worker(args: argparse.Namespace, spec: str) -> None:
    import torch.distributed as dist

    from executor.clock import measure_offsets
    from executor.csp.runner import run_csp_rank
    from executor.nn.stages import boundary_specs, loss_fn, synthetic_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stage_layers, subnets, problem = _plan(args, spec, world)
    stage, optimizer, choose = _stage(spec, *stage_layers[rank], subnets, args.optimizer)
    offsets = measure_offsets(rank, world)  # all 0 on one host (one CLOCK_MONOTONIC), estimated otherwise
    dist.barrier()
    start = time.perf_counter()
    result = run_csp_rank(rank=rank, num_stages=world, stage=stage, uses=problem.uses, choose=choose,
                          optimizer=optimizer, batch=lambda s: synthetic_batch(spec, 1, seed=args.seed, index=s),
                          loss=loss_fn(spec), boundary_shape=boundary_specs(spec, [1], 1)[1].shape,
                          lookahead=args.lookahead, key_bytes=problem.key_bytes,
                          param_budget_bytes=args.device_param_budget, prefetch=args.prefetch)
    wall = time.perf_counter() - start
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(({k: v.detach() for k, v in stage.state_dict().items()}, result, wall), gathered, dst=0)
    if rank == 0:
        _write_outputs(args, spec, stage_layers, subnets, gathered, [o.offset_s for o in offsets])  # type: ignore
    dist.barrier()
    dist.destroy_process_group()


def _write_outputs(args: argparse.Namespace, spec: str, stage_layers, subnets, gathered: list,
                   offsets_s: list[float]) -> None:
    """Rank 0: ``metrics.json`` (the run's keys, the trace metrics of ``sim.run``, copy statistics), ``trace.json``
    and ``gantt.png`` of the whole run, in the simulator's format."""
    from executor.csp.trace import csp_trace
    from sim.report.metrics import compute_metrics
    from sim.report.outputs import write_run_outputs

    world = len(gathered)
    state, losses = {}, {}
    for part, result, _ in gathered:
        state.update(part)
        losses.update(result.losses)
    budget = args.device_param_budget
    policy = args.prefetch if budget is not None else "resident"  # what ran: no budget means everything resident
    meta = {"lookahead": args.lookahead, "num_subnets": args.subnets, "prefetch": policy,
            "param_budget_bytes": budget}
    trace = csp_trace([r.spans for _, r, _ in gathered], offsets_s, ["cpu"] * world, meta)
    metrics = compute_metrics(trace, num_microbatches=args.subnets, microbatch_size=1)
    wall = max(w for _, _, w in gathered)
    metrics.update({
        "mode": "csp", "stages": world, "wall_s": wall, "losses": {str(k): v for k, v in sorted(losses.items())},
        "forward_order_per_stage": [[s for _, s in r.decisions] for _, r, _ in gathered],
        "final_params_sha256": params_sha256(state), "subnets": [list(s) for s in subnets],
        "layers_per_stage": [end - start for start, end in stage_layers]})
    metrics["plan"] = {"schedule": "csp", "model": spec, "topology": f"{world}xcpu",
                       "layers_per_stage": metrics["layers_per_stage"]}
    copies = [r.copies for _, r, _ in gathered if r.copies is not None]
    metrics["csp"] = {"subnets": args.subnets, "seed": args.seed, "lookahead": args.lookahead,
                      "subnets_per_s": args.subnets / wall, "device_param_budget_bytes": budget,
                      "prefetch": policy, "copies": copies,
                      "copy_wait_s": sum(c["copy_wait_s"] for c in copies)}
    title = f"measured csp · {spec} · {world}xcpu · {args.subnets} subnets" + (
        f" · budget {budget} B, {policy}" if budget is not None else "")
    write_run_outputs(Path(args.out), trace, metrics, title=title, gantt=not args.no_gantt)


def _launch(argv: list[str], stages: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from executor.launch import launch_local

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        launch_local("executor.naspipe", argv, stages)
    except ChildFailedError as exc:
        print(f"error: a CSP rank failed: {exc.get_first_failure()[1].message}", file=sys.stderr)
        return 1
    return 0


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    spec = _spec(args)
    for name in ("subnets", "stages", "lookahead"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from executor.launch import leave_worker

        _worker(args, spec)
        leave_worker(0)
    if args.sequential and args.device_param_budget is not None:
        raise SpecError("--device-param-budget applies to CSP runs on stages, not to --sequential")
    _plan(args, spec, 1 if args.sequential else args.stages)  # reject bad input before anything starts
    if args.sequential:
        record = _sequential(args, spec)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic({**record, "losses": {str(k): v for k, v in record["losses"].items()}},
                          out / "metrics.json")
    elif (status := _launch(argv, args.stages)) != 0:
        return status
    metrics = json.loads((Path(args.out) / "metrics.json").read_text())
    print(f"{metrics['mode']}: {args.subnets} subnets in {metrics['wall_s']:.2f} s, final parameters sha256 "
          f"{metrics['final_params_sha256']}")
    for c in metrics.get("csp", {}).get("copies", []):
        print(f"  stage {c['stage']} ({args.prefetch}): {c['h2d_bytes']} B in ({c['prefetches']} copies), "
              f"{c['d2h_bytes']} B out ({c['evictions']} keys), waited {c['copy_wait_s'] * 1e3:.2f} ms, peak "
              f"{c['peak_resident_bytes']} B resident")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
