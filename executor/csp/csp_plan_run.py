"""A CSP plan run by ``executor.run --plan``: one rank of it, or all its subnets in one process (the reference).

A csp plan (``sim.run --schedule csp``, checked by :func:`sim.csp.csp_plan.check_csp_plan`) carries the supernet, one
stage per rank, the subnet table, the lookahead and the context-switching budget; every rank builds its stage from
the plan and runs :func:`executor.csp.runner.run_csp_rank`, which decides online with the simulator's own
:func:`sim.csp.rules.csp_pick`. The whole subnet sequence is one run (a plan trains each subnet once), so there are no
warm-up or repeated iterations. The embedding and head are frozen (``SHARED_LAYERS``, ``executor.csp.runner``).

NASPipe's claim is that the result is bitwise equal to training the same subnets one by one in one process, for any
number of stages: :func:`run_reference` is that process, and both write ``final_params_sha256`` (SHA-256 over every
parameter's name and bytes) and every subnet's loss into ``metrics.json``. Bitwise equality needs the same kernels,
so CSP ranks and the reference default to one intra-op thread (a CPU kernel's reduction order can depend on its
thread count). Rank 0's outputs are :mod:`executor.csp.csp_outputs`'s.

Checkpoints, resume and restarts (``--checkpoint-every K``, ``--resume``, ``--max-restarts``, ``--fail``) count
subnets: a csp run's iterations are its subnets, each one training step. The pipeline drains at each checkpoint
(:mod:`executor.csp.runner`), each rank writes its stage, its optimizer state and (the last stage) the losses so far
(:mod:`executor.checkpoint`), and a resumed run continues the sequence at the checkpoint's subnet and ends bitwise
where the uninterrupted one does.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from executor.csp.csp_outputs import finish_csp_run, params_sha256
from executor.options import RunOptions
from sim.ir.plan import Plan

__all__ = ["SHARED_LAYERS", "run_csp_plan_rank", "run_reference"]

#: Parameter-name prefixes of the layers every subnet uses; frozen under CSP.
SHARED_LAYERS = ("layers.embed.", "layers.head.")


def _stage(plan: Plan, start: int, end: int, options: RunOptions):
    """This stage's module with the shared layers frozen, its optimizer, and ``choose(subnet)``."""
    from executor.nn.optim import make_optimizer
    from executor.nn.stages import build_stage
    from executor.nn.supernet import freeze_shared, set_subnet, trainable

    stage = build_stage(plan.model, start, end, seed=options.seed)
    freeze_shared(stage, SHARED_LAYERS)
    blocks = [i - 1 for i in range(start, end) if 1 <= i <= len(plan.subnets[0])]

    def choose(subnet: int) -> None:
        set_subnet(stage, {b: plan.subnets[subnet][b] for b in blocks})

    return stage, make_optimizer(options.optimizer, trainable(stage), options.lr), choose


def _batch(plan: Plan, options: RunOptions):
    from executor.nn.stages import synthetic_batch

    return lambda subnet: synthetic_batch(plan.model, plan.microbatch_size, seed=options.data_seed, index=subnet)


