"""GPipe: fill-drain pipelining with a flush (Huang et al., arXiv 1811.06965, §2.2–2.3).

Every rank runs the forward of all m microbatches, then their backwards. With p stages of uniform cost the
iteration takes (m + p − 1)(t_f + t_b) and the bubble fraction is (p − 1)/(m + p − 1) (GPipe §2.3); stage 0 holds
the activations of all m microbatches at its peak.

Backwards run in microbatch order 0..m−1, as PyTorch's ``ScheduleGPipe`` does; torchgpipe runs them in reverse. The
choice does not change the makespan or the peak memory under uniform costs, only which microbatch drains first.

::

    p=3, m=4 (F = forward, B = backward, columns are time slots of equal F and B cost)
    rank 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
    rank 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
    rank 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
"""

from __future__ import annotations

from sim.ir.plan import Op, OpKind

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of GPipe, one per rank; rank r runs stage r.

    Args:
        num_stages: pipeline stages p (= ranks), ≥ 1.
        num_microbatches: microbatches m per iteration, ≥ 1.
    """
    _check(num_stages, num_microbatches)
    mbs = range(num_microbatches)
    return tuple(
        tuple(Op(OpKind.F, stage, mb) for mb in mbs) + tuple(Op(OpKind.B, stage, mb) for mb in mbs)
        for stage in range(num_stages)
    )


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"need at least one microbatch, got {num_microbatches}")
