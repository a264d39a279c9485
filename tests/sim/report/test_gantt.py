"""Gantt chart: a real PNG, sized by the ranks, coloured by kind, every number inside its box at 16 × 64, sub-rows
visible at 32 ranks, matplotlib imported lazily. The figure tests read the drawn artists (no pixels rendered)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.ir.trace import Span, Trace
from sim.report import gantt
from sim.report.gantt import FALLBACK_COLOR, KIND_COLORS, draw_gantt, kind_color
from sim.report.gantt_layout import LABEL_PAD_PX, MAX_HEIGHT_PX, MAX_WIDTH_PX, MIN_BOX_PX, MIN_SUB_ROW_PX

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[3]


def one_f_one_b(p: int, m: int, tf: float = 1e-3, tb: float = 2e-3, comm: float = 2e-4, ends: float = 1.0) -> Trace:
    """A 1F1B-like trace: p ranks, m microbatches, SEND/RECV between neighbours, an OPT_STEP per rank (seconds).

    The first and last ranks' F and B take ``ends`` times as long (the embedding and the head of a language model).
    """
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                order.append(("F", warmup + i))
            order.append(("B", i))
        orders.append(order)
    end: dict[tuple[int, str, int], float] = {}
    free, nxt, spans, pair = [0.0] * p, [0] * p, [], 0
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        for r in range(p):
            if nxt[r] == len(orders[r]):
                continue
            kind, mb = orders[r][nxt[r]]
            dep = (r - 1, "F", mb) if kind == "F" else (r + 1, "B", mb) if r < p - 1 else (r, "F", mb)
            if dep[0] in (-1, p):
                ready = 0.0
            elif dep in end:
                ready = end[dep] + (comm if dep[0] != r else 0.0)
            else:
                continue
            start = max(free[r], ready)
            free[r] = end[(r, kind, mb)] = start + (tf if kind == "F" else tb) * (ends if r in (0, p - 1) else 1.0)
            spans.append(Span(f"{r}{kind}{mb}", kind, r, "compute", start, free[r], r, mb))
            nxt[r] += 1
            peer = r + 1 if kind == "F" else r - 1
            if 0 <= peer < p:
                spans.append(Span(f"{r}SEND_{kind}{mb}", f"SEND_{kind}", r, "send", free[r], free[r] + comm, r, mb,
                                  pair, peer))
                spans.append(Span(f"{peer}RECV_{kind}{mb}", f"RECV_{kind}", peer, "recv", free[r], free[r] + comm,
                                  peer, mb, pair, r))
                pair += 1
    spans += [Span(f"{r}OPT_STEP", "OPT_STEP", r, "compute", free[r], free[r] + tf, r) for r in range(p)]
    return Trace.from_spans(spans, [f"gpu{r % 2}" for r in range(p)], {"source": "sim"})


def png_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` in pixels from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_writes_a_png_that_grows_with_the_ranks(tmp_path):
    heights = []
    for p in (1, 4, 16):
        path = tmp_path / f"g{p}.png"
        draw_gantt(one_f_one_b(p, 8), path, title=f"{p} ranks", dpi=30)  # a thumbnail: the layout scaled by 30/150
        _, geom = gantt._figure(one_f_one_b(p, 8))
        width, height = png_size(path)
        assert (width, height) == pytest.approx((geom.width_px / 5, geom.height_px / 5), abs=1)
        heights.append(height)
    assert heights[0] < heights[1] < heights[2]
    assert sorted(os.listdir(tmp_path)) == ["g1.png", "g16.png", "g4.png"]  # no temporary files left


def test_sub_bars_only_when_other_streams_are_used(tmp_path):
    compute_only = Trace.from_spans([Span("0F0", "F", 0, "compute", 0.0, 1e-3, 0, 0)], ["cpu"])
    with_copy = Trace.from_spans(list(compute_only.spans) + [Span("0PREFETCH", "PREFETCH", 0, "h2d", 0, 1e-3, 0)],
                                 ["cpu"])
    draw_gantt(compute_only, tmp_path / "a.png")
    draw_gantt(with_copy, tmp_path / "b.png")
    assert png_size(tmp_path / "a.png")[1] < png_size(tmp_path / "b.png")[1]


@pytest.mark.parametrize("trace", [Trace((), ()), Trace.from_spans([], ["v100", "v100"])], ids=["no-ranks", "idle"])
def test_empty_trace_still_draws(tmp_path, trace):
    draw_gantt(trace, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_SIGNATURE


def test_each_kind_is_drawn_in_its_colour_and_idle_time_is_white(tmp_path):
    import numpy as np
    from matplotlib.image import imread

    spans = [Span("0F0", "F", 0, "compute", 0.0, 0.01, 0, 0), Span("0W0", "W", 0, "compute", 0.02, 0.03, 0, 0)]
    draw_gantt(Trace.from_spans(spans, ["cpu"]), tmp_path / "g.png")
    pixels = np.round(imread(tmp_path / "g.png")[:, :, :3] * 255).astype(int)
    colours = {"#{:02X}{:02X}{:02X}".format(*px) for px in pixels.reshape(-1, 3)}
    assert KIND_COLORS["F"] in colours and KIND_COLORS["W"] in colours
    assert KIND_COLORS["B"] not in colours and KIND_COLORS["OPT_STEP"] not in colours
    # Between the two boxes (10–20 ms), along a pixel row through the middle of the F box, the chart is white.
    f_rows = np.nonzero((pixels == [0x88, 0xCC, 0xEE]).all(axis=2).any(axis=1))[0]
    y = f_rows[len(f_rows) // 2]
    f_cols = np.nonzero((pixels[y] == [0x88, 0xCC, 0xEE]).all(axis=1))[0]
    w_cols = np.nonzero((pixels[y] == [0x44, 0xAA, 0x99]).all(axis=1))[0]
    gap = pixels[y, f_cols.max() + 3 : w_cols.min() - 3]
    assert len(gap) > 50 and (gap == 255).all()


def test_kind_colours_are_distinct_per_category_with_a_fallback():
    assert kind_color("SEND_F") == kind_color("RECV_F") and kind_color("SEND_B") == kind_color("RECV_B")
    assert kind_color("TP_F") == kind_color("TP_B") == kind_color("TP_R")
    assert kind_color("REDUCE_GRAD") == kind_color("GATHER_PARAMS")
    categories = ["F", "B", "I", "W", "R", "OPT_STEP", "SEND_F", "SEND_B", "PREFETCH", "EVICT", "TP_F", "REDUCE_GRAD"]
    assert len({kind_color(k) for k in categories} | {FALLBACK_COLOR}) == len(categories) + 1
    assert kind_color("STASH") == kind_color("USE_VERSION") == FALLBACK_COLOR


def test_legend_lists_the_kinds_present_once_per_colour():
    entries = gantt._legend_entries({"RECV_F", "F", "SEND_F", "STASH", "USE_VERSION", "TP_B", "TP_F"})
    assert entries == [("F", KIND_COLORS["F"]), ("SEND_F / RECV_F", KIND_COLORS["SEND_F"]),
                       ("TP_F / TP_B", KIND_COLORS["TP_F"]), ("other: STASH, USE_VERSION", FALLBACK_COLOR)]
    assert gantt._legend_entries(set()) == []


def test_text_colour_contrasts_with_the_box():
    assert gantt._text_color(KIND_COLORS["F"]) == "black"
    assert gantt._text_color(KIND_COLORS["OPT_STEP"]) == "white"


def drawn_numbers(fig) -> tuple[list, np.ndarray]:
    """The microbatch numbers as drawn: their outlines and each one's extent ``(x0, y0, x1, y1)``, display pixels.

    Read from the artist itself (its paths, offsets and transforms); the extent is that of the outline's points,
    which contains the ink.
    """
    from matplotlib.path import Path as MplPath

    found = [c for c in fig.axes[0].collections if c.get_gid() == "numbers"]
    if not found:
        return [], np.empty((0, 4))
    numbers = found[0]
    offsets = numbers.get_offset_transform().transform(numbers.get_offsets())
    shape_px = {}  # one outline per distinct number: its extent around the offset
    for path in numbers.get_paths():
        if id(path) not in shape_px:
            points = numbers.get_transform().transform(path.vertices[path.codes != MplPath.CLOSEPOLY])
            shape_px[id(path)] = (*points.min(axis=0), *points.max(axis=0))
    around = np.array([shape_px[id(path)] for path in numbers.get_paths()])
    return numbers.get_paths(), around + np.hstack([offsets, offsets])


def drawn_boxes(fig) -> np.ndarray:
    """Every box drawn (compute and sub-row), as rows ``(x0, y0, x1, y1)`` in display pixels."""
    from matplotlib.collections import PolyCollection

    ax = fig.axes[0]
    corners = [path.vertices[:4] for c in ax.collections if isinstance(c, PolyCollection) for path in c.get_paths()]
    display = ax.transData.transform(np.concatenate(corners)).reshape(-1, 4, 2)
    return np.hstack([display.min(axis=1), display.max(axis=1)])


def box_px(fig, geom, spans: list[Span]) -> np.ndarray:
    """The display extents ``(x0, y0, x1, y1)`` of the spans' boxes, from their times and the rows the layout gives."""
    rows = [geom.rows.bar(s.rank, s.stream) for s in spans]
    lower = [(s.start * 1e3, top + height) for s, (top, height) in zip(spans, rows)]  # y grows downwards in data
    upper = [(s.end * 1e3, top) for s, (top, _) in zip(spans, rows)]
    to_px = fig.axes[0].transData
    return np.hstack([to_px.transform(lower), to_px.transform(upper)]).reshape(-1, 4)


