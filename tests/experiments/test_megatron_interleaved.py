"""experiments.run megatron_interleaved: the quick run's files, its uniform-stage rows against Narayanan et al.'s
closed form (m + (p − 1)/v)·(t_f + t_b), its message counts and bytes against 2·m·(p·v − 1) messages of one
activation each, and bad input."""

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
    out = tmp_path_factory.mktemp("megatron_interleaved")
    assert run_main(["megatron_interleaved", "--quick", "--out", str(out)]) == 0
    assert (out / "megatron_interleaved.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "megatron_interleaved.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_quick_grid_is_p4_every_m_and_v_in_every_case(quick):
    assert {(r["case"], int(r["p"]), int(r["m"]), int(r["v"])) for r in quick} == {
        (case, 4, m, v) for case in ("ideal", "a100", "v100") for m in (4, 8, 16, 32) for v in (1, 2, 4)}
    assert all(r["schedule"] == ("1f1b" if r["v"] == "1" else "interleaved") for r in quick)


def test_uniform_stages_on_free_links_take_the_closed_form(quick):
    # 32 layers of 1 ms forward + 2 ms backward on p = 4 ranks: a full stage is t_f + t_b = 8 x 3 ms; interleaving
    # divides the fill and drain by v (SC'21 §2.2.2), so the gain over 1F1B is (m + p - 1)/(m + (p - 1)/v) - 1.
    ideal = [r for r in quick if r["case"] == "ideal"]
    assert len(ideal) == 12
    for row in ideal:
        p, v, m = int(row["p"]), int(row["v"]), int(row["m"])
        stage = 32 // p * 3e-3
        assert float(row["iteration_time_s"]) == pytest.approx((m + (p - 1) / v) * stage, rel=1e-12)
        assert float(row["gain_over_1f1b"]) == pytest.approx((m + p - 1) / (m + (p - 1) / v) - 1, abs=1e-6)
        # the bubble as a fraction of the whole iteration: (p - 1)/(v m + p - 1)
        assert float(row["bubble_fraction"]) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-6)


def test_interleaving_sends_v_times_the_boundaries_each_carrying_one_activation(quick):
    # m microbatches cross p·v - 1 vstage boundaries forward and back; every message is one activation (or its
    # gradient) of one sample: 1 MB for the uniform model, seq x hidden fp16 values (1024 x 2048 x 2 bytes) for the GPT.
    per_message = {"ideal": 1_000_000, "a100": 1024 * 2048 * 2, "v100": 1024 * 2048 * 2}
    for row in quick:
        p, v, m = int(row["p"]), int(row["v"]), int(row["m"])
        assert int(row["send_ops"]) == 2 * m * (p * v - 1)
        assert int(row["p2p_bytes"]) == int(row["send_ops"]) * per_message[row["case"]]
        assert float(row["p2p_bytes_over_1f1b"]) == pytest.approx((p * v - 1) / (p - 1), abs=1e-6)


def test_a_real_node_s_row_is_the_product_s_prediction(quick):
    # No closed form holds for the GPT (uneven end stages, messages): its row must be exactly what build_plan and
    # predict say for the same inputs.
    built = build_plan(PlanInputs("gpt:layers=32,hidden=2048", "4xV100", "interleaved", microbatches=16, chunks=2))
    expected = predict_built(built).metrics["iteration_time_s"]
    (row,) = [r for r in quick if (r["case"], r["p"], r["m"], r["v"]) == ("v100", "4", "16", "2")]
    assert float(row["iteration_time_s"]) == expected


@pytest.mark.parametrize("args, needle", [(["--cases", "tpu"], "'tpu'"), (["--cases", ","], "empty list"),
                                          (["--chunks", "3"], "--chunks")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["megatron_interleaved", "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o" / "megatron_interleaved.csv").exists()
