"""Geometry of a Gantt chart: figure size, row heights, the label font and which compute boxes carry their number.

Pure arithmetic in pixels at :data:`DPI`, the output resolution of :func:`sim.report.gantt.draw_gantt`; text sizes
come from callbacks (the drawn extent of a string at a font size), so the layout is computed, and tested, without
drawing and without matplotlib. The bounds, all at :data:`DPI`:

* the figure is at most :data:`MAX_WIDTH_PX` × :data:`MAX_HEIGHT_PX` (6000 × 6000 px, so Agg's RGBA canvas is at most
  144 MB) however many ranks and ops the trace has; at least :data:`MIN_WIDTH_PX` wide;
* every send/recv/h2d/d2h sub-row is at least :data:`MIN_SUB_ROW_PX` tall. Rows shrink when the ranks would not
  fit the height bound at the nominal size: all parts alike until the sub-rows reach that minimum, then the compute
  bar and the gap alone, down to a bar as tall as a sub-row; past that (more than about 150 ranks with two sub-rows)
  the sub-rows are left out and a note under the legend says so;
* the width is the smallest in [:data:`MIN_WIDTH_PX`, :data:`MAX_WIDTH_PX`] at which every compute box that can show
  its microbatch number at all shows it written across, with the largest font of :data:`LABEL_SIZES_PT` that allows
  it. If no font does, the figure takes the maximum width and the font that leaves fewest numbers turned 90° (a
  number turned needs the box only as wide as the digits are tall). Boxes too narrow even so are not labelled, and a
  note says how many and below what duration (rounded up, so it stays a bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sim.ir.trace import STREAMS, Trace

__all__ = ["DPI", "MAX_WIDTH_PX", "MAX_HEIGHT_PX", "MIN_WIDTH_PX", "MIN_SUB_ROW_PX", "LABEL_SIZES_PT",
           "LABEL_PAD_PX", "MIN_BOX_PX", "RANK_PT", "Label", "Rows", "GanttGeometry", "layout_gantt"]

DPI = 150  # output resolution, pixels per inch
MAX_WIDTH_PX, MAX_HEIGHT_PX = 6000, 6000  # the figure never exceeds this, pixels
MIN_WIDTH_PX = 1500  # small charts are not drawn narrower, pixels
MIN_SUB_ROW_PX = 8.0  # a send/recv/h2d/d2h sub-row is this tall at least, or left out with a note, pixels
LABEL_SIZES_PT = (6.5, 6.0, 5.5, 5.0)  # microbatch number fonts, largest first (5 pt is 10 px tall at 150 dpi)
LABEL_PAD_PX = 1.5  # room between a number's ink and its box edge, each side, pixels
MIN_BOX_PX = 2.0  # a box is drawn at least this wide so that a 30 µs send still shows, pixels
RANK_PT = 8.0  # rank names and legend entries, points

# Nominal row geometry (pixels); scaled down together, to at most MIN_SUB_ROW_PX sub-rows, when ranks are many.
_BAR_PX, _SUB_GAP_PX, _SUB_PX, _SUB_PITCH_PX, _ROW_GAP_PX = 44.0, 4.0, 11.0, 15.0, 24.0
_RIGHT_PX = 45.0  # right margin when rank names are on the left only
_WIDE_PX = 3000  # wider figures repeat the rank names on the right, so the right end still says which row is which
_TOP_PX, _TOP_PX_SHORT = 90.0, 60.0  # title plus time labels on top (more than 4 ranks), or title only
_LEGEND_ROW_PX, _NOTE_ROW_PX = 30.0, 27.0
_AXIS_PX = 82.0  # tick labels and "time (ms)" under the plot
_MAX_LEFT_PX = 600.0  # longer rank names are clipped rather than squeezing the plot


@dataclass(frozen=True)
class Label:
    """A microbatch number: ``trace.spans[span]``'s, centred at ``(x_ms, y_px)``, turned 90° if ``rotated``."""

    span: int
    x_ms: float
    y_px: float
    text: str
    rotated: bool


@dataclass(frozen=True)
class Rows:
    """Vertical geometry of one rank's row, pixels from the row's top; ``sub_streams`` are the sub-rows drawn."""

    bar_px: float
    sub_gap_px: float
    sub_px: float
    sub_pitch_px: float
    row_gap_px: float
    sub_streams: tuple[str, ...]

    @property
    def pitch_px(self) -> float:
        """Height of one rank's row including the gap to the next, pixels."""
        subs = self.sub_gap_px + len(self.sub_streams) * self.sub_pitch_px if self.sub_streams else 0.0
        return self.bar_px + subs + self.row_gap_px

    def bar(self, rank: int, stream: str) -> tuple[float, float]:
        """``(top, height)`` in pixels from the plot's top of ``stream``'s bar in rank ``rank``'s row."""
        top = rank * self.pitch_px + self.row_gap_px / 2
        if stream == STREAMS[0]:
            return top, self.bar_px
        index = self.sub_streams.index(stream)
        return top + self.bar_px + self.sub_gap_px + index * self.sub_pitch_px, self.sub_px


