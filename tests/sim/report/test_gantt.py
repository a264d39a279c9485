"""Gantt chart: a real PNG, sized by the ranks, coloured by kind, fast for 16 × 64, matplotlib imported lazily."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sim.report import gantt

from sim.ir.trace import Span, Trace
from sim.report.gantt import FALLBACK_COLOR, KIND_COLORS, draw_gantt, kind_color

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[3]


def one_f_one_b(p: int, m: int, tf: float = 1e-3, tb: float = 2e-3, comm: float = 2e-4) -> Trace:
    """A 1F1B-like trace: p ranks, m microbatches, SEND/RECV between neighbours, an OPT_STEP per rank (seconds)."""
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
            free[r] = end[(r, kind, mb)] = start + (tf if kind == "F" else tb)
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
        draw_gantt(one_f_one_b(p, 8), path, title=f"{p} ranks")
        width, height = png_size(path)
        assert width >= 1000
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
    categories = ["F", "B", "I", "W", "R", "OPT_STEP", "SEND_F", "SEND_B", "PREFETCH", "EVICT"]
    assert len({kind_color(k) for k in categories} | {FALLBACK_COLOR}) == len(categories) + 1
    assert kind_color("REDUCE_GRAD") == kind_color("STASH") == FALLBACK_COLOR


def test_legend_lists_the_kinds_present_once_per_colour():
    entries = gantt._legend_entries({"RECV_F", "F", "SEND_F", "STASH", "REDUCE_GRAD"})
    assert entries == [("F", KIND_COLORS["F"]), ("SEND_F / RECV_F", KIND_COLORS["SEND_F"]),
                       ("other: REDUCE_GRAD, STASH", FALLBACK_COLOR)]
    assert gantt._legend_entries(set()) == []


def test_text_colour_contrasts_with_the_box():
    assert gantt._text_color(KIND_COLORS["F"]) == "black"
    assert gantt._text_color(KIND_COLORS["OPT_STEP"]) == "white"


def test_microbatch_ids_are_written_only_where_they_fit():
    spans = [
        Span("0F0", "F", 0, "compute", 0.0, 1e-3, 0, 0),  # 10 px wide at 10 px/ms
        Span("0F1", "F", 0, "compute", 1e-3, 1.5e-3, 0, 1),  # 5 px: too narrow for "1"
        Span("0F12", "F", 0, "compute", 2e-3, 3e-3, 0, 12),  # 10 px: too narrow for "12"
        Span("0OPT_STEP", "OPT_STEP", 0, "compute", 3e-3, 5e-3, 0),  # no microbatch
        Span("0SEND_F0", "SEND_F", 0, "send", 1e-3, 3e-3, 0, 0, 0, 1),  # sub-bars carry no ids
        Span("1B0", "B", 1, "compute", 4e-3, 6e-3, 1, 0),
    ]
    trace = Trace.from_spans(spans, ["a", "b"])
    layout = gantt._Layout(trace)
    labels = gantt._fitting_labels(trace, layout, 10.0, lambda text: (4.0 * len(text), 8.0))  # + 3 px padding
    top0, h = layout.bar(0, "compute")
    top1, _ = layout.bar(1, "compute")
    b_text = gantt._text_color(KIND_COLORS["B"])
    assert labels == [(0.5, top0 + h / 2, "0", "black"), (5.0, top1 + h / 2, "0", b_text)]
    assert top1 > top0 + h + len(layout.sub_streams) * 0.05  # rank 1's row starts below rank 0's sub-bars


def test_existing_file_is_replaced_whole(tmp_path):
    path = tmp_path / "gantt.png"
    path.write_bytes(b"old")
    draw_gantt(one_f_one_b(2, 2), path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert os.listdir(tmp_path) == ["gantt.png"]


def test_16_ranks_64_microbatches_draws_fast(tmp_path):
    trace = one_f_one_b(16, 64)
    assert sum(s.stream == "compute" for s in trace.spans) == 16 * 2 * 64 + 16
    began = time.perf_counter()
    draw_gantt(trace, tmp_path / "g.png")
    assert time.perf_counter() - began < 20.0  # about 1 s on one core
    width, height = png_size(tmp_path / "g.png")
    assert width <= 24 * 150 and height > 1500


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
