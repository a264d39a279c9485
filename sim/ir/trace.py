"""L2 of the schedule IR: what actually happened, one :class:`Span` per executed op (DESIGN §3).

The simulator (``sim.engine.simpy_engine``) and the real executor both produce a :class:`Trace`; everything downstream
(metrics, Gantt chart, Chrome trace, predicted-vs-measured comparison) reads only this type, so a simulated run and a
real run are handled by the same code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

__all__ = ["Span", "Trace", "STREAMS", "canonical_order"]

#: The streams an op can run on. ``compute`` is the device's compute engine; ``send``/``recv`` are the two
#: directions of point-to-point traffic (kept apart so a rank that forwards while it receives shows both);
#: ``h2d``/``d2h`` are the PCIe copy engines; ``tp`` holds the tensor-parallel collectives the compute stream waits
#: for, ``collective`` the data-parallel ones (gradient reduction, parameter gathering), ``ep`` the expert-parallel
#: all-to-alls (appended last, so that the other streams keep their trace thread numbers).
STREAMS: tuple[str, ...] = ("compute", "send", "recv", "h2d", "d2h", "tp", "collective", "ep")


@dataclass(frozen=True, slots=True)
class Span:
    """One executed op.

    Attributes:
        op: the op's id in the IR string notation, e.g. ``"2F0"``, ``"3SEND_F1"``; unique within a rank.
        kind: the op kind's value, e.g. ``"F"``, ``"B"``, ``"SEND_F"``, ``"OPT_STEP"``.
        rank: the device (rank) that ran it.
        stream: one of :data:`STREAMS`.
        start: start time in seconds from the start of the iteration.
        end: end time in seconds (``end >= start``).
        vstage: the virtual stage the op belongs to.
        mb: microbatch id (``None`` for ops that are not per microbatch, e.g. ``OPT_STEP``).
        pair: for SEND/RECV, the id shared by a send and its matching receive (draws a flow arrow); else ``None``.
        peer: for SEND/RECV, the other rank; else ``None``.
    """

    op: str
    kind: str
    rank: int
    stream: str
    start: float
    end: float
    vstage: int
    mb: int | None = None
    pair: int | None = None
    peer: int | None = None

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


def canonical_order(spans: Iterable[Span]) -> list[Span]:
    """The spans sorted by ``(start, rank, stream index, end, op)``, the order of :attr:`Trace.spans`.

    Sorted by start first, then each run of equal starts (a handful of spans: a SEND and its RECV, ops that start
    when one finishes) by the whole key. The result is that of one sort by the whole key, but without a key tuple
    per span alive at once (about 100 bytes a span, 200 MB for a two-million-op iteration).
    """
    ordered = list(spans)
    ordered.sort(key=_START)
    n, i = len(ordered), 0
    while i < n:
        start, j = ordered[i].start, i + 1
        while j < n and ordered[j].start == start:
            j += 1
        if j - i > 1:
            ordered[i:j] = sorted(ordered[i:j], key=_span_key)
        i = j
    return ordered


_START = attrgetter("start")


#: Each stream's place in :data:`STREAMS` (a dict lookup where ``STREAMS.index`` scans the tuple); an unknown one
#: sorts last, and :class:`Trace` refuses it by name.
_STREAM_INDEX = {stream: index for index, stream in enumerate(STREAMS)}


def _span_key(span: Span) -> tuple:
    return (span.start, span.rank, _STREAM_INDEX.get(span.stream, len(STREAMS)), span.end, span.op)


@dataclass(frozen=True)
class Trace:
    """All spans of one run, plus the device names of the ranks.

    Attributes:
        spans: the spans, sorted by ``(start, rank, stream, op)`` so the order is canonical.
        devices: device name per rank (``devices[r]`` ran rank ``r``), e.g. ``("v100-sxm2-32gb", ...)``.
        meta: free-form, JSON-serialisable facts about the run (source: ``"sim"`` or ``"executor"``, plan name, ...).
    """

    spans: tuple[Span, ...]
    devices: tuple[str, ...]
    meta: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for span in self.spans:
            if not 0 <= span.rank < len(self.devices):
                raise ValueError(f"span {span.op} has rank {span.rank} outside 0..{len(self.devices) - 1}")
            if span.stream not in _STREAM_INDEX:
                raise ValueError(f"span {span.op} has unknown stream {span.stream!r}")
            if span.end < span.start:
                raise ValueError(f"span {span.op} ends before it starts ({span.start} > {span.end})")

    @classmethod
    def from_spans(cls, spans, devices, meta=None) -> Trace:
        """Build a trace from spans in any order; sorts them canonically (see :func:`canonical_order`)."""
        return cls(tuple(canonical_order(spans)), tuple(devices), dict(meta or {}))

    @property
    def num_ranks(self) -> int:
        """Number of ranks (devices)."""
        return len(self.devices)

    @property
    def makespan(self) -> float:
        """Time from the earliest start to the latest end, in seconds (0 for an empty trace)."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def on_rank(self, rank: int, stream: str | None = None) -> list[Span]:
        """Spans of one rank (optionally one stream), in start order."""
        return [s for s in self.spans if s.rank == rank and (stream is None or s.stream == stream)]
