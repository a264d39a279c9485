"""Gantt chart of a :class:`~sim.ir.trace.Trace` as a PNG: one row per device, one colour per op kind.

Each device row has the compute stream as the main bar and, beneath it, one thin sub-bar per other stream
(``send``, ``recv``, ``h2d``, ``d2h``) that has any span in the trace. The microbatch id is written inside a compute
box when it fits (the box width in pixels is measured against the rendered text width); idle time is white.

Built for 16 devices × 64 microbatches (thousands of boxes): the figure grows with the number of ranks and of
boxes per rank, and boxes are drawn as one :class:`~matplotlib.collections.PolyCollection` per colour, not one
patch each. matplotlib is imported inside :func:`draw_gantt` only (importing this module stays cheap and works
without it), and the figure is rendered with the Agg canvas directly: no pyplot, no change to global state.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable
from io import BytesIO
from typing import Any

from sim.core.fileio import write_bytes_atomic
from sim.ir.trace import STREAMS, Span, Trace

__all__ = ["KIND_COLORS", "FALLBACK_COLOR", "draw_gantt", "kind_color"]

#: One colour per op kind; a SEND and its RECV share one. Paul Tol's colour-blind-safe "muted" scheme
#: (https://personal.sron.nl/~pault/) plus Okabe-Ito orange for the tenth category.
KIND_COLORS: dict[str, str] = {
    "F": "#88CCEE",
    "B": "#CC6677",
    "I": "#DDCC77",
    "W": "#44AA99",
    "R": "#999933",
    "OPT_STEP": "#332288",
    "SEND_F": "#117733",
    "RECV_F": "#117733",
    "SEND_B": "#882255",
    "RECV_B": "#882255",
    "PREFETCH": "#AA4499",
    "EVICT": "#E69F00",
}
#: Colour of every kind not in :data:`KIND_COLORS`.
FALLBACK_COLOR = "#BBBBBB"

DPI = 150
# Row geometry in inches; the y data unit is one inch, so a height in data units times DPI is pixels.
_BAR_H = 0.30  # compute bar
_SUB_GAP = 0.03  # between the compute bar and the first sub-bar
_SUB_H = 0.075  # one sub-bar (send/recv/h2d/d2h)
_SUB_PITCH = 0.10  # sub-bar plus the gap below it
_ROW_GAP = 0.16  # between two devices
_LABEL_PT = 6.5  # microbatch ids inside boxes
_LABEL_PAD_PX = 3.0  # a label needs its own width plus this much room in its box, pixels
_TARGET_BOX_PX = 16.0  # the figure widens until a median compute box is about this wide (capped by _MAX_W)
_MIN_W, _MAX_W = 10.0, 24.0  # figure width bounds, inches
_TOP, _RIGHT = 0.6, 0.3  # margins, inches (title and top tick labels; right edge)


def kind_color(kind: str) -> str:
    """The fill colour of an op kind (hex), :data:`FALLBACK_COLOR` for kinds without their own."""
    return KIND_COLORS.get(kind, FALLBACK_COLOR)


def _text_color(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (WCAG relative luminance)."""

    def linear(channel: int) -> float:
        c = channel / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(fill[i : i + 2], 16)) for i in (1, 3, 5))
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.18 else "white"


def _legend_entries(kinds: set[str]) -> list[tuple[str, str]]:
    """``(label, colour)`` per colour used; kinds sharing a colour are joined by ``/``; :data:`KIND_COLORS` order."""
    by_color: dict[str, list[str]] = {}
    for kind in KIND_COLORS:
        if kind in kinds:
            by_color.setdefault(KIND_COLORS[kind], []).append(kind)
    entries = [(" / ".join(names), color) for color, names in by_color.items()]
    others = sorted(kinds - KIND_COLORS.keys())
    if others:
        entries.append(("other: " + ", ".join(others), FALLBACK_COLOR))
    return entries


