"""Chrome trace-event JSON for a :class:`~sim.ir.trace.Trace`: write it, and read it back exactly.

The file opens in Perfetto (https://ui.perfetto.dev) and ``chrome://tracing``. Layout (DESIGN §3):

* one process per device: ``pid`` = rank, named ``"rank r · <device>"`` and sorted by rank;
* one thread per stream: ``tid`` = index of the stream in :data:`sim.ir.trace.STREAMS`, named after the stream;
* one complete event (``ph: "X"``) per span: ``name`` = op id, ``cat`` = kind, ``ts``/``dur`` in microseconds;
* a flow arrow (``ph: "s"`` on the SEND, ``ph: "f"``, ``bp: "e"`` on the RECV) per SEND/RECV pair.

Microseconds rounded for display do not round-trip, so every X event's ``args`` also holds the span's exact fields
(``start_s``/``end_s`` in float seconds); :func:`read_chrome_trace` rebuilds the trace from those alone. It is the
one reader for simulated and for measured (executor) traces.

The writer is deterministic (sorted keys, fixed separators, events in a canonical order: same trace, same bytes) and
atomic (a temporary file in the target directory, then :func:`os.replace`), so a crash never leaves a partial file.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from sim.core.errors import SpecError
from sim.core.fileio import write_bytes_atomic
from sim.ir.trace import STREAMS, Span, Trace

__all__ = ["to_chrome_trace", "write_chrome_trace", "read_chrome_trace"]

#: Key of ``otherData`` that holds the device names; the rest of ``otherData`` is ``Trace.meta``.
DEVICES_KEY = "devices"
#: Category and name of the flow events (SEND → RECV arrows).
FLOW_CAT = "p2p"

_SPAN_FIELDS = ("op", "kind", "rank", "stream", "vstage", "mb", "pair", "peer")
_ARG_KEYS = frozenset(_SPAN_FIELDS) | {"start_s", "end_s"}


def _us(seconds: float) -> float:
    """Seconds → microseconds, rounded to the nanosecond so the file stays short and readable."""
    return round(seconds * 1e6, 3)


def _span_key(span: Span) -> tuple:
    """The canonical span order, the same as :meth:`Trace.from_spans`."""
    return (span.start, span.rank, STREAMS.index(span.stream), span.end, span.op)


def _metadata_events(trace: Trace) -> list[dict[str, Any]]:
    """Process names/sort indices for every rank, thread names/sort indices for every stream a rank uses."""
    used: dict[int, set[int]] = defaultdict(set)
    for span in trace.spans:
        used[span.rank].add(STREAMS.index(span.stream))
    events: list[dict[str, Any]] = []
    for rank, device in enumerate(trace.devices):
        events.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank} · {device}"}})
        events.append({"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}})
        for tid in sorted(used[rank]):
            thread = {"ph": "M", "pid": rank, "tid": tid}
            events.append({**thread, "name": "thread_name", "args": {"name": STREAMS[tid]}})
            events.append({**thread, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return events


def _complete_event(span: Span) -> dict[str, Any]:
    """The ``ph: "X"`` event of one span; ``args`` carries every field needed to rebuild it exactly."""
    if not (math.isfinite(span.start) and math.isfinite(span.end)):
        raise ValueError(f"span {span.op} on rank {span.rank} has a non-finite time ({span.start}, {span.end})")
    ts = _us(span.start)
    # Plain int/float, so numpy scalars coming from an engine serialise too.
    args: dict[str, Any] = {
        "op": span.op,
        "kind": span.kind,
        "rank": int(span.rank),
        "stream": span.stream,
        "vstage": int(span.vstage),
        "mb": None if span.mb is None else int(span.mb),
        "pair": None if span.pair is None else int(span.pair),
        "peer": None if span.peer is None else int(span.peer),
        "start_s": float(span.start),
        "end_s": float(span.end),
    }
    return {
        "ph": "X",
        "name": span.op,
        "cat": span.kind,
        "pid": args["rank"],
        "tid": STREAMS.index(span.stream),
        "ts": ts,
        "dur": round(_us(span.end) - ts, 3),
        "args": args,
    }


def _flow_anchor(span: Span) -> float:
    """Where a flow event binds: the middle of the span (µs), so a neighbour that ends or starts there never wins."""
    return round((_us(span.start) + _us(span.end)) / 2, 3)


def _flow_events(spans: list[Span]) -> list[dict[str, Any]]:
    """One ``s``/``f`` pair per pair id that has exactly one SEND and one RECV span, ordered by pair id."""
    sends: dict[int, list[Span]] = defaultdict(list)
    recvs: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        if span.pair is None:
            continue
        if span.kind.startswith("SEND"):
            sends[span.pair].append(span)
        elif span.kind.startswith("RECV"):
            recvs[span.pair].append(span)
    events: list[dict[str, Any]] = []
    for pair in sorted(sends.keys() & recvs.keys()):
        if len(sends[pair]) != 1 or len(recvs[pair]) != 1:
            continue  # ambiguous pairing: an arrow to the wrong op would mislead more than no arrow
        send, recv = sends[pair][0], recvs[pair][0]
        name = f"{send.op} -> {recv.op}"
        common = {"cat": FLOW_CAT, "id": int(pair), "name": name}
        events.append({**common, "ph": "s", "pid": int(send.rank), "tid": STREAMS.index(send.stream),
                       "ts": _flow_anchor(send)})
        events.append({**common, "ph": "f", "bp": "e", "pid": int(recv.rank), "tid": STREAMS.index(recv.stream),
                       "ts": _flow_anchor(recv)})
    return events


def to_chrome_trace(trace: Trace) -> dict:
    """Convert a trace to a Chrome trace-event document.

    Args:
        trace: the trace; span times in seconds.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {**trace.meta, "devices": [...]}}``, events in
        canonical order: metadata by rank, then X events in span order, then flow events by pair id.

    Raises:
        ValueError: ``trace.meta`` uses the reserved key ``"devices"``, or a span time is not finite.
    """
    if DEVICES_KEY in trace.meta:
        raise ValueError(f"trace.meta may not use the reserved key {DEVICES_KEY!r}: it holds the device names")
    spans = sorted(trace.spans, key=_span_key)
    events = _metadata_events(trace) + [_complete_event(s) for s in spans] + _flow_events(spans)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {**trace.meta, DEVICES_KEY: list(trace.devices)},
    }


def write_chrome_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as Chrome trace-event JSON, deterministically and atomically.

    Args:
        trace: the trace; span times in seconds (written as µs in ``ts``/``dur``, exact seconds in ``args``).
        path: the ``.json`` file to write; its directory must exist.

    Raises:
        ValueError: see :func:`to_chrome_trace`, or ``trace.meta`` is not JSON-serialisable.
        OSError: the file cannot be written (nothing is left behind at ``path``).
    """
    document = to_chrome_trace(trace)
    try:
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except TypeError as exc:
        raise ValueError(f"trace is not JSON-serialisable (check trace.meta): {exc}") from exc
    write_bytes_atomic(path, (text + "\n").encode("ascii"))


