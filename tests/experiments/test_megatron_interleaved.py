"""experiments.megatron_interleaved: the quick run's files, its uniform-stage rows against Narayanan et al.'s
closed form (m + (p − 1)/v)·(t_f + t_b), its message counts and bytes against 2·m·(p·v − 1) messages of one
activation each, its files, and bad input."""

from __future__ import annotations

import csv

import pytest

from experiments import megatron_interleaved
from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built


@pytest.fixture(scope="module")
def quick() -> megatron_interleaved.Result:
    return megatron_interleaved.run(quick=True)


def test_the_quick_grid_is_p4_every_m_and_v_in_every_case(quick):
    assert {(r.case.key, r.p, r.m, r.v) for r in quick.rows} == {
        (case, 4, m, v) for case in ("ideal", "a100", "v100") for m in (4, 8, 16, 32) for v in (1, 2, 4)}
    assert all(r.schedule == ("1f1b" if r.v == 1 else "interleaved") for r in quick.rows)


def test_uniform_stages_on_free_links_take_the_closed_form(quick):
    # 32 layers of 1 ms forward + 2 ms backward on p = 4 ranks: a full stage is t_f + t_b = 8 x 3 ms; interleaving
    # divides the fill and drain by v (SC'21 §2.2.2), so the gain over 1F1B is (m + p - 1)/(m + (p - 1)/v) - 1.
    rows = list(quick.rows)
    ideal = [r for r in rows if r.case.key == "ideal"]
    assert len(ideal) == 12
    for row in ideal:
        p, v, m = row.p, row.v, row.m
        stage = 32 // p * 3e-3
        assert row.time_s == pytest.approx((m + (p - 1) / v) * stage, rel=1e-12)
        assert megatron_interleaved.gain(rows, row) == pytest.approx((m + p - 1) / (m + (p - 1) / v) - 1, abs=1e-6)
        # the bubble as a fraction of the whole iteration: (p - 1)/(v m + p - 1); on free links all the idle time
        assert row.idle_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-6)


def test_interleaving_sends_v_times_the_boundaries_each_carrying_one_activation(quick):
    # m microbatches cross p·v - 1 vstage boundaries forward and back; every message is one activation (or its
    # gradient) of one sample: 1 MB for the uniform model, seq x hidden fp16 values (1024 x 2048 x 2 bytes) for the GPT.
    per_message = {"ideal": 1_000_000, "a100": 1024 * 2048 * 2, "v100": 1024 * 2048 * 2}
    base = {(r.case.key, r.m): r.p2p_bytes for r in quick.rows if r.v == 1}
    for row in quick.rows:
        p, v, m = row.p, row.v, row.m
        assert row.sends == 2 * m * (p * v - 1)
        assert row.p2p_bytes == row.sends * per_message[row.case.key]
        assert row.p2p_bytes / base[(row.case.key, m)] == pytest.approx((p * v - 1) / (p - 1), abs=1e-6)


def test_a_real_node_s_row_is_the_product_s_prediction(quick):
    # No closed form holds for the GPT (uneven end stages, messages): its row must be exactly what build_plan and
    # predict say for the same inputs.
    built = build_plan(PlanInputs("gpt:layers=32,hidden=2048", "4xV100", "interleaved", microbatches=16, chunks=2))
    expected = predict_built(built).metrics["iteration_time_s"]
    (row,) = [r for r in quick.rows if (r.case.key, r.p, r.m, r.v) == ("v100", 4, 16, 2)]
    assert row.time_s == expected


def test_the_files_hold_every_row(quick, tmp_path):
    files = megatron_interleaved.write(quick, tmp_path)
    assert files == [tmp_path / "megatron_interleaved.csv", tmp_path / "megatron_interleaved.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(files[0], newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(r["case"], int(r["p"]), int(r["v"]), int(r["m"]), float(r["iteration_time_s"]), int(r["send_ops"]))
            for r in written] == [(r.case.key, r.p, r.v, r.m, r.time_s, r.sends) for r in quick.rows]


@pytest.mark.parametrize("cases, needle", [(("tpu",), "'tpu'"), ((), "empty list")])
def test_bad_cases_are_refused_naming_the_flag(cases, needle):
    with pytest.raises(SpecError, match="--cases") as caught:
        megatron_interleaved.run(quick=True, cases=cases)
    assert needle in str(caught.value)
