"""experiments.run zero_bubble: the quick run's files, its uniform-stage rows against Qi et al.'s closed forms
(1F1B: (m + p − 1)·3t, ZB-H1: 3m·t + (p − 1)·t at T_F = T_B = T_W = t; bubbles (p − 1)/m and (p − 1)/(3m)), the
same memory on the first stage, and bad input."""

from __future__ import annotations

import csv

import pytest

from experiments.run import main as run_main
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from tests.experiments.refusal import refused


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_bubble")
    assert run_main(["zero_bubble", "--quick", "--out", str(out)]) == 0
    assert (out / "zero_bubble.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "zero_bubble.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_quick_grid_is_p2_and_p4_every_m_both_schedules_in_both_cases(quick):
    assert {(r["case"], int(r["p"]), int(r["m"]), r["schedule"]) for r in quick} == {
        (case, p, p * k, s) for case in ("ideal", "a100") for p in (2, 4) for k in (1, 2, 4, 8)
        for s in ("1f1b", "zb1p")}


def test_uniform_stages_on_free_links_take_the_closed_forms(quick):
    # 8 layers of 1 ms forward and 2 ms backward (I and W 1 ms each) on p ranks: t = 8/p ms per stage and pass.
    for row in (r for r in quick if r["case"] == "ideal"):
        p, m = int(row["p"]), int(row["m"])
        t = 8 // p * 1e-3
        expected = (m + p - 1) * 3 * t if row["schedule"] == "1f1b" else 3 * m * t + (p - 1) * t
        assert float(row["iteration_time_s"]) == pytest.approx(expected, rel=1e-12)
        over_ideal = (p - 1) / m if row["schedule"] == "1f1b" else (p - 1) / (3 * m)
        assert float(row["bubble_over_ideal"]) == pytest.approx(over_ideal, abs=1e-5)
        assert float(row["gain_over_1f1b"]) == pytest.approx((m + p - 1) / (m + (p - 1) / 3) - 1, abs=1e-6)


def test_zb_h1_holds_1f1b_s_peak_memory_on_the_first_stage(quick):
    # Both hold p microbatches of activations on the fullest rank (the first): the paper's "similar memory".
    by = {(r["case"], r["p"], r["m"], r["schedule"]): int(r["peak_memory_bytes"]) for r in quick}
    for (case, p, m, schedule), peak in by.items():
        if schedule == "zb1p":
            assert peak == by[(case, p, m, "1f1b")]


def test_a_real_node_s_row_is_the_product_s_prediction(quick):
    # No closed form holds for the GPT (uneven end stages, messages, the optimizer step): its rows must be exactly
    # what build_plan and predict say for the same inputs, and the gain their ratio.
    built = build_plan(PlanInputs("gpt:layers=32,hidden=2048", "4xA100", "zb1p", microbatches=8))
    expected = predict_built(built).metrics["iteration_time_s"]
    rows = {r["schedule"]: r for r in quick if (r["case"], r["p"], r["m"]) == ("a100", "4", "8")}
    assert float(rows["zb1p"]["iteration_time_s"]) == expected
    assert float(rows["zb1p"]["gain_over_1f1b"]) == pytest.approx(
        float(rows["1f1b"]["iteration_time_s"]) / expected - 1, abs=1e-6)


@pytest.mark.parametrize("args, needle", [(["--cases", "tpu"], "'tpu'"), (["--cases", ""], "empty list"),
                                          (["--p", "3"], "--p")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["zero_bubble", "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o" / "zero_bubble.csv").exists()
