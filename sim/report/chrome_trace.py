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

import io
import itertools
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]  # what json.dumps uses for ASCII
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
    """Where a flow event binds: the middle of the span (µs), so a neighbour that ends or starts there never wins.

    The rounded midpoint is capped at ``ts + dur`` of the span's own X event, as a reader adds them: for a 1 ns span
    at 268 s the rounded midpoint was an ulp past that sum, outside the span it binds to.
    """
    ts = _us(span.start)
    return min(round((ts + _us(span.end)) / 2, 3), ts + round(_us(span.end) - ts, 3))


def _flow_ends(spans: Sequence[Span]) -> Iterator[tuple[int, Span, Span]]:
    """``(pair, send, recv)`` for each pair id that has exactly one SEND and one RECV span, by pair id.

    An arrow to the wrong op would mislead more than no arrow, so a pair id with two SENDs or two RECVs gets none.
    Simulated plans number their pairs 0, 1, 2, ...: those are kept in lists (8 bytes a pair), others in dicts.
    """
    pairs = [span.pair for span in spans if span.pair is not None]
    dense = bool(pairs) and min(pairs) >= 0 and max(pairs) < 2 * len(pairs) + 64
    size = max(pairs) + 1 if dense else 0
    del pairs
    sends: Any = [None] * size if dense else {}
    recvs: Any = [None] * size if dense else {}
    for span in spans:
        pair = span.pair
        if pair is None:
            continue
        table = sends if span.kind.startswith("SEND") else recvs if span.kind.startswith("RECV") else None
        if table is not None:
            seen = table[pair] if dense else table.get(pair)
            table[pair] = span if seen is None else _AMBIGUOUS
    for pair in range(size) if dense else sorted(sends.keys() & recvs.keys()):
        send, recv = sends[pair], recvs[pair]
        if send is not None and recv is not None and send is not _AMBIGUOUS and recv is not _AMBIGUOUS:
            yield pair, send, recv


#: Marks a pair id seen on two SENDs (or two RECVs).
_AMBIGUOUS = object()


def _flow_events(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """One ``s``/``f`` pair per pair id that has exactly one SEND and one RECV span, ordered by pair id."""
    events: list[dict[str, Any]] = []
    for pair, send, recv in _flow_ends(spans):
        common = {"cat": FLOW_CAT, "id": int(pair), "name": f"{send.op} -> {recv.op}"}
        events.append({**common, "ph": "s", "pid": int(send.rank), "tid": STREAMS.index(send.stream),
                       "ts": _flow_anchor(send)})
        events.append({**common, "ph": "f", "bp": "e", "pid": int(recv.rank), "tid": STREAMS.index(recv.stream),
                       "ts": _flow_anchor(recv)})
    return events


def _canonical_spans(trace: Trace) -> Sequence[Span]:
    """The spans in canonical order. ``Trace.from_spans`` sorts them already, so this is usually a check (no copy)."""
    spans = trace.spans
    if all(a <= b for a, b in itertools.pairwise(map(_span_key, spans))):
        return spans
    return sorted(spans, key=_span_key)


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
    spans = _canonical_spans(trace)
    events = _metadata_events(trace) + [_complete_event(s) for s in spans] + _flow_events(spans)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {**trace.meta, DEVICES_KEY: list(trace.devices)},
    }


# The writer formats the events there are millions of (X and flow) from templates instead of building a dict per
# event and encoding it: several times faster, and no per-event garbage. The templates spell the keys in sorted order
# without spaces, and the values are encoded as json.dumps encodes them (float.__repr__, int.__repr__, ASCII-escaped
# strings), so the bytes are those of json.dumps(to_chrome_trace(trace), sort_keys=True, separators=(",", ":")),
# which the tests check on random traces.
_X_TEMPLATE = ('{"args":{"end_s":%s,"kind":%s,"mb":%s,"op":%s,"pair":%s,"peer":%s,"rank":%s,"start_s":%s,'
               '"stream":%s,"vstage":%s},"cat":%s,"dur":%s,"name":%s,"ph":"X","pid":%s,"tid":%d,"ts":%s}')
_FLOW_TEMPLATE = '{%s"cat":"' + FLOW_CAT + '","id":%s,"name":%s,"ph":"%s","pid":%s,"tid":%d,"ts":%s}'
_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
_float_text, _int_text = float.__repr__, int.__repr__
#: Events per piece of text handed to the buffer.
_BATCH = 512


def _optional_int(value: int | None) -> str:
    return "null" if value is None else _int_text(int(value))


