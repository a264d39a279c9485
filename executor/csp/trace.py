"""One trace of a CSP run on real ranks, in the simulator's format (``sim.ir.trace``), from every rank's spans.

:mod:`executor.measured` does this for a fixed plan; a CSP run has no plan (each rank decides online), so its ranks
record :class:`sim.ir.trace.Span` objects directly (:class:`executor.csp.runner.CspRankResult`), and what is left is to
put them on one clock and give each transfer its wire time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sim.ir.trace import Span, Trace

__all__ = ["csp_trace"]


def csp_trace(rank_spans: Sequence[Sequence[Span]], offsets_s: Sequence[float], devices: Sequence[str],
              meta: dict[str, Any]) -> Trace:
    """One trace of a CSP run from every rank's spans, in the simulator's format, time 0 at the first op.

    A transfer is taken to be on the wire from the send's post to the payload's arrival (the receiver always has a
    receive posted), so SEND and RECV of one ``pair`` both get that interval, as in :mod:`executor.measured`.

    Args:
        rank_spans: per rank, its spans on its own clock (:attr:`CspRankResult.spans`).
        offsets_s: per rank, what to add to its clock to get rank 0's (``executor.clock``), s.
        devices: device name per rank.
        meta: ``Trace.meta``; ``source`` is set to ``"executor"``.
    """
    spans = [dataclasses.replace(s, start=s.start + off, end=s.end + off)
             for part, off in zip(rank_spans, offsets_s, strict=True) for s in part]
    posted = {s.pair: s.start for s in spans if s.kind.startswith("SEND")}
    arrived = {s.pair: s.end for s in spans if s.kind.startswith("RECV")}
    wire = {pair: (min(posted[pair], arrived[pair]), arrived[pair]) for pair in posted.keys() & arrived.keys()}
    spans = [dataclasses.replace(s, start=wire[s.pair][0], end=wire[s.pair][1]) if s.pair in wire else s
             for s in spans]
    origin = min((s.start for s in spans), default=0.0)
    spans = [dataclasses.replace(s, start=s.start - origin, end=s.end - origin) for s in spans]
    return Trace.from_spans(spans, tuple(devices), {**meta, "source": "executor", "schedule": "csp"})
