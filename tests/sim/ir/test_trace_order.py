"""Trace.from_spans's canonical order against its definition: one sort by (start, rank, stream, end, op)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.ir.trace import STREAMS, Span, canonical_order

# Few distinct times, so that many spans tie on start (and on more of the key).
times = st.sampled_from([0.0, -0.0, 1.0, 1.5, 2.0, 1e-9])


@st.composite
def spans(draw) -> list[Span]:
    out = []
    for i in range(draw(st.integers(0, 40))):
        start = draw(times)
        out.append(Span(draw(st.sampled_from(["0F0", "1B0", f"x{i}"])), "F", draw(st.integers(0, 2)),
                        draw(st.sampled_from(STREAMS)), start, start + draw(times) ** 2, 0))
    return out


@settings(max_examples=100, deadline=None)
@given(spans=spans())
def test_canonical_order_is_one_sort_by_the_whole_key(spans):
    expected = sorted(spans, key=lambda s: (s.start, s.rank, STREAMS.index(s.stream), s.end, s.op))
    assert [id(s) for s in canonical_order(spans)] == [id(s) for s in expected]  # the same objects: stable too