class _Layout:
    """Where each rank's bars go (y in inches from the top) and how big the figure is."""

    def __init__(self, trace: Trace) -> None:
        present = {s.stream for s in trace.spans}
        self.sub_streams = [s for s in STREAMS[1:] if s in present]
        self.row_pitch = _BAR_H + (_SUB_GAP + len(self.sub_streams) * _SUB_PITCH if self.sub_streams else 0) + _ROW_GAP
        self.n_rows = max(trace.num_ranks, 1)
        self.plot_h = self.n_rows * self.row_pitch

    def bar(self, rank: int, stream: str) -> tuple[float, float]:
        """``(top, height)`` of a stream's bar in rank ``rank``'s row, inches."""
        top = rank * self.row_pitch + _ROW_GAP / 2
        if stream == STREAMS[0]:
            return top, _BAR_H
        return top + _BAR_H + _SUB_GAP + self.sub_streams.index(stream) * _SUB_PITCH, _SUB_H


def _figure_width(trace: Trace, span_ms: float, left: float) -> float:
    """Figure width (inches) that makes a median compute box about :data:`_TARGET_BOX_PX` wide, within bounds."""
    durations = sorted(s.duration for s in trace.spans if s.stream == STREAMS[0] and s.end > s.start)
    if not durations:
        return _MIN_W
    median_ms = durations[len(durations) // 2] * 1e3
    axes_w = span_ms / median_ms * _TARGET_BOX_PX / DPI
    return min(max(axes_w + left + _RIGHT, _MIN_W), _MAX_W)


def _boxes(spans: list[Span], layout: _Layout) -> Any:
    """Rectangle vertices, shape ``(n, 4, 2)``, x in ms and y in inches."""
    import numpy as np

    rect = np.empty((len(spans), 4, 2))
    for i, span in enumerate(spans):
        top, height = layout.bar(span.rank, span.stream)
        x0, x1 = span.start * 1e3, span.end * 1e3
        rect[i] = ((x0, top), (x1, top), (x1, top + height), (x0, top + height))
    return rect


def _fitting_labels(
    trace: Trace, layout: _Layout, px_per_ms: float, measure: Callable[[str], tuple[float, float]]
) -> list[tuple[float, float, str, str]]:
    """The microbatch ids that fit inside their compute boxes.

    Args:
        trace: the trace; times in seconds.
        layout: the row layout (y in inches).
        px_per_ms: horizontal scale of the axes, pixels per millisecond.
        measure: ``text -> (width, height)`` of the rendered label, pixels.

    Returns:
        ``(x_ms, y_inches, text, text_colour)`` per label, centred in its box, in span order.
    """
    sizes: dict[str, tuple[float, float]] = {}
    labels = []
    for span in trace.spans:
        if span.stream != STREAMS[0] or span.mb is None:
            continue
        text = str(span.mb)
        if text not in sizes:
            sizes[text] = measure(text)
        text_w, text_h = sizes[text]
        top, bar_h = layout.bar(span.rank, span.stream)
        if text_w + _LABEL_PAD_PX > (span.end - span.start) * 1e3 * px_per_ms or text_h + 2 > bar_h * DPI:
            continue
        labels.append(((span.start + span.end) * 5e2, top + bar_h / 2, text, _text_color(kind_color(span.kind))))
    return labels


def draw_gantt(trace: Trace, path: str | os.PathLike, *, title: str = "") -> None:
    """Draw ``trace`` as a Gantt chart and write it as a PNG, atomically.

    Args:
        trace: the trace; span times in seconds (drawn in milliseconds).
        path: the ``.png`` file to write; its directory must exist.
        title: the chart title; by default a summary (``meta["source"]``, ranks, ops, makespan in ms).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    layout = _Layout(trace)
    labels = [f"r{r} {d}" for r, d in enumerate(trace.devices)]
    t0 = min([0.0] + [s.start for s in trace.spans]) * 1e3
    t1 = max([0.0] + [s.end for s in trace.spans]) * 1e3
    if t1 <= t0:
        t1 = t0 + 1.0
    span_ms = t1 - t0

    fig = Figure(dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    renderer = canvas.get_renderer()
    rank_font = FontProperties(size=8)
    label_font = FontProperties(size=_LABEL_PT)

    def text_px(text: str, font: FontProperties) -> tuple[float, float]:
        w, h, _ = renderer.get_text_width_height_descent(text, font, ismath=False)
        return w, h

    left = max([text_px(label, rank_font)[0] / DPI for label in labels] + [0.3]) + 0.25
    entries = _legend_entries({s.kind for s in trace.spans})
    width = _figure_width(trace, span_ms, left)
    # Legend: one row if it fits across the figure, else columns as wide as the widest entry
    # (entry = handle + gap + text + column spacing at 8 pt, inches).
    entry_w = [text_px(label, rank_font)[0] / DPI + 0.5 for label, _ in entries]
    if sum(entry_w) <= width - 0.4:
        ncol = max(1, len(entries))
    else:
        ncol = max(1, min(len(entries), int((width - 0.4) // max(entry_w))))
    bottom = 0.55 + 0.2 * math.ceil(len(entries) / ncol) + 0.1
    top_labels = trace.num_ranks > 4  # tall charts repeat the time axis on top
    top = _TOP if top_labels else _TOP - 0.2
    height = layout.plot_h + top + bottom
    fig.set_size_inches(width, height)
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + _RIGHT) / width, layout.plot_h / height))
    ax.set_xlim(t0, t1 + span_ms * 0.005)
    ax.set_ylim(layout.plot_h, 0)  # rank 0 on top
    ax.set_facecolor("white")

    by_color: dict[str, list[Span]] = defaultdict(list)
    for span in trace.spans:
        by_color[kind_color(span.kind)].append(span)
    for color in sorted(by_color):
        spans = by_color[color]
        edge = 0.4 if any(s.stream == STREAMS[0] for s in spans) else 0.2
        ax.add_collection(
            PolyCollection(_boxes(spans, layout), facecolors=color, edgecolors="white", linewidths=edge, zorder=2)
        )

    # Microbatch ids, where the text fits inside its box (pixels measured at the output DPI).
    px_per_ms = (width - left - _RIGHT) * DPI / (span_ms * 1.005)
    for x, y, text, color in _fitting_labels(trace, layout, px_per_ms, lambda t: text_px(t, label_font)):
        ax.text(x, y, text, fontproperties=label_font, ha="center", va="center_baseline", color=color, zorder=3,
                clip_on=True)

    # y axis: device names at the compute bars, stream names (small, grey) at the sub-bars.
    ax.set_yticks([layout.bar(r, STREAMS[0])[0] + _BAR_H / 2 for r in range(trace.num_ranks)], labels,
                  fontproperties=rank_font)
    ax.tick_params(axis="y", which="major", length=0)
    sub_ticks = [layout.bar(r, s)[0] + _SUB_H / 2 for r in range(trace.num_ranks) for s in layout.sub_streams]
    ax.set_yticks(sub_ticks, layout.sub_streams * trace.num_ranks, minor=True, fontsize=5, color="#666666")
    ax.tick_params(axis="y", which="minor", length=0, pad=2)
    ax.hlines([r * layout.row_pitch for r in range(1, trace.num_ranks)], t0, t1 + span_ms, colors="#e4e4e4",
              linewidths=0.6, zorder=1)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=max(6, int(width - left - _RIGHT)), steps=[1, 2, 2.5, 5, 10]))
    ax.tick_params(axis="x", labelsize=8, top=True, labeltop=top_labels)
    ax.set_xlabel("time (ms)", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    if not trace.spans:
        ax.text(0.5, 0.5, "no spans", transform=ax.transAxes, ha="center", va="center", fontsize=12, color="#888888",
                bbox={"facecolor": "white", "edgecolor": "none"})
    if not title:
        title = f"{trace.num_ranks} ranks · {len(trace.spans)} ops · makespan {trace.makespan * 1e3:.3f} ms"
        if isinstance(trace.meta.get("source"), str):
            title = f"{trace.meta['source']} · {title}"
    ax.set_title(title, fontsize=11, pad=6)
    if entries:
        handles = [Patch(facecolor=color, edgecolor="none", label=label) for label, color in entries]
        fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.08 / height), ncol=ncol,
                   frameon=False, fontsize=8, handlelength=1.6, columnspacing=1.6)

    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    write_bytes_atomic(path, buffer.getvalue())
