"""experiments.zero_bubble: the quick run's rows against Qi et al.'s closed forms (1F1B: (m + p − 1)·3t, ZB-H1:
3m·t + (p − 1)·t at T_F = T_B = T_W = t; bubbles (p − 1)/m and (p − 1)/(3m)), the same memory on the first stage,
its files, and bad input."""

from __future__ import annotations

import csv

import pytest

from experiments import zero_bubble
from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built


@pytest.fixture(scope="module")
def quick() -> zero_bubble.Result:
    return zero_bubble.run(quick=True)


def test_the_quick_grid_is_p2_and_p4_every_m_both_schedules_in_both_cases(quick):
    assert [c.key for c in quick.cases] == ["ideal", "a100"]
    assert {(r.case.key, r.p, r.m, r.schedule) for r in quick.rows} == {
        (case, p, p * k, s) for case in ("ideal", "a100") for p in (2, 4) for k in (1, 2, 4, 8)
        for s in ("1f1b", "zb1p")}


def test_uniform_stages_on_free_links_take_the_closed_forms(quick):
    # 8 layers of 1 ms forward and 2 ms backward (I and W 1 ms each) on p ranks: t = 8/p ms per stage and pass.
    rows = list(quick.rows)
    for row in (r for r in rows if r.case.key == "ideal"):
        p, m = row.p, row.m
        t = 8 // p * 1e-3
        expected = (m + p - 1) * 3 * t if row.schedule == "1f1b" else 3 * m * t + (p - 1) * t
        assert row.time_s == pytest.approx(expected, rel=1e-12)
        over_ideal = (p - 1) / m if row.schedule == "1f1b" else (p - 1) / (3 * m)
        assert row.idle_fraction / (1 - row.idle_fraction) == pytest.approx(over_ideal, abs=1e-5)
        assert zero_bubble.gain(rows, row) == pytest.approx((m + p - 1) / (m + (p - 1) / 3) - 1, abs=1e-6)


def test_zb_h1_holds_1f1b_s_peak_memory_on_the_first_stage(quick):
    # Both hold p microbatches of activations on the fullest rank (the first): the paper's "similar memory".
    by = {(r.case.key, r.p, r.m, r.schedule): r.peak_memory_bytes for r in quick.rows}
    for (case, p, m, schedule), peak in by.items():
        if schedule == "zb1p":
            assert peak == by[(case, p, m, "1f1b")]


def test_a_real_node_s_row_is_the_product_s_prediction(quick):
    # No closed form holds for the GPT (uneven end stages, messages, the optimizer step): its rows must be exactly
    # what build_plan and predict say for the same inputs, and the gain their ratio.
    built = build_plan(PlanInputs("gpt:layers=32,hidden=2048", "4xA100", "zb1p", microbatches=8))
    expected = predict_built(built).metrics["iteration_time_s"]
    rows = {r.schedule: r for r in quick.rows if (r.case.key, r.p, r.m) == ("a100", 4, 8)}
    assert rows["zb1p"].time_s == expected
    assert zero_bubble.gain(list(quick.rows), rows["zb1p"]) == pytest.approx(rows["1f1b"].time_s / expected - 1,
                                                                               abs=1e-6)


def test_the_files_hold_every_row(quick, tmp_path):
    files = zero_bubble.write(quick, tmp_path)
    assert files == [tmp_path / "zero_bubble.csv", tmp_path / "zero_bubble.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(files[0], newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(r["case"], int(r["p"]), int(r["m"]), r["schedule"], float(r["iteration_time_s"])) for r in written] == [
        (r.case.key, r.p, r.m, r.schedule, r.time_s) for r in quick.rows]


@pytest.mark.parametrize("cases, needle", [(("tpu",), "'tpu'"), ((), "empty list")])
def test_bad_cases_are_refused_naming_the_flag(cases, needle):
    with pytest.raises(SpecError, match="--cases") as caught:
        zero_bubble.run(quick=True, cases=cases)
    assert needle in str(caught.value)
