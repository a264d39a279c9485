"""experiments.pipedream: the quick run; on uniform stages and free links PipeDream's steady-state window
is fully busy and as long as the 1F1B order says, a flushed 1F1B minibatch idles (p − 1)/(m + p − 1), PipeDream keeps
p − r weight copies (PipeDream §3.3, ``num_versions = warmup + 1``) beside 1F1B's p − r and GPipe's m microbatches;
the throughput rows are pipedream_vs_dp's own."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from experiments import pipedream, pipedream_vs_dp
from experiments.pipedream import steady_window
from sim.ir.trace import Span


@pytest.fixture(scope="module")
def quick() -> pipedream.Result:
    return pipedream.run(quick=True)


def test_the_quick_grid_is_p2_and_p4_with_m_p_4p_16p_every_stage(quick):
    got = {(r.schedule, r.p, r.m, r.stage) for r in quick.steady}
    assert got == {(s, p, p * k, r) for s in ("pipedream", "1f1b") for p in (2, 4) for k in (1, 4, 16)
                   for r in range(p)}
    assert len(got) == len(quick.steady)


def test_pipedream_s_steady_window_has_no_stall_and_the_1f1b_order_s_length(quick):
    # 8 layers of 1 ms forward, 2 ms backward on p stages: t_f = 8/p ms, t_b = 16/p ms. From stage r's first
    # backward to its backward m - p + r come m - p + r + 1 backwards and the m - p + r forwards between them.
    busy = {(r.p, r.m, r.stage): r.window_fraction for r in quick.steady if r.schedule == "pipedream"}
    assert len(busy) == 3 * (2 + 4)  # every pipedream stage of the grid
    assert all(value == pytest.approx(1.0, abs=1e-12) for value in busy.values())
    for row in quick.steady:
        k = row.m - row.p + row.stage
        assert row.window_s == pytest.approx((k + 1) * 16e-3 / row.p + k * 8e-3 / row.p, rel=1e-12)


def test_a_flushed_1f1b_minibatch_idles_p_minus_1_over_m_plus_p_minus_1(quick):
    for row in quick.steady:
        assert 1 - row.plan_fraction == pytest.approx((row.p - 1) / (row.m + row.p - 1), abs=1e-12)


def test_weight_stashing_memory_against_1f1b_and_gpipe(quick):
    # memory's uniform model: 16 layers of 1 MB activations and 10 MB weights per sample; a stage of 16/p layers
    # keeps A = (16/p + 1) MB per microbatch (its input too) and P = 16/p * 10 MB per weight copy.
    mem = {(r.schedule, r.p, r.m, r.stage): r for r in quick.memory}
    assert len(mem) == len(quick.memory) == 3 * 2 * (2 + 4)
    for (schedule, p, m, r), row in mem.items():
        a, w = (16 // p + 1) * 10**6, 16 // p * 10 * 10**6
        n = {"gpipe": m, "1f1b": p - r, "pipedream": p - r}[schedule]
        # PipeDream: one version per minibatch in flight, p - r once m >= 2(p - r) - 1 (the first p - r forwards
        # share the starting weights, each later one has its own)
        versions = min(p - r, m - (p - r) + 1) if schedule == "pipedream" else 0
        if schedule == "pipedream" and m >= 2 * (p - r) - 1:
            assert versions == p - r
        assert row.copies == versions
        assert row.simulated == row.formula
        assert row.simulated == n * a + versions * w  # the uniform model has no workspace


def test_the_throughput_rows_are_pipedream_vs_dp_s_compare_beside_the_paper(quick):
    model = pipedream_vs_dp.MODELS["vgg16"]
    expected = pipedream_vs_dp.compare(replace(model, global_batch=16 * 16), pipedream_vs_dp.CLUSTERS["A"])
    by = {c.cluster.key: c for c in quick.throughput}
    assert list(by) == ["A", "B"] and {c.model.key for c in quick.throughput} == {"vgg16"}
    assert by["A"].speedup == expected.speedup and by["A"].dp.time_s == expected.dp.time_s
    assert pipedream.PAPER == {"A": 5.28, "B": 2.98}


def test_the_file_holds_every_part_and_the_paper_s_figures(quick, tmp_path):
    files = pipedream.write(quick, tmp_path)
    assert files == [tmp_path / "pipedream.csv", tmp_path / "pipedream.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(files[0], newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len([r for r in rows if r["part"] == "steady"]) == 3 * len(quick.steady)
    assert len([r for r in rows if r["part"] == "memory"]) == 3 * len(quick.memory)
    speedups = {r["cluster"]: r for r in rows if r["quantity"] == "speedup_over_dp"}
    assert (speedups["A"]["paper"], speedups["B"]["paper"]) == ("5.28", "2.98")
    assert float(speedups["A"]["simulated"]) == quick.throughput[0].speedup


def test_the_window_starts_at_the_first_backward_and_ends_before_the_drain():
    # p = 2, m = 3, stage 0: F0 F1 . B0 F2 B1 . B2; the drain is the last p - r - 1 = 1 backward.
    spans = [Span(op, op[0], 0, "compute", start, start + 1, 0) for op, start in
             (("F0", 0), ("F1", 1), ("B0", 3), ("F2", 4), ("B1", 5), ("B2", 8))]
    assert steady_window(spans, 2, 3, 0) == (3, 6)
    late = Span("B1", "B", 0, "compute", 4, 5, 0)
    assert steady_window([*spans[:3], late], 2, 2, 0) == (3, 4)  # m = p: the window is B0 alone
    with pytest.raises(ValueError, match="m = 1"):
        steady_window(spans[:3], 2, 1, 0)  # m < p: stage 0 never reaches a steady state
