"""Chrome trace writer/reader: exact round trip, determinism, layout of the events, malformed files."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.ir.trace import STREAMS, Span, Trace
from sim.report import chrome_trace
from sim.report.chrome_trace import read_chrome_trace, to_chrome_trace, write_chrome_trace

KINDS_BY_STREAM = {
    "compute": ["F", "B", "I", "W", "R", "OPT_STEP"],
    "send": ["REDUCE_GRAD"],
    "recv": ["REDUCE_GRAD"],
    "h2d": ["PREFETCH"],
    "d2h": ["EVICT"],
    "tp": ["TP_F", "TP_B", "TP_R"],
    "collective": ["REDUCE_GRAD", "GATHER_PARAMS"],
    "ep": ["EP_F", "EP_B", "EP_R"],
}

times = st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_infinity=False)
durations = st.one_of(st.just(0.0), st.floats(min_value=1e-12, max_value=10.0), times)
ids = st.integers(min_value=-(2**40), max_value=2**40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def traces(draw) -> Trace:
    """Random traces: 1–4 ranks, spans on every stream, SEND/RECV pairs with unique pair ids."""
    n = draw(st.integers(1, 4))
    devices = draw(st.lists(st.text(min_size=1, max_size=12), min_size=n, max_size=n))
    spans = []
    for i in range(draw(st.integers(0, 25))):
        rank = draw(st.integers(0, n - 1))
        stream = draw(st.sampled_from(STREAMS))
        kind = draw(st.sampled_from(KINDS_BY_STREAM[stream]))
        start = draw(times)
        mb = draw(st.none() | ids)
        spans.append(Span(f"{rank}{kind}{i}", kind, rank, stream, start, start + draw(durations), draw(ids), mb))
    for pair in range(draw(st.integers(0, 8))):
        src, dst = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        suffix = draw(st.sampled_from(["F", "B"]))
        mb, vstage = draw(ids), draw(ids)
        start, recv_start = draw(times), draw(times)
        spans.append(Span(f"{src}SEND_{suffix}{mb}.{pair}", f"SEND_{suffix}", src, "send", start,
                          start + draw(durations), vstage, mb, pair, dst))
        spans.append(Span(f"{dst}RECV_{suffix}{mb}.{pair}", f"RECV_{suffix}", dst, "recv", recv_start,
                          recv_start + draw(durations), vstage + 1, mb, pair, src))
    meta = draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k != "devices"), json_values, max_size=4))
    return Trace.from_spans(spans, devices, meta)


def _events(doc: dict, ph: str) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == ph]


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_round_trip_is_exact(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("rt") / "trace.json"
    write_chrome_trace(trace, path)
    back = read_chrome_trace(path)
    assert back == trace  # spans (exact floats) and devices
    assert back.spans == trace.spans
    assert back.meta == trace.meta
    assert os.listdir(path.parent) == ["trace.json"]  # no temporary file left behind


@settings(max_examples=40, deadline=None)
@given(trace=traces(), seed=st.integers(0, 2**32 - 1))
def test_writer_is_deterministic(tmp_path_factory, trace, seed):
    folder = tmp_path_factory.mktemp("det")
    write_chrome_trace(trace, folder / "a.json")
    write_chrome_trace(trace, folder / "b.json")
    shuffled = list(trace.spans)
    random.Random(seed).shuffle(shuffled)
    meta = dict(reversed(list(trace.meta.items())))
    write_chrome_trace(Trace.from_spans(shuffled, trace.devices, meta), folder / "c.json")
    write_chrome_trace(read_chrome_trace(folder / "a.json"), folder / "d.json")
    first = (folder / "a.json").read_bytes()
    for name in ("b.json", "c.json", "d.json"):
        assert (folder / name).read_bytes() == first, name


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_complete_events_carry_time_in_microseconds(trace):
    doc = to_chrome_trace(trace)
    xs = _events(doc, "X")
    assert len(xs) == len(trace.spans)  # one X event per span, in canonical span order
    for event, span in zip(xs, trace.spans, strict=True):
        assert (event["name"], event["cat"], event["pid"], event["tid"]) == (
            span.op, span.kind, span.rank, STREAMS.index(span.stream))
        assert math.isclose(event["ts"], span.start * 1e6, rel_tol=1e-12, abs_tol=6e-4)
        assert math.isclose(event["dur"], (span.end - span.start) * 1e6, rel_tol=1e-9, abs_tol=1.2e-3)
        assert event["dur"] >= 0
        assert event["args"]["start_s"] == span.start and event["args"]["end_s"] == span.end


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_metadata_names_every_process_and_thread(trace):
    doc = to_chrome_trace(trace)
    meta = _events(doc, "M")
    names = {(e["pid"], e.get("tid"), e["name"]): e["args"] for e in meta}
    assert len(names) == len(meta)  # no duplicates
    for rank, device in enumerate(trace.devices):
        assert names[(rank, None, "process_name")] == {"name": f"rank {rank} · {device}"}
        assert names[(rank, None, "process_sort_index")] == {"sort_index": rank}
    for event in _events(doc, "X"):
        pid, tid = event["pid"], event["tid"]
        assert names[(pid, tid, "thread_name")] == {"name": STREAMS[tid]}
        assert names[(pid, tid, "thread_sort_index")] == {"sort_index": tid}
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"] == {**trace.meta, "devices": list(trace.devices)}


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_one_flow_arrow_per_send_recv_pair(trace):
    doc = to_chrome_trace(trace)
    starts = {e["id"]: e for e in _events(doc, "s")}
    finishes = {e["id"]: e for e in _events(doc, "f")}
    sends = {s.pair: s for s in trace.spans if s.kind.startswith("SEND")}
    recvs = {s.pair: s for s in trace.spans if s.kind.startswith("RECV")}
    assert len(starts) == len(_events(doc, "s")) and len(finishes) == len(_events(doc, "f"))
    assert starts.keys() == finishes.keys() == sends.keys() == recvs.keys()
    for pair, start in starts.items():
        send, recv, finish = sends[pair], recvs[pair], finishes[pair]
        assert (start["pid"], start["tid"]) == (send.rank, STREAMS.index("send"))
        assert (finish["pid"], finish["tid"], finish["bp"]) == (recv.rank, STREAMS.index("recv"), "e")
        assert start["cat"] == finish["cat"] and start["name"] == finish["name"]
        # Each end binds to its own span: its ts lies inside that span's X event.
        for flow, span in ((start, send), (finish, recv)):
            x = next(e for e in _events(doc, "X") if e["name"] == span.op and e["pid"] == span.rank)
            assert x["ts"] <= flow["ts"] <= x["ts"] + x["dur"]


def test_exact_events_for_a_small_trace():
    spans = [
        Span("0F0", "F", 0, "compute", 0.001, 0.0025, 0, 0),
        Span("0SEND_F0", "SEND_F", 0, "send", 0.0025, 0.003, 0, 0, pair=7, peer=1),
        Span("1RECV_F0", "RECV_F", 1, "recv", 0.0025, 0.003, 1, 0, pair=7, peer=0),
    ]
    doc = to_chrome_trace(Trace.from_spans(spans, ["v100", "a100"], {"source": "sim"}))
    assert _events(doc, "X")[0] == {
        "ph": "X", "name": "0F0", "cat": "F", "pid": 0, "tid": 0, "ts": 1000.0, "dur": 1500.0,
        "args": {"op": "0F0", "kind": "F", "rank": 0, "stream": "compute", "vstage": 0, "mb": 0, "pair": None,
                 "peer": None, "start_s": 0.001, "end_s": 0.0025},
    }
    flows = [e for e in doc["traceEvents"] if e["ph"] in "sf"]
    assert flows == [
        {"ph": "s", "cat": "p2p", "id": 7, "name": "0SEND_F0 -> 1RECV_F0", "pid": 0, "tid": 1, "ts": 2750.0},
        {"ph": "f", "bp": "e", "cat": "p2p", "id": 7, "name": "0SEND_F0 -> 1RECV_F0", "pid": 1, "tid": 2,
         "ts": 2750.0},
    ]
    assert [e["ph"] for e in doc["traceEvents"]] == ["M"] * 10 + ["X"] * 3 + ["s", "f"]
    assert doc["otherData"] == {"source": "sim", "devices": ["v100", "a100"]}


def test_file_format_is_compact_sorted_json(tmp_path):
    trace = Trace.from_spans([Span("0F0", "F", 0, "compute", 0.0, 1.0, 0, 0)], ["cpu"], {"z": 1, "a": 2})
    write_chrome_trace(trace, tmp_path / "t.json")
    text = (tmp_path / "t.json").read_text("ascii")
    doc = json.loads(text)
    assert text == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n"


def test_unmatched_or_ambiguous_pairs_draw_no_arrow():
    spans = [
        Span("0SEND_F0", "SEND_F", 0, "send", 0.0, 1.0, 0, 0, pair=1, peer=1),  # no RECV
        Span("0SEND_F1", "SEND_F", 0, "send", 1.0, 2.0, 0, 1, pair=2, peer=1),
        Span("0SEND_F2", "SEND_F", 0, "send", 2.0, 3.0, 0, 2, pair=2, peer=1),  # two SENDs share pair 2
        Span("1RECV_F1", "RECV_F", 1, "recv", 1.0, 2.0, 1, 1, pair=2, peer=0),
    ]
    doc = to_chrome_trace(Trace.from_spans(spans, ["a", "b"]))
    assert not [e for e in doc["traceEvents"] if e["ph"] in "sf"]


def test_reserved_meta_key_and_non_finite_times_are_rejected(tmp_path):
    span = Span("0F0", "F", 0, "compute", 0.0, 1.0, 0, 0)
    with pytest.raises(ValueError, match="devices"):
        write_chrome_trace(Trace.from_spans([span], ["cpu"], {"devices": ["x"]}), tmp_path / "t.json")
    with pytest.raises(ValueError, match="non-finite"):
        to_chrome_trace(Trace.from_spans([Span("0F0", "F", 0, "compute", 0.0, math.inf, 0)], ["cpu"]))
    with pytest.raises(ValueError, match="JSON"):
        write_chrome_trace(Trace.from_spans([span], ["cpu"], {"x": object()}), tmp_path / "t.json")
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    old = Trace.from_spans([Span("0F0", "F", 0, "compute", 0.0, 1.0, 0, 0)], ["cpu"])
    write_chrome_trace(old, path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(chrome_trace.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_chrome_trace(Trace.from_spans([], ["cpu", "cpu"]), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["trace.json"]


def test_empty_trace_round_trips(tmp_path):
    for trace in (Trace((), ()), Trace.from_spans([], ["cpu", "cpu"], {"source": "executor"})):
        write_chrome_trace(trace, tmp_path / "t.json")
        back = read_chrome_trace(tmp_path / "t.json")
        assert back == trace and back.meta == trace.meta


def _good_doc() -> dict:
    trace = Trace.from_spans([Span("0F0", "F", 0, "compute", 0.0, 1.0, 0, 0)], ["cpu"])
    return json.loads(json.dumps(to_chrome_trace(trace)))


def _x(doc: dict) -> dict:
    return next(e for e in doc["traceEvents"] if e["ph"] == "X")


def _mutations():
    def set_in(getter, key, value):
        def mutate(doc):
            getter(doc)[key] = value
        return mutate

    def delete(getter, key):
        def mutate(doc):
            del getter(doc)[key]
        return mutate

    top = lambda d: d  # noqa: E731
    args = lambda d: _x(d)["args"]  # noqa: E731
    return {
        "missing traceEvents": delete(top, "traceEvents"),
        "traceEvents not a list": set_in(top, "traceEvents", {"a": 1}),
        "event not an object": lambda d: d["traceEvents"].append(3),
        "missing otherData": delete(top, "otherData"),
        "missing devices": delete(lambda d: d["otherData"], "devices"),
        "devices not strings": set_in(lambda d: d["otherData"], "devices", [1]),
        "X without args": delete(_x, "args"),
        "args not an object": set_in(_x, "args", [1, 2]),
        "args missing start_s": delete(args, "start_s"),
        "args missing op": delete(args, "op"),
        "rank is a string": set_in(args, "rank", "0"),
        "rank is a bool": set_in(args, "rank", True),
        "mb is a float": set_in(args, "mb", 1.5),
        "end_s is a string": set_in(args, "end_s", "1.0"),
        "op is a number": set_in(args, "op", 3),
        "rank out of range": set_in(args, "rank", 1),
        "unknown stream": set_in(args, "stream", "nvlink"),
        "end before start": set_in(args, "end_s", -1.0),
    }


@pytest.mark.parametrize("what", sorted(_mutations()))
def test_malformed_documents_raise_spec_error_naming_the_file(tmp_path, what):
    doc = _good_doc()
    _mutations()[what](doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match="bad.json"):
        read_chrome_trace(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b'{"traceEvents": [', b"[1, 2]", b"null", b'{"traceEvents": [], "otherData": NaN}',
     b"\xff\xfe\x00"],
    ids=["empty", "text", "truncated", "list", "null", "NaN", "not utf-8"],
)
def test_non_json_or_wrong_top_level_raises_spec_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(SpecError, match="bad.json"):
        read_chrome_trace(path)


def test_sanity_of_the_good_document(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(_good_doc()))
    assert read_chrome_trace(path).spans == (Span("0F0", "F", 0, "compute", 0.0, 1.0, 0, 0),)


def test_missing_file_is_not_a_spec_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_chrome_trace(tmp_path / "nope.json")
