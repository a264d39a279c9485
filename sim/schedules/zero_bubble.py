"""ZB-H1 (``zb1p``): 1F1B with the backward split into I and W (Qi et al., Zero Bubble PP, arXiv 2401.10241 §3.1).

The backward of a stage is two independent halves: I, the gradient w.r.t. the stage's input, which the previous
stage waits for, and W, the gradient w.r.t. the weights, which nobody waits for (§2). Sending the input gradient
upstream as soon as I is done and deferring W into the places where 1F1B idles removes most of the bubble.

Order on rank r (the handcrafted ZB-H1 of Figure 3, top; the same order as PyTorch's ``ScheduleInterleavedZeroBubble``
with one stage per rank, ``_get_1f1b_rank_ops(enable_zero_bubble=True)``):

* warm-up: ``min(p − r − 1, m)`` forwards, as in 1F1B (Megatron's count);
* steady state: for the k-th backward, one forward (while any is left), then I of microbatch k, then — from the
  (r + 1)-th step on — the W of the oldest microbatch whose I is done: rank r defers its first r weight gradients;
* cool-down: the W still deferred, oldest first.

With F = I = W = 1 time unit and free links every rank idles exactly p − 1 units, so the iteration takes
3m + p − 1 units for any m ≥ p: m(T_F + T_B + T_W) + (p − 1)(T_F + T_B − T_W) in the paper's notation (§3.1,
T_B being our I), against 1F1B's 3(m + p − 1); the bubble ÷ ideal drops from (p − 1)/m to (p − 1)/(3m).

Memory. A microbatch's activations live from its F to its W (the engine's convention: W still needs the layer
inputs). Rank r holds at most ``min(p, m)`` microbatches: the first rank holds p, exactly 1F1B's worst stage, which is
the paper's "same peak memory as 1F1B". The later ranks hold p as well instead of 1F1B's p − r: the paper counts only
the smaller part W keeps (its M_W < M_B), and no order reaches 3m + p − 1 with less. The last rank cannot start
before p − 1 units and has 3m units of work, so it must run without a break; its last I must end by 3m − 1, because
the input gradient needs p − 1 more units to reach rank 0, which then runs one W; so p units of the last rank's
work, p of its W, come after its last F, and p microbatches are in flight there.

::

    p=3, m=4, one column per time unit (F = I = W = 1)
    rank 0: F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
    rank 1: .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
    rank 2: .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
"""

from __future__ import annotations

from sim.ir.plan import Op, OpKind
from sim.schedules.gpipe import _check

__all__ = ["zb1p", "zb1p_rank"]


def zb1p_rank(stage: int, num_stages: int, num_microbatches: int) -> tuple[Op, ...]:
    """The program of one stage: 1F1B warm-up, then F / I / deferred W, then the W still pending."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    ops = [Op(OpKind.F, stage, mb) for mb in range(warmup)]
    next_w = 0
    for k in range(m):
        if warmup + k < m:
            ops.append(Op(OpKind.F, stage, warmup + k))
        ops.append(Op(OpKind.I, stage, k))
        if k >= stage:  # the first `stage` weight gradients wait for the cool-down, where rank `stage` would idle
            ops.append(Op(OpKind.W, stage, next_w))
            next_w += 1
    ops.extend(Op(OpKind.W, stage, mb) for mb in range(next_w, m))
    return tuple(ops)


def zb1p(num_stages: int, num_microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of ZB-H1, one per rank; rank r runs stage r.

    Args:
        num_stages: pipeline stages p (= ranks), ≥ 1.
        num_microbatches: microbatches m per iteration, ≥ 1 (the 3m + p − 1 makespan needs m ≥ p).
    """
    _check(num_stages, num_microbatches)
    return tuple(zb1p_rank(stage, num_stages, num_microbatches) for stage in range(num_stages))
