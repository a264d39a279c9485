"""``python -m executor.naspipe``: train a supernet's subnet sequence with CSP on real ranks, or one by one.

Example::

    python -m executor.naspipe --space c3 --model-overrides hidden=64,blocks=8 --subnets 32 --stages 2 --out runs/n
    python -m executor.naspipe --space c3 --model-overrides hidden=64,blocks=8 --subnets 32 --sequential --out runs/s

Both write ``metrics.json`` with ``final_params_sha256`` and every subnet's loss: NASPipe's claim is that they are
equal, bitwise, for any number of stages. The pipelined run takes its plan — partition, subnet table — from
:func:`sim.csp_plan.build_csp_problem`, exactly as ``sim.run --schedule csp`` does, and each rank decides online
with :func:`sim.csp.csp_pick` (``executor.csp_runner``). Ranks are launched on this host with torch's elastic
launcher (as ``executor.run`` does), gloo on CPU, one intra-op thread each: bitwise equality needs the same kernels,
and a CPU kernel's reduction order can depend on its thread count. The embedding and head are frozen (see
``executor.csp_runner``). Bad input prints one ``error:`` line and exits with status 2.
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

from sim.errors import SpecError, fail, run_cli
from sim.fileio import write_json_atomic

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
    parser.add_argument("--out", required=True)
    return parser


def _spec(args: argparse.Namespace) -> str:
    from sim.supernet_space import space_spec

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
    from sim.csp_plan import CspInputs, build_csp_problem

    _, _, stage_layers, subnets, problem = build_csp_problem(CspInputs(
        model=spec, space=None, topology=f"{stages}xcpu", subnets=args.subnets, seed=args.seed,
        lookahead=args.lookahead, partition="uniform"))
    return stage_layers, subnets, problem.uses


def _stage(spec: str, start: int, end: int, subnets, optimizer: str):
    from executor.csp_runner import freeze_shared, trainable
    from executor.models_supernet import set_subnet
    from executor.modules import build_stage
    from executor.optim import make_optimizer

    stage = build_stage(spec, start, end, seed=0)
    freeze_shared(stage, SHARED_LAYERS)
    blocks = [i - 1 for i in range(start, end) if 1 <= i <= len(subnets[0])]

    def choose(subnet: int) -> None:
        set_subnet(stage, {b: subnets[subnet][b] for b in blocks})

    return stage, make_optimizer(optimizer, trainable(stage)), choose


def _sequential(args: argparse.Namespace, spec: str) -> dict:
    from executor.csp_runner import train_subnets_sequentially
    from executor.modules import loss_fn, synthetic_batch
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

    from executor.csp_runner import run_csp_rank
    from executor.modules import boundary_specs, loss_fn, synthetic_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stage_layers, subnets, uses = _plan(args, spec, world)
    stage, optimizer, choose = _stage(spec, *stage_layers[rank], subnets, args.optimizer)
    dist.barrier()
    start = time.perf_counter()
    result = run_csp_rank(rank=rank, num_stages=world, stage=stage, uses=uses, choose=choose, optimizer=optimizer,
                          batch=lambda s: synthetic_batch(spec, 1, seed=args.seed, index=s), loss=loss_fn(spec),
                          boundary_shape=boundary_specs(spec, [1], 1)[1].shape, lookahead=args.lookahead)
    wall = time.perf_counter() - start
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(({k: v.detach() for k, v in stage.state_dict().items()}, result.losses,
                        [s for _, s in result.decisions], wall), gathered, dst=0)
    if rank == 0:
        state, losses, orders = {}, {}, []
        for part, part_losses, order, _ in gathered:  # type: ignore[union-attr]
            state.update(part)
            losses.update(part_losses)
            orders.append(order)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic({"mode": "csp", "stages": world, "wall_s": max(g[3] for g in gathered),  # type: ignore
                           "losses": {str(k): v for k, v in sorted(losses.items())},
                           "forward_order_per_stage": orders, "final_params_sha256": params_sha256(state),
                           "subnets": [list(s) for s in subnets], "layers_per_stage":
                           [end - start for start, end in stage_layers]}, out / "metrics.json")
    dist.barrier()
    dist.destroy_process_group()


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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
