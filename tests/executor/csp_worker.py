"""A spawned rank of the CSP reproducibility test (kept importable, as ``torch.multiprocessing.spawn`` needs)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SHARED = ("layers.embed.", "layers.head.")  # every subnet uses them; frozen under CSP (executor.csp_runner)


def setup(spec, start, end, subnets):
    """The stage [start, end) of ``spec`` with shared layers frozen, its optimizer, and the subnet chooser."""
    from executor.csp_runner import freeze_shared, trainable
    from executor.models_supernet import set_subnet
    from executor.modules import build_stage
    from executor.optim import make_optimizer

    stage = build_stage(spec, start, end, seed=0)
    freeze_shared(stage, SHARED)
    optimizer = make_optimizer("adam", trainable(stage))
    blocks = [i - 1 for i in range(start, end) if 1 <= i <= len(subnets[0])]  # graph layer i >= 1 is block i - 1

    def choose(subnet):
        set_subnet(stage, {b: subnets[subnet][b] for b in blocks})

    return stage, optimizer, choose


def rank_main(rank, world, init_file, spec, ranges, subnets, uses, out_dir):
    from executor.csp_runner import run_csp_rank
    from executor.modules import boundary_specs, loss_fn, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    start, end = ranges[rank]
    stage, optimizer, choose = setup(spec, start, end, subnets)
    shape = boundary_specs(spec, [1], 1)[1].shape

    def batch(subnet):
        return synthetic_batch(spec, 1, seed=0, index=subnet)

    result = run_csp_rank(rank=rank, num_stages=world, stage=stage, uses=uses, choose=choose, optimizer=optimizer,
                          batch=batch, loss=loss_fn(spec), boundary_shape=shape, lookahead=4)
    torch.save({k: v.detach() for k, v in stage.state_dict().items()}, Path(out_dir, f"stage{rank}.pt"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"losses": result.losses,
                                                            "decisions": [s for _, s in result.decisions]}))
    dist.barrier()
    dist.destroy_process_group()
