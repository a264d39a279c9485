"""experiments.run memory_real: one real case on 2 CPU ranks and the per-layer breakdown, asserted on the data the
experiment returns; the verdict and table from hand-made rows; bad input (the full experiment is a benchmark)."""

from __future__ import annotations

import pytest

from experiments.memory_real import (
    CASES,
    TARGET_ERROR,
    format_table,
    layer_breakdown,
    plan_inputs,
    run_experiment,
    summarize,
)
from tests.experiments.refusal import refused

MODEL = "gpt:layers=4,hidden=256,seq=128,vocab=1000"


def test_one_case_measures_every_rank_beside_its_prediction(tmp_path):
    found = run_experiment(tmp_path, ["gpipe-recompute"], model=MODEL, ranks=2, microbatches=2, iterations=1,
                           warmup=1)
    assert found["skipped"] == {} and found["overhead"] is None
    (case,) = found["results"]
    assert case["case"] == "gpipe-recompute" and [r["rank"] for r in case["ranks"]] == [0, 1]
    for row in case["ranks"]:
        assert row["predicted_bytes"] > 0 and row["measured_bytes"] > 0
        assert row["relative_error"] == pytest.approx((row["measured_bytes"] - row["predicted_bytes"])
                                                      / row["measured_bytes"])
    summary = found["summary"]
    assert summary["ranks"] == 2
    assert summary["max_abs_error"] == max(abs(r["relative_error"]) for r in case["ranks"])
    # The training state is 16 bytes per parameter on both sides: fp32 weights, gradients and Adam's two moments in
    # the executor, fp16 weights and gradients plus an fp32 master copy and moments in the simulator's ledger.
    layers = {row["layer"]: row for row in found["layers"]}
    assert sorted(layers) == ["block0", "embed", "head"]
    h, s, v = 256, 128, 1000
    assert layers["block0"]["predicted_state_bytes"] == layers["block0"]["measured_state_bytes"] == 16 * (
        12 * h * h + 13 * h)
    assert layers["head"]["measured_state_bytes"] == 16 * (2 * h + v * h)
    # A block's output is one fp32 (s, h) tensor, which its consumer keeps.
    assert layers["block0"]["measured_output_bytes"] == 4 * s * h


def test_the_breakdown_follows_the_microbatch_size():
    one, two = layer_breakdown(MODEL, 1), layer_breakdown(MODEL, 2)
    for a, b in zip(one, two, strict=True):
        assert b["predicted_saved_bytes"] == 2 * a["predicted_saved_bytes"]
        assert b["measured_output_bytes"] == 2 * a["measured_output_bytes"]
        assert b["measured_state_bytes"] == a["measured_state_bytes"]


def test_cases_cover_every_schedule_with_and_without_recompute_and_dp_and_tp():
    schedules = {"gpipe", "1f1b", "interleaved", "zb1p", "pipedream"}
    assert set(CASES) == {f"{s}{r}" for s in schedules for r in ("", "-recompute")} | {"dp", "tp"}
    assert plan_inputs("dp", MODEL, 2, 4, 1).global_batch == 8
    assert plan_inputs("tp", MODEL, 4, 4, 1).tp == 4
    assert plan_inputs("interleaved-recompute", MODEL, 2, 4, 1).chunks == 2


def test_the_verdict_and_table_from_hand_made_rows():
    def rank(r, predicted, measured):
        return {"rank": r, "predicted_bytes": predicted, "measured_bytes": measured,
                "relative_error": (measured - predicted) / measured}
    results = [{"case": "1f1b", "layout": "", "ranks": [rank(0, 1_000_000, 1_040_000), rank(1, 1_000_000, 900_000)]}]
    summary = summarize(results)
    assert summary["within_target"] == 1 and not summary["target_met"]
    assert summary["max_abs_error"] == pytest.approx(100_000 / 900_000)
    assert summarize(results[:0])["target_met"]
    table = format_table(results, summary, [], None)
    assert "| 1f1b | 1 | 1.00 | 0.90 | -11.1% |" in table
    assert f"1 of 2 ranks within {TARGET_ERROR * 100:.0f}%" in table and "target NOT met" in table


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "5"], "--ranks must be 2, 3 or 4, got 5"),
    (["--cases", "1f1b,nope"], "--cases: unknown 'nope'"),
    (["--model", "cnn:layers=2"], "--model must be a gpt spec"),
    (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["--overhead-repeats", "-1"], "--overhead-repeats must be >= 0, got -1"),
])
def test_bad_input_is_refused(tmp_path, capsys, argv, message):
    err = refused(capsys, ["memory_real", "--out", str(tmp_path / "out"), *argv])
    assert message in err, err