def run_csp_plan_rank(options: RunOptions, plan: Plan, rank: int, world_size: int) -> None:
    """Run this rank's stage of a checked csp plan in an initialised environment; rank 0 writes the outputs."""
    from executor.clock import measure_offsets
    from executor.csp.runner import run_csp_rank
    from executor.launch import join_world
    from executor.nn.stages import boundary_specs, loss_fn
    from executor.restart import die_if_failing, restart_record
    from sim.csp.csp_plan import check_csp_plan

    setup = check_csp_plan(plan)
    torch.set_num_threads(options.threads or 1)
    join_world(options.backend, options.timeout_s)
    stage, optimizer, choose = _stage(plan, *plan.placement.vstage_layers[rank], options)
    earlier_losses = _resume(options, stage, optimizer, rank)
    offsets = measure_offsets(rank, world_size)  # all 0 on one host (one CLOCK_MONOTONIC), estimated otherwise
    # A csp run has no warm-up: torch.autograd.backward with given output gradients imports this module (and sympy)
    # on its first call, about 0.3 s on a 2-core host, which would land inside the first subnet's backward.
    importlib.import_module("torch.fx.experimental.symbolic_shapes")
    dist.barrier()
    wall_clock = time.time() - time.perf_counter()  # what turns this process's perf_counter into time.time()
    start = time.perf_counter()
    result = run_csp_rank(rank=rank, num_stages=world_size, stage=stage, uses=setup.uses, choose=choose,
                          optimizer=optimizer, batch=_batch(plan, options), loss=loss_fn(plan.model),
                          boundary_shape=boundary_specs(plan.model, [1], plan.microbatch_size)[1].shape,
                          lookahead=plan.option("lookahead", 30), timeout_s=options.timeout_s,
                          key_bytes=setup.key_bytes, param_budget_bytes=plan.option("device_param_budget_bytes"),
                          prefetch=plan.option("prefetch", "resident"), first_subnet=options.first_iteration,
                          drain_every=options.checkpoint_every,
                          at_drain=_checkpoint_writer(options, stage, optimizer, rank, earlier_losses),
                          before_forward=lambda subnet: die_if_failing(options, rank, subnet, unit="subnet"),
                          after_update=_first_step_noter(options, rank, wall_clock))
    wall = time.perf_counter() - start
    result.losses = {**earlier_losses, **result.losses}
    state = {k: v.detach().cpu() for k, v in stage.state_dict().items()}
    if options.save_state:
        Path(options.save_state).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(options.save_state, f"stage{rank}.pt"))
    steps = _subnet_steps(result.spans, wall_clock)
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object((state, result, wall), gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        options = replace(options, restarts=restart_record(options, steps, time.time(), result.checkpoint_s))
        finish_csp_run(plan, options, gathered, [o.offset_s for o in offsets])
    dist.barrier()
    dist.destroy_process_group()


def _resume(options: RunOptions, stage: torch.nn.Module, optimizer: Any, rank: int) -> dict[int, float]:
    """With a checkpoint to continue from, put this rank's shard back; the losses of the subnets before it (the
    last stage's; empty elsewhere or without a checkpoint)."""
    if options.resume_from is None:
        return {}
    from executor.checkpoint import read_shard, restore
    from sim.core.errors import SpecError

    shard = read_shard(options.resume_from, rank)
    resumed = restore({rank: stage}, {rank: optimizer}, shard, fully_sharded=False)
    if resumed != options.first_iteration:
        raise SpecError(f"rank {rank}'s shard of {options.resume_from} resumes at subnet {resumed}, its marker says "
                        f"{options.first_iteration}")
    return {int(k): float(v) for k, v in shard.get("losses", {}).items()}


def _checkpoint_writer(options: RunOptions, stage: torch.nn.Module, optimizer: Any, rank: int,
                       earlier_losses: dict[int, float]):
    """``at_drain`` of :func:`executor.csp.runner.run_csp_rank`: this rank's shard after ``done`` subnets, then a
    barrier, then rank 0 marks the checkpoint complete (``executor.checkpoint``); ``None`` without checkpoints."""
    if not options.checkpoint_every:
        return None
    from executor.checkpoint import capture, complete, write_shard

    def at_drain(done: int, losses: Any) -> None:
        assert options.checkpoint_dir is not None
        state = capture({rank: stage}, {rank: optimizer}, fully_sharded=False, next_iteration=done)
        state["losses"] = {**earlier_losses, **losses}
        write_shard(options.checkpoint_dir, done, rank, state,
                    die_midway=options.die_in_checkpoint == (rank, done) and options.attempt == 0)
        dist.barrier()  # every shard is in place before the marker says so
        if rank == 0:
            complete(options.checkpoint_dir, done, dict(options.identity))

    return at_drain


def _first_step_noter(options: RunOptions, rank: int, wall_clock: float):
    """``after_update`` of :func:`executor.csp.runner.run_csp_rank`: notes the first subnet's step as it ends
    (``executor.restart.note_start``; rank 0 of the first attempt), for a restarted run's wall time."""
    from executor.restart import note_start

    noted = False

    def after_update(subnet: int, began: float, ended: float) -> None:
        nonlocal noted
        if not noted:
            note_start(options, rank, (began + wall_clock, ended + wall_clock))
            noted = True

    return after_update


def _subnet_steps(spans: list, wall_clock: float) -> list[tuple[float, float]]:
    """Each subnet's step on this rank, from its forward's start to its update's end, in ``time.time()`` s, in
    subnet order (what ``executor.restart`` measures a restart against)."""
    began = {s.mb: s.start for s in spans if s.kind == "F"}
    ended = {s.mb: s.end for s in spans if s.kind == "OPT_STEP"}
    return [(began[k] + wall_clock, ended[k] + wall_clock) for k in sorted(began.keys() & ended.keys())]


def run_reference(options: RunOptions, plan: Plan) -> dict[str, Any]:
    """Train the plan's subnets one by one in this process (the oracle CSP must equal); its ``metrics.json`` record.

    Returns:
        ``mode`` (``"reference"``), ``wall_s``, ``losses`` (subnet → loss) and ``final_params_sha256``.
    """
    from executor.nn.stages import loss_fn
    from executor.reference import train_subnets_sequentially
    from sim.csp.csp_plan import check_csp_plan

    check_csp_plan(plan)
    torch.set_num_threads(options.threads or 1)
    stage, optimizer, choose = _stage(plan, 0, plan.placement.num_layers, options)
    start = time.perf_counter()
    losses = train_subnets_sequentially(stage, plan.num_microbatches, choose, optimizer, _batch(plan, options),
                                        loss_fn(plan.model))
    return {"mode": "reference", "wall_s": time.perf_counter() - start,
            "losses": {str(k): v for k, v in sorted(losses.items())},
            "final_params_sha256": params_sha256(stage.state_dict())}
