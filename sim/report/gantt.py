"""Gantt chart of a :class:`~sim.ir.trace.Trace` as a PNG: one row per device, one colour per op kind.

Each device row has the compute stream as the main bar and, beneath it, one thin sub-row per other stream
(``send``, ``recv``, ``h2d``, ``d2h``) that has any span in the trace; idle time is white; a box is drawn at least
2 px wide, so a 30 µs transfer on a one-second timeline still shows. Every compute box shows its microbatch number
inside it: the figure's width, the number font (6.5 pt down to 5 pt) and, for the narrowest boxes, turning the
number 90° are chosen from the boxes' durations so that each number's outline fits its box
(:mod:`sim.report.gantt_layout` holds the rules).

Bounded for any trace: at most 6000 × 6000 px at 150 dpi, so Agg's RGBA canvas is at most 144 MB and a 1024-rank chart
does not allocate gigabytes; sub-rows at least 8 px tall. Where something has to give, a note under the legend says
what: numbers left off boxes too narrow for them even at the width limit, or sub-rows left out of charts with too many
ranks (more than about 150) to keep them 8 px tall. A title too long for one line wraps onto more (after its " · "
separators, commas or spaces), the figure growing upwards by them within the same height bound. Built for 16 devices ×
64 microbatches and more (thousands of boxes): boxes are drawn as one :class:`~matplotlib.collections.PolyCollection`
per colour and the numbers as one :class:`~matplotlib.collections.PathCollection` of glyph outlines, not one artist
each. matplotlib is imported inside :func:`draw_gantt` only (importing this module stays cheap and works without it),
and the figure is rendered with the Agg canvas directly: no pyplot, no change to global state.
"""

from __future__ import annotations

import os
from collections import defaultdict
from io import BytesIO
from typing import Any

from sim.core.fileio import write_bytes_atomic
from sim.ir.trace import STREAMS, Span, Trace
from sim.report.gantt_layout import DPI, MAX_HEIGHT_PX, MIN_BOX_PX, RANK_PT, GanttGeometry, layout_gantt
from sim.report.metrics import rank_label
from sim.report.titles import wrap_title

__all__ = ["KIND_COLORS", "FALLBACK_COLOR", "draw_gantt", "gantt_figure", "kind_color"]

_TITLE_PT = 11.0  # the title's font size, points (a long title wraps rather than shrinks)

#: One colour per op kind; a SEND and its RECV share one. Paul Tol's colour-blind-safe "muted" scheme
#: (https://personal.sron.nl/~pault/) plus Okabe-Ito orange, blue and vermillion for the tenth to twelfth categories:
#: the tensor-parallel collectives share one colour, the data-parallel ones another.
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
    "TP_F": "#0072B2",
    "TP_B": "#0072B2",
    "TP_R": "#0072B2",
    "EP_F": "#56B4E9",
    "EP_B": "#56B4E9",
    "EP_R": "#56B4E9",
    "REDUCE_GRAD": "#D55E00",
    "GATHER_PARAMS": "#D55E00",
}
#: Colour of every kind not in :data:`KIND_COLORS`.
FALLBACK_COLOR = "#BBBBBB"

_SUB_LABEL_PT = 5.0  # stream names at the sub-rows, points


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


def _boxes(spans: list[Span], geom: GanttGeometry) -> Any:
    """Rectangle vertices, shape ``(n, 4, 2)``, x in ms and y in pixels; at least :data:`MIN_BOX_PX` wide."""
    import numpy as np

    min_ms = MIN_BOX_PX / geom.px_per_ms
    rect = np.empty((len(spans), 4, 2))
    for i, span in enumerate(spans):
        top, height = geom.rows.bar(span.rank, span.stream)
        x0 = span.start * 1e3
        x1 = max(span.end * 1e3, x0 + min_ms)
        rect[i] = ((x0, top), (x1, top), (x1, top + height), (x0, top + height))
    return rect