def assert_every_number_inside_its_box(trace: Trace, fig, geom) -> None:
    from matplotlib.textpath import TextPath

    paths, extents = drawn_numbers(fig)
    compute = [i for i, s in enumerate(trace.spans) if s.stream == "compute" and s.mb is not None]
    assert [label.span for label in geom.labels] == compute  # every box has its number
    spans = [trace.spans[label.span] for label in geom.labels]
    boxes = box_px(fig, geom, spans)
    drawn = {tuple(box) for box in np.round(drawn_boxes(fig), 3)}
    assert all(tuple(box) in drawn for box in np.round(boxes, 3))  # the boxes the numbers sit in were drawn
    pad = LABEL_PAD_PX - 1e-6
    inside = ((boxes[:, :2] + pad <= extents[:, :2]) & (extents[:, 2:] <= boxes[:, 2:] - pad)).all(axis=1)
    outside = [(s.op, box, extent) for s, box, extent, ok in zip(spans, boxes, extents, inside) if not ok]
    assert not outside, outside[:5]
    # ... and each is its box's microbatch number: the outline of str(mb), turned if the label says so.
    checked = {}
    for label, span, path in zip(geom.labels, spans, paths, strict=True):
        assert checked.setdefault(id(path), (span.mb, label.rotated)) == (span.mb, label.rotated)
    for label, span, path in zip(geom.labels, spans, paths):
        if checked.pop(id(path), None) is not None:
            outline = TextPath((0, 0), str(span.mb), size=geom.label_pt).vertices
            outline = outline @ np.array([[0.0, 1.0], [-1.0, 0.0]]) if label.rotated else outline
            assert np.allclose(path.vertices - path.vertices.mean(axis=0), outline - outline.mean(axis=0), atol=1e-6)