def _complete_event_text(span: Span, quoted: dict[str, str]) -> str:
    """:func:`_complete_event`'s dict as the writer encodes it; ``quoted`` caches the encoded kinds and streams."""
    start, end = float(span.start), float(span.end)
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"span {span.op} on rank {span.rank} has a non-finite time ({span.start}, {span.end})")
    kind = quoted.get(span.kind) or quoted.setdefault(span.kind, encode_basestring_ascii(span.kind))
    stream = quoted.get(span.stream) or quoted.setdefault(span.stream, encode_basestring_ascii(span.stream))
    mb, pair, peer = span.mb, span.pair, span.peer
    op, rank, ts = encode_basestring_ascii(span.op), _int_text(int(span.rank)), round(start * 1e6, 3)  # _us
    return _X_TEMPLATE % (
        _float_text(end), kind, "null" if mb is None else _int_text(int(mb)), op,
        "null" if pair is None else _int_text(int(pair)), "null" if peer is None else _int_text(int(peer)), rank,
        _float_text(start), stream, _int_text(int(span.vstage)), kind, _float_text(round(round(end * 1e6, 3) - ts, 3)),
        op, rank, _STREAM_INDEX[span.stream], _float_text(ts))


_STREAM_INDEX = {stream: index for index, stream in enumerate(STREAMS)}


def _flow_texts(send: Span, recv: Span, pair: int) -> tuple[str, str]:
    """:func:`_flow_events`'s two dicts of one pair as the writer encodes them."""
    name, pair_text = encode_basestring_ascii(f"{send.op} -> {recv.op}"), _int_text(int(pair))
    return (_FLOW_TEMPLATE % ("", pair_text, name, "s", _int_text(int(send.rank)), STREAMS.index(send.stream),
                              _float_text(_flow_anchor(send))),
            _FLOW_TEMPLATE % ('"bp":"e",', pair_text, name, "f", _int_text(int(recv.rank)),
                              STREAMS.index(recv.stream), _float_text(_flow_anchor(recv))))


def _document_chunks(trace: Trace) -> Iterator[str]:
    """The file's text in pieces of up to :data:`_BATCH` events (see :func:`write_chrome_trace`)."""
    if DEVICES_KEY in trace.meta:
        raise ValueError(f"trace.meta may not use the reserved key {DEVICES_KEY!r}: it holds the device names")
    try:
        other = _JSON.encode({**trace.meta, DEVICES_KEY: list(trace.devices)})
    except TypeError as exc:
        raise ValueError(f"trace is not JSON-serialisable (check trace.meta): {exc}") from exc
    # The top-level keys in sorted order: displayTimeUnit, otherData, traceEvents.
    yield '{"displayTimeUnit":"ms","otherData":' + other + ',"traceEvents":['
    spans = _canonical_spans(trace)
    pieces = [_JSON.encode(event) for event in _metadata_events(trace)]
    separator, quoted = "", {}  # type: ignore[var-annotated]
    for span in spans:
        pieces.append(_complete_event_text(span, quoted))
        if len(pieces) >= _BATCH:
            yield separator + ",".join(pieces)
            pieces, separator = [], ","
    for pair, send, recv in _flow_ends(spans):
        pieces.extend(_flow_texts(send, recv, pair))
        if len(pieces) >= _BATCH:
            yield separator + ",".join(pieces)
            pieces, separator = [], ","
    if pieces:
        yield separator + ",".join(pieces)
    yield "]}\n"


def write_chrome_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as Chrome trace-event JSON, deterministically and atomically.

    The bytes are ``json.dumps(to_chrome_trace(trace), sort_keys=True, separators=(",", ":"), ensure_ascii=True)``
    and a newline, produced piece by piece into one buffer: no event dicts, no list of them, no second copy of the
    text. The file is in memory once (about 320 bytes a span), because ``sim.core.fileio`` writes atomically from
    one buffer.

    Args:
        trace: the trace; span times in seconds (written as µs in ``ts``/``dur``, exact seconds in ``args``).
        path: the ``.json`` file to write; its directory must exist.

    Raises:
        ValueError: see :func:`to_chrome_trace`, or ``trace.meta`` is not JSON-serialisable.
        OSError: the file cannot be written (nothing is left behind at ``path``).
    """
    buffer = io.BytesIO()
    for chunk in _document_chunks(trace):
        buffer.write(chunk.encode("ascii"))
    with buffer.getbuffer() as data:
        write_bytes_atomic(path, data)  # type: ignore[arg-type]  # a bytes-like view: no copy of the text


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