@dataclass(frozen=True)
class GanttGeometry:
    """Where everything goes, pixels at :data:`DPI`; x data is milliseconds, y data is pixels from the plot's top."""

    width_px: int
    height_px: int
    left_px: float
    right_px: float
    top_px: float
    bottom_px: float
    rows: Rows
    n_rows: int
    t0_ms: float
    x_max_ms: float
    px_per_ms: float
    label_pt: float
    labels: tuple[Label, ...]
    notes: tuple[str, ...]
    legend_ncol: int
    rank_step: int  # every rank_step-th rank is named, so names never overlap
    top_ticks: bool
    right_ticks: bool

    @property
    def plot_h_px(self) -> float:
        """Height of the plot area, pixels."""
        return self.n_rows * self.rows.pitch_px


Measure = Callable[[str, float], tuple[float, float]]  # (text, points) -> drawn (width, height), pixels


def _legend_ncol(widths: Sequence[float], fig_w: float) -> int:
    """One legend row if every entry fits across, else as many columns as the widest entry allows."""
    if sum(widths) <= fig_w - 60:
        return max(1, len(widths))
    return max(1, min(len(widths), int((fig_w - 60) // max(widths))))


def _round_up(x: float) -> str:
    """``x`` > 0 rounded up to 3 significant digits: a bound printed is still a bound."""
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return f"{math.ceil(x / step) * step:.{max(0, -round(math.log10(step)))}f}"


def _bottom_px(n_entries: int, ncol: int, n_notes: int) -> float:
    return _AXIS_PX + _LEGEND_ROW_PX * math.ceil(n_entries / ncol) + 15.0 + _NOTE_ROW_PX * n_notes


def _rows(sub_streams: list[str], n_rows: int, plot_h_max: float) -> tuple[Rows, str | None]:
    """The row geometry that fits ``plot_h_max`` pixels, and a note if the sub-rows had to be left out.

    Everything shrinks in proportion until the sub-rows reach :data:`MIN_SUB_ROW_PX`; from there only the compute bar
    and the gap shrink (in proportion), down to a bar as tall as a sub-row; below that the sub-rows are left out.
    """
    per_row = plot_h_max / n_rows
    nominal = Rows(_BAR_PX, _SUB_GAP_PX, _SUB_PX, _SUB_PITCH_PX, _ROW_GAP_PX, tuple(sub_streams))
    k = min(1.0, per_row / nominal.pitch_px)
    if not sub_streams or _SUB_PX * k >= MIN_SUB_ROW_PX:
        return Rows(_BAR_PX * k, _SUB_GAP_PX * k, _SUB_PX * k, _SUB_PITCH_PX * k, _ROW_GAP_PX * k,
                    tuple(sub_streams)), None
    gap = MIN_SUB_ROW_PX * (_SUB_PITCH_PX - _SUB_PX) / _SUB_PX  # sub-rows at their minimum, gaps in proportion
    subs_px = gap + len(sub_streams) * (MIN_SUB_ROW_PX + gap)
    k = (per_row - subs_px) / (_BAR_PX + _ROW_GAP_PX)
    if _BAR_PX * k >= MIN_SUB_ROW_PX:
        return Rows(_BAR_PX * k, gap, MIN_SUB_ROW_PX, MIN_SUB_ROW_PX + gap, _ROW_GAP_PX * k, tuple(sub_streams)), None
    k = min(1.0, per_row / (_BAR_PX + _ROW_GAP_PX))
    note = (f"{'/'.join(sub_streams)} rows left out: {n_rows} ranks leave {per_row:.1f} px per rank, "
            f"{subs_px + MIN_SUB_ROW_PX * (1 + _ROW_GAP_PX / _BAR_PX):.1f} px needed")
    return Rows(_BAR_PX * k, 0.0, 0.0, 0.0, _ROW_GAP_PX * k, ()), note


def layout_gantt(trace: Trace, measure: Measure, text_width: Callable[[str, float], float], rank_names: Sequence[str],
                 legend: Sequence[str]) -> GanttGeometry:
    """Lay out ``trace``'s chart within the bounds of the module docstring.

    Args:
        trace: the trace; span times in seconds.
        measure: ``(text, points) -> (width, height)`` of a microbatch number as drawn (its ink), pixels at
            :data:`DPI`.
        text_width: ``(text, points) -> width`` of a rank name or legend entry as drawn, pixels at :data:`DPI`.
        rank_names: the label of each rank's row.
        legend: the legend's entry labels.
    """
    n_rows = max(trace.num_ranks, 1)
    left = min(max([text_width(name, RANK_PT) for name in rank_names] + [45.0]) + 38.0, _MAX_LEFT_PX)
    t0 = min([0.0] + [s.start for s in trace.spans]) * 1e3
    t1 = max([0.0] + [s.end for s in trace.spans]) * 1e3
    t1 = t1 if t1 > t0 else t0 + 1.0
    x_max = t1 + (t1 - t0) * 0.005
    x_range = x_max - t0

    # Vertical first: the rows get what the height bound leaves after margins as wide as they can get.
    entry_w = [text_width(label, RANK_PT) + 75.0 for label in legend]
    top_ticks = trace.num_ranks > 4
    top = _TOP_PX if top_ticks else _TOP_PX_SHORT
    bottom_most = _bottom_px(len(legend), _legend_ncol(entry_w, MIN_WIDTH_PX), 2)  # narrowest figure, both notes
    present = {s.stream for s in trace.spans}
    rows, rows_note = _rows([s for s in STREAMS[1:] if s in present], n_rows, MAX_HEIGHT_PX - top - bottom_most)

    # Horizontal: the smallest width that labels every box that can be labelled at all.
    boxes = [(i, s) for i, s in enumerate(trace.spans) if s.stream == STREAMS[0] and s.mb is not None]
    ppm_cap = (MAX_WIDTH_PX - 2 * left) / x_range  # right margin as wide as the left one on wide figures
    ppm_floor = min((MIN_WIDTH_PX - left - _RIGHT_PX) / x_range, ppm_cap)
    sizes: dict[tuple[str, float], tuple[float, float]] = {}

    def need(text: str, pt: float, turn: bool) -> float:
        """Box width a number needs, pixels; infinite if it cannot fit the bar's height that way."""
        if (text, pt) not in sizes:
            sizes[text, pt] = measure(text, pt)
        w, h = sizes[text, pt]
        across, tall = (h, w) if turn else (w, h)
        return across + 2 * LABEL_PAD_PX if tall + 2 * LABEL_PAD_PX <= rows.bar_px else math.inf

    def placement(span, pt: float, may_turn: bool, ppm: float) -> bool | None:
        """``False``: across, ``True``: turned, ``None``: does not fit at ``ppm`` pixels per millisecond."""
        width = span.duration * 1e3 * ppm
        if need(str(span.mb), pt, False) <= width:
            return False
        return True if may_turn and need(str(span.mb), pt, True) <= width else None

    # The largest font at which every box that can carry its number at all carries it across, at the smallest
    # width that does it; failing that, the whole width and the font that turns fewest numbers (omits fewest first).
    smallest = LABEL_SIZES_PT[-1]
    fittable = [s for _, s in boxes if placement(s, smallest, True, ppm_cap) is not None]
    label_pt, may_turn, ppm = smallest, True, ppm_cap
    for pt in LABEL_SIZES_PT:
        needed = max([need(str(s.mb), pt, False) / (s.duration * 1e3) for s in fittable] + [0.0])
        if needed <= ppm_cap:
            label_pt, may_turn, ppm = pt, False, max(needed, ppm_floor)
            break
    else:
        def cost(pt: float) -> tuple[int, int, float]:
            placed = [placement(s, pt, True, ppm_cap) for s in fittable]
            return placed.count(None), placed.count(True), -pt

        label_pt = min(LABEL_SIZES_PT, key=cost)

    right = _RIGHT_PX if left + ppm * x_range + _RIGHT_PX <= _WIDE_PX else left
    width_px = min(math.ceil(left + ppm * x_range + right - 1e-6), MAX_WIDTH_PX)
    ppm = (width_px - left - right) / x_range  # the rounding up goes to the plot, so every fit still holds

    labels, omitted, omitted_need = [], 0, 0.0
    for i, s in boxes:
        turned = placement(s, label_pt, may_turn, ppm)
        if turned is None:
            omitted += 1
            pixels = min(need(str(s.mb), label_pt, False), need(str(s.mb), label_pt, True) if may_turn else math.inf)
            omitted_need = max(omitted_need, pixels)
            continue
        top_px, bar_px = rows.bar(s.rank, s.stream)
        labels.append(Label(i, (s.start + s.end) * 5e2, top_px + bar_px / 2, str(s.mb), turned))
    notes = []
    if omitted:
        if math.isinf(omitted_need):
            why = f"as {n_rows} ranks leave bars {rows.bar_px:.0f} px tall, too short for them"
        else:
            why = (f"narrower than {_round_up(omitted_need / ppm)} ms ({math.ceil(omitted_need)} px), too narrow "
                   f"even at the {MAX_WIDTH_PX} px width limit")
        notes.append(f"microbatch numbers omitted on {omitted} of {len(boxes)} boxes {why}")
    if rows_note:
        notes.append(rows_note)

    ncol = _legend_ncol(entry_w, width_px)
    bottom = _bottom_px(len(legend), ncol, len(notes))
    height_px = min(math.ceil(top + n_rows * rows.pitch_px + bottom - 1e-6), MAX_HEIGHT_PX)
    bottom = height_px - top - n_rows * rows.pitch_px
    rank_step = next(k for k in (10 ** e * m for e in range(7) for m in (1, 2, 5)) if k * rows.pitch_px >= 18.0)
    return GanttGeometry(
        width_px=width_px, height_px=height_px, left_px=left, right_px=right, top_px=top, bottom_px=bottom,
        rows=rows, n_rows=n_rows, t0_ms=t0, x_max_ms=x_max, px_per_ms=ppm, label_pt=label_pt, labels=tuple(labels),
        notes=tuple(notes), legend_ncol=ncol, rank_step=rank_step, top_ticks=top_ticks, right_ticks=right != _RIGHT_PX,
    )