# Durations of the user's run (python -m sim.run --topology 16xV100 --model gpt:layers=48,hidden=2048 --schedule 1f1b):
# forward 3.451 ms, backward 6.887 ms, 4/3 of that on the first and last stage, a 35.6 µs transfer. Like that run,
# the trace lasts 604 ms at m=32 and 1045 ms at m=64, so a forward box is 1/175 and 1/303 of the chart. The old
# chart (at most 3600 px, a fixed 6.5 pt font) numbered 532 of this trace's 1024 boxes at m=32, 246 of the run's.
USER_RUN = {"tf": 3.451e-3, "tb": 6.887e-3, "comm": 35.6e-6, "ends": 4.601 / 3.451}


@pytest.mark.parametrize("m", [32, 64])
def test_every_compute_box_of_16_ranks_shows_its_number_inside_it(m):
    trace = one_f_one_b(16, m, **USER_RUN)
    fig, geom = gantt._figure(trace)
    assert len(geom.labels) == 16 * 2 * m and geom.notes == ()
    assert_every_number_inside_its_box(trace, fig, geom)
    assert tuple(fig.get_size_inches() * fig.dpi) == pytest.approx((geom.width_px, geom.height_px))
    assert geom.width_px <= MAX_WIDTH_PX and geom.height_px <= MAX_HEIGHT_PX


def test_numbers_turn_where_they_cannot_fit_across():
    trace = Trace.from_spans([Span(f"0F{i}", "F", 0, "compute", i * 1e-3, (i + 1) * 1e-3, 0, i) for i in range(400)],
                             ["cpu"])
    fig, geom = gantt._figure(trace)  # 400 boxes of ~14 px: "100".."399" need ~20 px across at 5 pt
    assert geom.width_px == MAX_WIDTH_PX and geom.notes == ()
    assert_every_number_inside_its_box(trace, fig, geom)
    assert {label.text for label in geom.labels if label.rotated} >= {str(i) for i in range(100, 400)}


def test_a_box_too_narrow_even_at_the_width_limit_is_named_in_a_note(tmp_path):
    spans = [Span("0F0", "F", 0, "compute", 0.0, 1e-6, 0, 0), Span("0F1", "F", 0, "compute", 1e-6, 1.0, 0, 1)]
    fig, geom = gantt._figure(Trace.from_spans(spans, ["cpu"]))
    assert [label.text for label in geom.labels] == ["1"] and len(drawn_numbers(fig)[0]) == 1
    (note,) = [text.get_text() for text in fig.texts if "omitted" in text.get_text()]
    bound = re.fullmatch(r"microbatch numbers omitted on 1 of 2 boxes narrower than ([0-9.]+) ms .*", note)
    assert bound and 1e-3 < float(bound[1])  # the 1 µs box is narrower than the bound the note states


