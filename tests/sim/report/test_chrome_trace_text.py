"""The Chrome trace writer's templated text against its definition, json.dumps of :func:`to_chrome_trace`.

The writer formats X and flow events from templates (sim.report.chrome_trace) for speed and memory; the oracle is
the plain encoding of the document dict, built by separate code, and a straightforward pairing of SEND/RECV spans.
"""

from __future__ import annotations

import json
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.simpy_engine import simulate
from sim.ir.trace import STREAMS, Span, Trace
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.report.chrome_trace import _flow_ends, to_chrome_trace, write_chrome_trace

floats = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)
small_ids = st.integers(min_value=0, max_value=40)
any_ids = st.one_of(small_ids, st.integers(min_value=-(2**62), max_value=2**62))
names = st.text(min_size=1, max_size=10)  # any unicode: the writer must escape it as json.dumps does
KINDS = {"send": ["SEND_F", "SEND_B"], "recv": ["RECV_F", "RECV_B"]}
KINDS.update({stream: ["F", "B", "OPT_STEP", "PREFETCH", "Wé\n"] for stream in STREAMS if stream not in KINDS})


@st.composite
def traces(draw) -> Trace:
    """Traces whose pair ids are dense (as the simulator numbers them) or anything, with repeats (ambiguous)."""
    n = draw(st.integers(1, 3))
    devices = draw(st.lists(names, min_size=n, max_size=n))
    pair_ids = draw(st.sampled_from([small_ids, any_ids]))
    spans = []
    for i in range(draw(st.integers(0, 20))):
        stream = draw(st.sampled_from(STREAMS))
        kind = draw(st.sampled_from(KINDS[stream]))
        start = draw(floats)
        end = start + draw(st.one_of(st.just(0.0), floats))
        pair = draw(st.none() | pair_ids) if stream in ("send", "recv") else None
        spans.append(Span(f"{draw(names)}{i}", kind, draw(st.integers(0, n - 1)), stream, start, end,
                          draw(any_ids), draw(st.none() | any_ids), pair, draw(st.none() | small_ids)))
    meta = draw(st.dictionaries(names.filter(lambda k: k != "devices"), st.none() | st.integers() | names,
                                max_size=3))
    return Trace.from_spans(spans, devices, meta)


def _json_text(trace: Trace) -> bytes:
    document = to_chrome_trace(trace)
    return (json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
            + "\n").encode("ascii")


@settings(max_examples=40, deadline=None)
@given(trace=traces())
def test_written_bytes_are_json_dumps_of_the_document(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("text") / "trace.json"
    write_chrome_trace(trace, path)
    assert path.read_bytes() == _json_text(trace)
    # The arrows: one per pair id with exactly one SEND and one RECV, by pair id (a plain reference pairing).
    sends, recvs = defaultdict(list), defaultdict(list)
    for span in trace.spans:
        if span.pair is not None and span.kind.startswith("SEND"):
            sends[span.pair].append(span)
        elif span.pair is not None and span.kind.startswith("RECV"):
            recvs[span.pair].append(span)
    expected = [(pair, sends[pair][0], recvs[pair][0]) for pair in sorted(sends.keys() & recvs.keys())
                if len(sends[pair]) == 1 and len(recvs[pair]) == 1]
    assert list(_flow_ends(trace.spans)) == expected


def test_a_simulated_iteration_writes_the_same_bytes(tmp_path):
    built = build_plan(PlanInputs("gpt:layers=8,hidden=256,seq=64,vocab=500", "4xV100", "interleaved", 8,
                                  chunks=2, recompute=True))
    trace = simulate(built.plan, built.costs, built.topology).trace
    write_chrome_trace(trace, tmp_path / "trace.json")
    assert (tmp_path / "trace.json").read_bytes() == _json_text(trace)
    assert sum(1 for _ in _flow_ends(trace.spans)) == sum(span.kind.startswith("SEND") for span in trace.spans)
