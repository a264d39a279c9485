"""Gantt geometry without drawing: bounded size, sub-rows at least their minimum, numbers only where they fit."""

from __future__ import annotations

import random
import re

import pytest

from sim.ir.trace import Span, Trace
from sim.report.gantt_layout import (
    LABEL_PAD_PX,
    LABEL_SIZES_PT,
    MAX_HEIGHT_PX,
    MAX_WIDTH_PX,
    MIN_SUB_ROW_PX,
    MIN_WIDTH_PX,
    layout_gantt,
)


def ink(text: str, points: float) -> tuple[float, float]:
    """A stand-in font: every character 0.9 pt wide per point, digits 0.7 pt tall per point, in pixels."""
    return 0.9 * points * len(text), 0.7 * points


def layout(trace: Trace):
    names = [f"r{r} {d}" for r, d in enumerate(trace.devices)]
    return layout_gantt(trace, ink, lambda text, points: 6.0 * len(text), names, ["F", "B", "SEND_F / RECV_F"])


def chain(durations_ms: list[float], ranks: int = 1, comm: bool = False) -> Trace:
    """Each rank runs F boxes of these durations back to back (microbatch = index); a 20 µs send after each if comm."""
    spans = []
    for r in range(ranks):
        t = 0.0
        for mb, d in enumerate(durations_ms):
            spans.append(Span(f"{r}F{mb}", "F", r, "compute", t, t + d * 1e-3, r, mb))
            if comm:
                spans.append(Span(f"{r}SEND_F{mb}", "SEND_F", r, "send", t + d * 1e-3, t + d * 1e-3 + 2e-5, r, mb,
                                  r * len(durations_ms) + mb, r + 1))
            t += d * 1e-3
    return Trace.from_spans(spans, ["gpu"] * ranks)


def box_px(geom, span: Span) -> float:
    return span.duration * 1e3 * geom.px_per_ms


def fits(geom, span: Span, rotated: bool) -> bool:
    """The rule, from the stand-in font: the number's extent plus padding within the box, both ways."""
    w, h = ink(str(span.mb), geom.label_pt)
    across, tall = (h, w) if rotated else (w, h)
    return across + 2 * LABEL_PAD_PX <= box_px(geom, span) and tall + 2 * LABEL_PAD_PX <= geom.rows.bar_px


def test_a_small_chart_labels_every_box_at_the_largest_font_and_minimum_width():
    trace = chain([10.0, 1.0, 2.0, 30.0])
    geom = layout(trace)
    assert (geom.width_px, geom.label_pt) == (MIN_WIDTH_PX, LABEL_SIZES_PT[0])
    assert [label.text for label in geom.labels] == ["0", "1", "2", "3"] and not any(g.rotated for g in geom.labels)
    for label in geom.labels:
        span = trace.spans[label.span]
        top, bar = geom.rows.bar(0, "compute")
        assert label.x_ms == pytest.approx((span.start + span.end) * 500) and label.y_px == pytest.approx(top + bar / 2)
    assert geom.notes == ()


@pytest.mark.parametrize("seed", range(6))
def test_the_width_is_the_smallest_that_fits_every_number(seed):
    rng = random.Random(seed)
    trace = chain([rng.choice([0.4, 1.0, 3.0]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(20, 120))],
                  ranks=rng.randint(1, 4))
    geom = layout(trace)
    assert MIN_WIDTH_PX <= geom.width_px <= MAX_WIDTH_PX
    assert len(geom.labels) == len(trace.spans)  # all fit somewhere below the bound with these durations
    assert all(fits(geom, trace.spans[g.span], g.rotated) for g in geom.labels)
    if geom.width_px > MIN_WIDTH_PX:  # one pixel less and some number no longer fits its box
        narrower = (geom.width_px - 1 - geom.left_px - geom.right_px) / (geom.x_max_ms - geom.t0_ms)
        assert any(ink(str(s.mb), geom.label_pt)[0] + 2 * LABEL_PAD_PX > s.duration * 1e3 * narrower
                   for s in trace.spans)


def test_numbers_turn_only_when_no_font_fits_them_across():
    trace = chain([1.0] * 600)  # 600 ms at most ~6000 px: ~9 px a box, too narrow for "123" across at 5 pt
    geom = layout(trace)
    assert geom.width_px == MAX_WIDTH_PX and geom.notes == ()
    assert len(geom.labels) == 600 and all(fits(geom, trace.spans[g.span], g.rotated) for g in geom.labels)
    turned = [g for g in geom.labels if g.rotated]
    assert turned and all(not fits(geom, trace.spans[g.span], False) for g in turned)


def test_boxes_too_narrow_even_at_the_width_limit_are_counted_in_a_note_whose_bound_holds():
    durations = [1000.0, 0.001, 0.01, 0.02, 50.0]
    trace = chain(durations)
    geom = layout(trace)
    labelled = {g.span for g in geom.labels}
    omitted = [s for i, s in enumerate(trace.spans) if i not in labelled]
    assert [s.mb for s in omitted] == [1, 2, 3]
    (note,) = geom.notes
    match = re.fullmatch(r"microbatch numbers omitted on 3 of 5 boxes narrower than ([0-9.]+) ms \((\d+) px\), "
                         rf"too narrow even at the {MAX_WIDTH_PX} px width limit", note)
    assert match, note
    assert all(s.duration * 1e3 < float(match[1]) for s in omitted)
    # Even at the widest plot the bound allows, the 0.02 ms box is narrower than its number needs.
    widest = (MAX_WIDTH_PX - geom.left_px) / (geom.x_max_ms - geom.t0_ms)
    assert 0.02 * widest < min(ink("3", pt)[1] for pt in LABEL_SIZES_PT) + 2 * LABEL_PAD_PX


@pytest.mark.parametrize("ranks", [16, 32, 100, 150])
def test_sub_rows_keep_their_minimum_height(ranks):
    geom = layout(chain([1.0] * 4, ranks=ranks, comm=True))
    assert geom.rows.sub_streams == ("send",) and geom.rows.sub_px >= MIN_SUB_ROW_PX
    assert geom.rows.bar_px >= geom.rows.sub_px  # the compute bar stays the tallest
    assert geom.height_px <= MAX_HEIGHT_PX and geom.notes == ()
    if ranks <= 32:
        assert geom.rows.sub_px == 11.0  # no shrinking at all below ~50 ranks


@pytest.mark.parametrize("ranks", [300, 1024])
def test_a_1024_rank_chart_stays_within_the_bound_and_says_what_it_left_out(ranks):
    geom = layout(chain([1.0] * 2, ranks=ranks, comm=True))
    assert geom.width_px <= MAX_WIDTH_PX and geom.height_px <= MAX_HEIGHT_PX
    assert geom.width_px * geom.height_px * 4 <= 144e6  # Agg's RGBA canvas, bytes
    assert geom.rows.sub_streams == ()
    assert any(note.startswith(f"send rows left out: {ranks} ranks") for note in geom.notes)
    assert geom.top_px + geom.plot_h_px + geom.bottom_px == pytest.approx(geom.height_px)
    assert geom.rank_step * geom.rows.pitch_px >= 18.0  # named rows are far enough apart for 8 pt names
    if ranks == 1024:
        assert any("numbers omitted on 2048 of 2048 boxes as 1024 ranks leave bars" in note for note in geom.notes)


def test_a_very_long_trace_stays_within_the_width_bound():
    geom = layout(chain([0.01] * 20000, ranks=2))
    assert geom.width_px <= MAX_WIDTH_PX and geom.notes and "omitted on" in geom.notes[0]