@pytest.mark.parametrize("ranks", [16, 32])
def test_send_and_receive_rows_stay_visible(ranks):
    trace = one_f_one_b(ranks, 8, **USER_RUN)
    fig, geom = gantt._figure(trace)
    assert geom.rows.sub_streams == ("send", "recv")
    transfers = [s for s in trace.spans if s.stream != "compute"]
    boxes = drawn_boxes(fig)
    rows = boxes[boxes[:, 3] - boxes[:, 1] < geom.rows.bar_px - 1]
    assert len(rows) == len(transfers)  # one box per send and per receive, none dropped
    assert (rows[:, 3] - rows[:, 1]).min() >= MIN_SUB_ROW_PX  # rows at least 8 px tall ...
    assert (rows[:, 2] - rows[:, 0]).min() >= MIN_BOX_PX - 1e-9  # ... and a 35.6 µs transfer 2 px wide
    # Each transfer's box starts at its start time, in its own sub-row.
    drawn = {tuple(box) for box in np.round(rows[:, [0, 1, 3]], 3)}
    assert all(tuple(box) in drawn for box in np.round(box_px(fig, geom, transfers)[:, [0, 1, 3]], 3))


def test_existing_file_is_replaced_whole(tmp_path):
    path = tmp_path / "gantt.png"
    path.write_bytes(b"old")
    draw_gantt(one_f_one_b(2, 2), path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert os.listdir(tmp_path) == ["gantt.png"]


def test_16_ranks_64_microbatches_renders_to_a_bounded_png(tmp_path):
    trace = one_f_one_b(16, 64)
    assert sum(s.stream == "compute" for s in trace.spans) == 16 * 2 * 64 + 16
    draw_gantt(trace, tmp_path / "g.png", dpi=15)  # a tenth of the pixels each way: the drawing path, cheaply
    width, height = png_size(tmp_path / "g.png")
    assert width <= MAX_WIDTH_PX / 10 and height <= MAX_HEIGHT_PX / 10

def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_importing_the_viz_modules_does_not_import_matplotlib():
    result = _python(
        "import sys, sim.report, sim.report.gantt, sim.report.chrome_trace\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch'))\n"
        "assert not bad, bad\n"
    )
    assert result.returncode == 0, result.stderr


def test_drawing_leaves_matplotlib_global_state_alone(tmp_path):
    result = _python(
        "import sys, matplotlib\n"
        "backend, params = dict.__getitem__(matplotlib.rcParams, 'backend'), matplotlib.rcParams.copy()\n"
        "from sim.ir.trace import Span, Trace\n"
        "from sim.report.gantt import draw_gantt\n"
        "trace = Trace.from_spans([Span('0F0', 'F', 0, 'compute', 0.0, 1.0, 0, 0)], ['cpu'])\n"
        f"draw_gantt(trace, {str(tmp_path / 'g.png')!r})\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "assert dict.__getitem__(matplotlib.rcParams, 'backend') == backend\n"
        "assert matplotlib.rcParams.copy() == params\n"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("ranks, length", [(2, 60), (2, 300), (20, 300), (180, 20000)])
def test_a_long_title_wraps_inside_the_figure_above_the_plot(ranks, length):
    # A 3D plan's title (schedule, model spec, topology, layout) ran off the right edge of a 2-rank chart from about
    # 200 characters; now every line is inside the figure, the plot keeps its size, and no character is lost
    # (up to the height bound, where the last line says "…").
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    title = ("interleaved v=2 · llama:layers=80,hidden=8192,heads=64 · 4x8xH100 · TP8×DP2×PP4 · m=64 · " * 300)
    title = title[:length]
    fig, geom = gantt._figure(one_f_one_b(ranks, 4), title)
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    box = ax.title.get_window_extent(renderer=renderer)
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, (box, fig.bbox)
    assert box.y0 >= ax.bbox.y1  # above the plot
    assert ax.bbox.height == pytest.approx(geom.plot_h_px) and fig.bbox.height <= MAX_HEIGHT_PX
    drawn = ax.title.get_text()
    assert ax.title.get_fontsize() == 11
    if length <= 300:
        assert re.sub(r"\s", "", drawn) == re.sub(r"\s", "", title)
        assert (drawn.count("\n") == 0) == (length == 60)
    else:
        assert drawn.endswith("…") and re.sub(r"\s", "", title).startswith(re.sub(r"\s", "", drawn)[:-1])