# --------------------------------------------------------------------------------------------------- reading


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, float) or _is_int(value)) and math.isfinite(value)


def _span_from_args(args: object, where: str) -> Span:
    """Rebuild one span from an X event's ``args``; raises ``ValueError`` saying which field is wrong."""
    if not isinstance(args, dict):
        raise ValueError(f"{where} has no args object")
    missing = sorted(_ARG_KEYS - args.keys())
    if missing:
        raise ValueError(f"{where} args lack {', '.join(missing)}")
    for name in ("op", "kind", "stream"):
        if not isinstance(args[name], str):
            raise ValueError(f"{where} args.{name} is not a string: {args[name]!r}")
    for name in ("rank", "vstage"):
        if not _is_int(args[name]):
            raise ValueError(f"{where} args.{name} is not an integer: {args[name]!r}")
    for name in ("mb", "pair", "peer"):
        if args[name] is not None and not _is_int(args[name]):
            raise ValueError(f"{where} args.{name} is neither an integer nor null: {args[name]!r}")
    for name in ("start_s", "end_s"):
        if not _is_number(args[name]):
            raise ValueError(f"{where} args.{name} is not a finite number: {args[name]!r}")
    fields = {name: args[name] for name in _SPAN_FIELDS}
    return Span(start=float(args["start_s"]), end=float(args["end_s"]), **fields)


def _parse_document(document: object) -> Trace:
    """Rebuild a trace from a parsed document; raises ``ValueError`` describing the first problem."""
    if not isinstance(document, dict):
        raise ValueError(f"top level is a {type(document).__name__}, not an object")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("missing or non-list 'traceEvents'")
    other = document.get("otherData")
    if not isinstance(other, dict):
        raise ValueError("missing or non-object 'otherData'")
    devices = other.get(DEVICES_KEY)
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise ValueError(f"'otherData.{DEVICES_KEY}' is not a list of device names")
    spans = []
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise ValueError(f"traceEvents[{index}] is not an object")
        if event.get("ph") == "X":
            spans.append(_span_from_args(event.get("args"), f"traceEvents[{index}] ({event.get('name')!r})"))
    meta = {key: value for key, value in other.items() if key != DEVICES_KEY}
    return Trace.from_spans(spans, devices, meta)  # Trace checks ranks, streams and end >= start


def read_chrome_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`write_chrome_trace` (by the simulator or by the executor).

    Spans are rebuilt exactly from the X events' ``args``, device names from ``otherData.devices`` and the meta
    from the rest of ``otherData``. Other events (metadata, flows) are ignored.

    Args:
        path: the ``.json`` file.

    Returns:
        The trace, spans in canonical order.

    Raises:
        SpecError: the file is not JSON, or lacks ``traceEvents``/``otherData.devices``, or an X event lacks or has
            malformed ``args``, or a span is inconsistent (rank out of range, unknown stream, end before start).
        FileNotFoundError: the file does not exist.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8")
        document = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise SpecError(f"{os.fspath(path)}: not a JSON trace file ({exc})") from exc
    try:
        return _parse_document(document)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{os.fspath(path)}: malformed Chrome trace: {exc}") from exc
