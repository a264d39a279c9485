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

A 3D plan's trace has a row per process (``plan.world_size`` of them): the spans of every replica and tensor shard,
the collectives (``TP_*``, ``REDUCE_GRAD``, ``GATHER_PARAMS``) as spans of their own kinds, and the iteration time
from the first op's start to the last op's end over all processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from executor.clock import ClockOffset
from sim.ir.plan import RECV_KINDS, SEND_KINDS, Plan, stream_of
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
        peak_memory_bytes: the most bytes its tensors held at once during the measured iterations
            (``executor.memory``), or ``None`` when it was not measured (a CPU run without ``--measure-memory``).
        memory_method: how that peak was measured, or ``None``.
    """

    rank: int
    device: str
    threads: int
    timings: tuple[tuple[tuple[str, float, float], ...], ...]
    losses: tuple[tuple[float, ...], ...]
    peak_memory_bytes: int | None = None
    memory_method: str | None = None


def measured_trace(plan: Plan, reports: Sequence[RankReport], offsets: Sequence[ClockOffset], iteration: int,
                   meta: dict[str, object] | None = None) -> Trace:
    """The trace of one iteration, on rank 0's clock, shifted so its first op starts at 0.

    One trace row per process: for a 3D plan, row r is global rank r, which ran the program of its pipeline rank
    ``layout.coords(r)[0]``; its SEND/RECV peers are global ranks, and the pair ids of replica d's shard t are
    offset by ``(d·T + t) · pairs`` so that every transfer keeps a pair id of its own (pure pipelines keep the
    plan's).

    Args:
        plan: the plan that ran.
        reports: one report per process, in rank order.
        offsets: each process's clock offset to rank 0.
        iteration: which iteration (0-based, warm-up included).
        meta: extra ``Trace.meta`` entries; ``source`` is always ``"executor"``.

    Raises:
        ValueError: a report lacks the iteration or names an op its pipeline rank's program does not have.
    """
    layout = plan.layout
    programs = [{op.id: op for op in program} for program in plan.programs]
    recv_of_pair = {op.pair: op.id for program in plan.programs for op in program if op.kind in RECV_KINDS}
    pairs = max(recv_of_pair, default=-1) + 1
    raw: dict[tuple[int, str], tuple[float, float]] = {}
    for report, offset in zip(reports, offsets, strict=True):
        if iteration >= len(report.timings):
            raise ValueError(f"rank {report.rank} reported {len(report.timings)} iterations, not {iteration + 1}")
        program = programs[layout.coords(report.rank)[0]]
        for op_id, start, end in report.timings[iteration]:
            if op_id not in program:
                raise ValueError(f"rank {report.rank} reported op {op_id!r}, which is not in its program")
            raw[(report.rank, op_id)] = (start + offset.offset_s, end + offset.offset_s)
    times = dict(raw)
    for (rank, op_id), (send_post, _) in raw.items():
        op = programs[layout.coords(rank)[0]][op_id]
        if op.kind in SEND_KINDS:
            _, dp, tp = layout.coords(rank)
            recv = (layout.device(op.peer, dp, tp), recv_of_pair[op.pair])
            recv_post, arrived = raw[recv]
            # min() guards against the clock estimate's error making the arrival precede the later post.
            start = min(max(send_post, recv_post), arrived)
            times[(rank, op_id)] = times[recv] = (start, arrived)
    origin = min(start for start, _ in times.values())
    spans = []
    for (rank, op_id), (start, end) in times.items():
        _, dp, tp = layout.coords(rank)
        op = programs[layout.coords(rank)[0]][op_id]
        pair = None if op.pair is None else op.pair + (dp * layout.tp + tp) * pairs
        peer = None if op.peer is None else layout.device(op.peer, dp, tp)
        spans.append(Span(op_id, op.kind.value, rank, stream_of(op.kind), start - origin, end - origin, op.vstage,
                          op.mb, pair, peer))
    devices = [report.device for report in reports]
    extra: dict[str, object] = {}
    if plan.parallel is not None:
        extra = {"parallel": layout.describe(), "coords_of_rank": [list(layout.coords(r)) for r in range(len(reports))]}
    return Trace.from_spans(spans, devices, {**(meta or {}), **extra, "source": "executor", "schedule": plan.schedule,
                                             "iteration": iteration})


def iteration_times(plan: Plan, reports: Sequence[RankReport], offsets: Sequence[ClockOffset]) -> list[float]:
    """The measured time of every iteration (warm-up included), s: first op start to last op end over all ranks."""
    count = min(len(report.timings) for report in reports)
    return [measured_trace(plan, reports, offsets, i).makespan for i in range(count)]
