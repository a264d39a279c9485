"""From the ranks' raw op timings to measured traces in the simulator's format (L2 of the IR, DESIGN §3).

Every rank sends rank 0 a :class:`RankReport`: per iteration, each op's (start, end) on the rank's own clock. Rank 0
moves them onto its clock (``executor.clock``), turns each iteration into a :class:`sim.ir.trace.Trace` whose time 0 is
the iteration's first op start, and from then on the simulator's code (metrics, Chrome trace, Gantt) takes over.

Point-to-point spans are made to mean what they mean in the simulator: the time the message was on the wire. A rank only
sees when it posted an ``isend``/``irecv`` and when the wait on it returned, so a transfer is taken to start when both
sides had posted (a rendezvous, as in ``sim.engine.simpy_engine``) and to end when the receiver's wait returned; the
SEND and the RECV both get that interval. The receiver waits right before the consuming op (``sim.plan.lower`` puts
every RECV there), so the end is the data's arrival whenever the consumer was waiting for it, and otherwise at most the
consumer's start, which is when the data became useful.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.clock import ClockOffset
from sim.ir.plan import RECV_KINDS, SEND_KINDS, Op, Plan, stream_of
from sim.ir.trace import Span, Trace

__all__ = ["RankReport", "measured_trace", "iteration_times"]


@dataclass(frozen=True)
class RankReport:
    """What one rank measured, sent to rank 0 at the end of the run.

    Attributes:
        rank: the rank.
        device: the device it ran on, e.g. ``"cpu"`` or the CUDA device name.
        threads: intra-op threads it used (``torch.get_num_threads``).
        timings: per iteration (warm-up included), ``(op id, start s, end s)`` in program order, on its own clock.
        losses: per iteration, the loss of each microbatch (empty lists unless the rank runs the last vstage).
    """

    rank: int
    device: str
    threads: int
    timings: tuple[tuple[tuple[str, float, float], ...], ...]
    losses: tuple[tuple[float, ...], ...]


def measured_trace(plan: Plan, reports: Sequence[RankReport], offsets: Sequence[ClockOffset], iteration: int,
                   meta: dict[str, object] | None = None) -> Trace:
    """The trace of one iteration, on rank 0's clock, shifted so its first op starts at 0.

    Args:
        plan: the plan that ran.
        reports: one report per rank, in rank order.
        offsets: each rank's clock offset to rank 0.
        iteration: which iteration (0-based, warm-up included).
        meta: extra ``Trace.meta`` entries; ``source`` is always ``"executor"``.

    Raises:
        ValueError: a report lacks the iteration or names an op the plan does not have on that rank.
    """
    ops: dict[str, tuple[int, Op]] = {op.id: (rank, op) for rank, program in enumerate(plan.programs) for op in program}
    raw: dict[str, tuple[float, float]] = {}
    for report, offset in zip(reports, offsets, strict=True):
        if iteration >= len(report.timings):
            raise ValueError(f"rank {report.rank} reported {len(report.timings)} iterations, not {iteration + 1}")
        for op_id, start, end in report.timings[iteration]:
            rank, _ = ops.get(op_id, (None, None))
            if rank != report.rank:
                raise ValueError(f"rank {report.rank} reported op {op_id!r}, which is not in its program")
            raw[op_id] = (start + offset.offset_s, end + offset.offset_s)
    send_of_pair = {op.pair: op.id for _, op in ops.values() if op.kind in SEND_KINDS}
    recv_of_pair = {op.pair: op.id for _, op in ops.values() if op.kind in RECV_KINDS}
    times = dict(raw)
    for pair, send_id in send_of_pair.items():
        recv_id = recv_of_pair[pair]
        (send_post, _), (recv_post, arrived) = raw[send_id], raw[recv_id]
        # min() guards against the clock estimate's error making the arrival precede the later post.
        start = min(max(send_post, recv_post), arrived)
        times[send_id] = times[recv_id] = (start, arrived)
    origin = min(start for start, _ in times.values())
    spans = []
    for op_id, (start, end) in times.items():
        rank, op = ops[op_id]
        spans.append(Span(op_id, op.kind.value, rank, stream_of(op.kind), start - origin, end - origin, op.vstage,
                          op.mb, op.pair, op.peer))
    devices = [report.device for report in reports]
    return Trace.from_spans(spans, devices, {**(meta or {}), "source": "executor", "schedule": plan.schedule,
                                             "iteration": iteration})


def iteration_times(plan: Plan, reports: Sequence[RankReport], offsets: Sequence[ClockOffset]) -> list[float]:
    """The measured time of every iteration (warm-up included), s: first op start to last op end over all ranks."""
    count = min(len(report.timings) for report in reports)
    return [measured_trace(plan, reports, offsets, i).makespan for i in range(count)]
