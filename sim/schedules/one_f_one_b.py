"""1F1B with a flush, a.k.a. PipeDream-Flush (Narayanan et al., arXiv 2006.09503; Megatron-LM, arXiv 2104.04473
§2.2.1).

Rank r (stage r of p) runs ``p − r − 1`` warm-up forwards, then alternates one forward and one backward until every
forward has run, then drains the remaining backwards. This is Megatron-LM's order (``num_warmup = p − rank − 1``);
PyTorch's ``Schedule1F1B`` counts the first steady-state forward as warm-up (``p − r``), which is the same op order.
The makespan under uniform costs equals GPipe's, (m + p − 1)(t_f + t_b), but stage r holds at most ``p − r``
microbatches of activations instead of m.

::

    p=3, m=4
    rank 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    rank 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    rank 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
"""

from __future__ import annotations

from sim.ir.plan import Op, OpKind
from sim.schedules.gpipe import _check

__all__ = ["one_f_one_b", "one_f_one_b_rank"]


def one_f_one_b_rank(stage: int, num_stages: int, num_microbatches: int) -> tuple[Op, ...]:
    """The program of one stage: warm-up forwards, steady 1F1B pairs, cool-down backwards."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [Op(OpKind.F, stage, mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops.append(Op(OpKind.F, stage, warmup + i))
        ops.append(Op(OpKind.B, stage, i))
    ops.extend(Op(OpKind.B, stage, mb) for mb in range(num_microbatches - warmup, num_microbatches))
    return tuple(ops)


def one_f_one_b(num_stages: int, num_microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of 1F1B (PipeDream-Flush), one per rank; rank r runs stage r.

    Args:
        num_stages: pipeline stages p (= ranks), ≥ 1.
        num_microbatches: microbatches m per iteration, ≥ 1.
    """
    _check(num_stages, num_microbatches)
    return tuple(one_f_one_b_rank(stage, num_stages, num_microbatches) for stage in range(num_stages))
