"""experiments.gpipe_scaling: the quick run's grid and files, its uniform case against GPipe's bubble arithmetic
K·M/(M + K − 1) (and the absolute iteration time (M + K − 1)·(t_f + t_b)), the published tables as transcribed from
the reference notes, the error column's arithmetic."""

from __future__ import annotations

import csv

import pytest

from experiments import gpipe_scaling


@pytest.fixture(scope="module")
def result() -> gpipe_scaling.Result:
    return gpipe_scaling.run(quick=True)


@pytest.fixture(scope="module")
def quick(result, tmp_path_factory):
    """The rows of ``write``'s CSV: its normalised and error columns are what the tests below check."""
    out = tmp_path_factory.mktemp("gpipe_scaling")
    assert gpipe_scaling.write(result, out) == [out / "gpipe_scaling.csv", out / "gpipe_scaling.png"]
    assert (out / "gpipe_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "gpipe_scaling.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_quick_grid_is_k2_and_k4_for_every_case_and_its_ms(result, quick):
    grid = [(case.key, m, k) for case in gpipe_scaling.CASES for m in case.ms for k in (2, 4)]
    assert [(p.case.key, p.m, p.k) for p in result.points] == grid
    assert [(r["case"], int(r["m"]), int(r["k"])) for r in quick] == grid


def test_equal_stages_on_free_links_scale_as_gpipe_s_bubble(result, quick):
    # 24 layers of 1 ms forward + 2 ms backward on K ranks: a stage is 24/K x 3 ms per microbatch, and GPipe without
    # re-materialisation takes (M + K - 1) stage-times, so the throughput over K = 2, M = 1 is K·M/(M + K - 1).
    points = list(result.points)
    ideal = [p for p in points if p.case.key == "ideal"]
    assert len(ideal) == 6
    for point in ideal:
        k, m = point.k, point.m
        assert point.iteration_s == pytest.approx((m + k - 1) * 24 / k * 3e-3, rel=1e-12)
        assert gpipe_scaling.normalised(points, point) == pytest.approx(k * m / (m + k - 1), rel=1e-12)
    for row in (r for r in quick if r["case"] == "ideal"):
        k, m = int(row["k"]), int(row["m"])
        assert float(row["normalised"]) == pytest.approx(k * m / (m + k - 1), abs=1e-6)
        assert abs(float(row["error_vs_reference"])) < 1e-6
        assert row["paper"] == ""


def test_the_published_tables_are_the_reference_notes(quick):
    # ../shared/reference/hardware.md §4.3: Table 2 (AmoebaNet-D(18, 256) | Transformer-48), Table 3 at M = 32.
    table2 = {1: ((1, 1.13, 1.38), (1, 1.07, 1.3)), 4: ((1.07, 1.26, 1.72), (1.7, 3.2, 4.8)),
              32: ((1.21, 1.84, 3.48), (1.8, 3.4, 6.3))}
    for m, (amoeba, transformer) in table2.items():
        assert gpipe_scaling.PAPER[("t2-amoebanet", m)] == amoeba
        assert gpipe_scaling.PAPER[("t2-transformer48", m)] == transformer
    assert gpipe_scaling.PAPER[("t3-amoebanet", 32)] == (1, 1.7, 2.7)
    assert gpipe_scaling.PAPER[("t3-transformer24", 32)] == (1, 1.8, 3.3)
    for row in (r for r in quick if r["paper"]):
        paper = gpipe_scaling.PAPER[(row["case"], int(row["m"]))][gpipe_scaling.KS.index(int(row["k"]))]
        assert float(row["paper"]) == paper
        assert float(row["error_vs_reference"]) == pytest.approx(float(row["normalised"]) / paper - 1, abs=2e-6)


def test_every_case_is_normalised_to_its_own_baseline(quick):
    for case in gpipe_scaling.CASES:
        k, m = case.base
        base = next(r for r in quick if (r["case"], int(r["k"]), int(r["m"])) == (case.key, k, m))
        assert float(base["normalised"]) == 1.0
        for row in (r for r in quick if r["case"] == case.key):
            expected = float(row["samples_per_s"]) / float(base["samples_per_s"])
            assert float(row["normalised"]) == pytest.approx(expected, abs=1e-6)
            assert float(row["samples_per_s"]) == pytest.approx(
                int(row["m"]) * int(row["microbatch_size"]) / float(row["iteration_time_s"]), rel=1e-12)