def _figure(trace: Trace, title: str = "") -> tuple[Any, GanttGeometry]:
    """The chart as a matplotlib :class:`~matplotlib.figure.Figure` on an Agg canvas, and the geometry it follows.

    Nothing is rasterised here: the tests read the artists' extents from this figure without paying for pixels.
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PathCollection, PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.patches import Patch
    from matplotlib.path import Path
    from matplotlib.textpath import TextPath
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import Affine2D

    fig = Figure(dpi=DPI)
    renderer = FigureCanvasAgg(fig).get_renderer()
    outlines: dict[str, tuple[Path, float, float]] = {}

    def outline(text: str) -> tuple[Path, float, float]:
        """``text``'s outline at 1 pt centred on its extent, in points, and the extent's width and height in pixels.

        The extent is that of the outline's points, curve control points included: it contains the ink (so "fits"
        errs on the safe side) and costs microseconds, where the exact curve extent costs ~10 ms a string. Outlines
        scale exactly with the font size, so each string is laid out once.
        """
        if text not in outlines:
            path = TextPath((0, 0), text, size=1.0, prop=FontProperties())
            corners = path.vertices[path.codes != Path.CLOSEPOLY] if len(path.vertices) else [[0.0, 0.0]]
            (x0, y0), (x1, y1) = np.min(corners, axis=0), np.max(corners, axis=0)
            centred = path.transformed(Affine2D().translate(-(x0 + x1) / 2, -(y0 + y1) / 2))
            outlines[text] = centred, (x1 - x0) * DPI / 72, (y1 - y0) * DPI / 72
        return outlines[text]

    def measure(text: str, points: float) -> tuple[float, float]:
        _, width, height = outline(text)
        return width * points, height * points

    def text_width(text: str, points: float) -> float:
        return renderer.get_text_width_height_descent(text, FontProperties(size=points), ismath=False)[0]

    # A 3D plan's trace shows one device per pipeline rank (of each simulated replica): name the device it is.
    device_of_rank = trace.meta.get("device_of_rank")
    named = isinstance(device_of_rank, list) and len(device_of_rank) == trace.num_ranks
    rank_names = [rank_label(r, d, device_of_rank[r] if named else None)  # type: ignore[index]
                  for r, d in enumerate(trace.devices)]
    entries = _legend_entries({s.kind for s in trace.spans})
    geom = layout_gantt(trace, measure, text_width, rank_names, [label for label, _ in entries])
    width, height = geom.width_px, geom.height_px
    plot_w = width - geom.left_px - geom.right_px
    if not title:
        title = f"{trace.num_ranks} ranks · {len(trace.spans)} ops · makespan {trace.makespan * 1e3:.3f} ms"
        if isinstance(trace.meta.get("source"), str):
            title = f"{trace.meta['source']} · {title}"
    # A long title (a 3D plan's model, topology and layout, a long model spec) is wrapped onto more lines, each within
    # the figure, and the figure grows upwards by the lines added (everything else is placed from the bottom). It is
    # centred on the axes, so a line has twice the room between their centre and the nearer edge of the figure.
    centre = geom.left_px + plot_w / 2
    room = 2 * min(centre, width - centre) - 8
    line_px = _TITLE_PT * 1.2 * DPI / 72  # matplotlib's line spacing, 1.2 times the font size
    most_lines = 1 + max(0, int((MAX_HEIGHT_PX - height) // line_px))  # the height bound holds with the title too
    title_lines = wrap_title(title, lambda text: text_width(text, _TITLE_PT) <= room, most_lines)
    height += round((len(title_lines) - 1) * line_px)
    fig.set_size_inches(width / DPI, height / DPI)
    ax = fig.add_axes((geom.left_px / width, geom.bottom_px / height, plot_w / width, geom.plot_h_px / height))
    ax.set_xlim(geom.t0_ms, geom.x_max_ms)
    ax.set_ylim(geom.plot_h_px, 0)  # rank 0 on top
    ax.set_facecolor("white")

    by_color: dict[str, list[Span]] = defaultdict(list)
    drawn = {STREAMS[0], *geom.rows.sub_streams}  # sub-rows left out of very tall charts take their spans along
    for span in trace.spans:
        if span.stream in drawn:
            by_color[kind_color(span.kind)].append(span)
    # White edges part neighbouring compute boxes; sub-row boxes (often a pixel or two wide) get none, so they show.
    edge = 0.4 if geom.rows.bar_px >= 12 else 0.0
    for color in sorted(by_color):
        for stream_is_compute in (True, False):
            spans = [s for s in by_color[color] if (s.stream == STREAMS[0]) == stream_is_compute]
            if spans:
                ax.add_collection(PolyCollection(_boxes(spans, geom), facecolors=color, edgecolors="white",
                                                 linewidths=edge if stream_is_compute else 0.0, zorder=2))

    # Microbatch numbers as glyph outlines in one collection: thousands of Text artists would cost seconds to draw.
    if geom.labels:
        turn = Affine2D().rotate_deg(90)
        size = Affine2D().scale(geom.label_pt)
        shapes = {(label.text, label.rotated) for label in geom.labels}
        drawn = {(text, turned): outline(text)[0].transformed(size + turn if turned else size)
                 for text, turned in shapes}
        numbers = [drawn[label.text, label.rotated] for label in geom.labels]
        ax.add_collection(PathCollection(
            numbers, offsets=[(label.x_ms, label.y_px) for label in geom.labels], offset_transform=ax.transData,
            transform=Affine2D().scale(1 / 72) + fig.dpi_scale_trans, edgecolors="none", linewidths=0, zorder=3,
            facecolors=[_text_color(kind_color(trace.spans[label.span].kind)) for label in geom.labels],
            gid="numbers"))

    # y axis: device names at the compute bars (every rank_step-th), stream names (small, grey) at the sub-rows.
    rows, named = geom.rows, range(0, trace.num_ranks, geom.rank_step)
    ax.set_yticks([rows.bar(r, STREAMS[0])[0] + rows.bar_px / 2 for r in named], [rank_names[r] for r in named],
                  fontsize=RANK_PT)
    ax.tick_params(axis="y", which="major", length=0)
    if rows.sub_streams and rows.sub_pitch_px >= 10:
        sub_ticks = [rows.bar(r, s)[0] + rows.sub_px / 2 for r in range(trace.num_ranks) for s in rows.sub_streams]
        ax.set_yticks(sub_ticks, list(rows.sub_streams) * trace.num_ranks, minor=True, fontsize=_SUB_LABEL_PT,
                      color="#666666")
    ax.tick_params(axis="y", which="minor", length=0, pad=2)
    ax.tick_params(axis="y", which="both", labelright=geom.right_ticks)
    if rows.row_gap_px >= 4:
        ax.hlines([r * rows.pitch_px for r in range(1, trace.num_ranks)], geom.t0_ms, geom.x_max_ms,
                  colors="#e4e4e4", linewidths=0.6, zorder=1)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=max(6, int(plot_w / DPI)), steps=[1, 2, 2.5, 5, 10]))
    ax.tick_params(axis="x", labelsize=8, top=True, labeltop=geom.top_ticks)
    ax.set_xlabel("time (ms)", fontsize=9)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    if not trace.spans:
        ax.text(0.5, 0.5, "no spans", transform=ax.transAxes, ha="center", va="center", fontsize=12, color="#888888",
                bbox={"facecolor": "white", "edgecolor": "none"})
    # Plain text: a '$' in a model or topology name is not the start of a formula.
    ax.set_title("\n".join(title_lines), fontsize=_TITLE_PT, pad=6, parse_math=False)
    notes_h = 27.0 * len(geom.notes)  # the notes sit under the legend, one line each
    for i, note in enumerate(geom.notes):
        fig.text(0.5, (notes_h - 27.0 * i - 20.0) / height, note, ha="center", va="bottom", fontsize=RANK_PT,
                 color="#444444")
    if entries:
        handles = [Patch(facecolor=color, edgecolor="none", label=label) for label, color in entries]
        fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, (12.0 + notes_h) / height),
                   ncol=geom.legend_ncol, frameon=False, fontsize=RANK_PT, handlelength=1.6, columnspacing=1.6)
    return fig, geom


def gantt_figure(trace: Trace, *, title: str = "") -> Any:
    """``trace`` as a Gantt chart: a matplotlib :class:`~matplotlib.figure.Figure` (what :func:`draw_gantt` writes),
    which a notebook shows inline; no pyplot state is touched.

    Args:
        trace: the trace; span times in seconds (drawn in milliseconds).
        title: the chart title; by default a summary (``meta["source"]``, ranks, ops, makespan in ms).
    """
    return _figure(trace, title)[0]


def draw_gantt(trace: Trace, path: str | os.PathLike, *, title: str = "", dpi: float = DPI) -> None:
    """Draw ``trace`` as a Gantt chart and write it as a PNG, atomically.

    Args:
        trace: the trace; span times in seconds (drawn in milliseconds).
        path: the ``.png`` file to write; its directory must exist.
        title: the chart title; by default a summary (``meta["source"]``, ranks, ops, makespan in ms).
        dpi: output resolution, pixels per inch. The layout is made for the default, 150; another value scales
            the whole picture (a thumbnail), so the pixel bounds of the module docstring scale with it.
    """
    fig = gantt_figure(trace, title=title)
    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    write_bytes_atomic(path, buffer.getvalue())
