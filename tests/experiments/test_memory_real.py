"""experiments.memory_real: one real case on 2 CPU ranks and the per-layer breakdown, asserted on the data the
experiment returns; the verdict and table from hand-made rows; bad input (the full experiment is a benchmark)."""

from __future__ import annotations

import json

import pytest

from experiments import memory_real
from experiments.memory_real import (
    CASES,
    TARGET_ERROR,
    format_table,
    layer_breakdown,
    plan_inputs,
    run_experiment,
    summarize,
)
from sim.core.errors import SpecError

MODEL = "gpt:layers=4,hidden=256,seq=128,vocab=1000"


def test_one_case_measures_every_rank_beside_its_prediction(tmp_path):
    found = run_experiment(tmp_path, ["gpipe-recompute"], model=MODEL, ranks=2, microbatches=2, iterations=1,
                           warmup=1)
    assert found["skipped"] == {} and found["overhead"] is None
    (case,) = found["results"]
    assert case["case"] == "gpipe-recompute" and [r["rank"] for r in case["ranks"]] == [0, 1]
    for row in case["ranks"]:
        assert row["predicted_bytes"] > 0 and row["measured_bytes"] > 0
        assert row["relative_error"] == pytest.approx(row["predicted_bytes"] / row["measured_bytes"] - 1)
    summary = found["summary"]
    assert summary["ranks"] == 2
    assert summary["max_abs_error"] == max(abs(r["relative_error"]) for r in case["ranks"])
    # The training state: 16 bytes per parameter in the catalog (fp16 weights and gradients, an fp32 master copy and
    # Adam's moments), and measured: fp32 weights, gradients and two moments, plus Adam's 4-byte step per tensor.
    layers = {row["layer"]: row for row in found["layers"]}
    assert sorted(layers) == ["block0", "embed", "head"]
    h, v = 256, 1000
    block = 12 * h * h + 13 * h
    assert layers["block0"]["model_state_bytes"] == 16 * block
    assert layers["block0"]["measured_state_bytes"] == 16 * block + 4 * 12  # 12 parameter tensors in a block
    assert layers["head"]["model_state_bytes"] == 16 * (2 * h + v * h)


def test_the_breakdown_reads_the_profile_beside_the_catalog(tmp_path):
    from profiles.layer_memory import measure_layer_memory
    from sim.cost.profile import layer_memory_fields, profile_document
    from sim.models import build_model

    spec = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100"
    graph = build_model(spec)
    measured = measure_layer_memory(spec)
    layers = [{"name": layer.name, "fwd_s": 1e-3, "bwd_s": 2e-3, **layer_memory_fields(m)}
              for layer, m in zip(graph.layers, measured)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_document(model=graph.spec, device="cpu", microbatch_size=1, layers=layers,
                                                method={}, machine={}, software={})))
    rows = layer_breakdown(spec, 1, path)
    assert [row["layer"] for row in rows] == ["embed", "block0", "head"]
    for row, index in zip(rows, (0, 1, 3)):
        assert row["measured_kept_bytes"] == measured[index].retained_bytes
        assert row["model_kept_bytes"] == graph.layers[index].saved_bytes


def test_cases_cover_every_schedule_with_and_without_recompute_and_dp_and_tp():
    schedules = {"gpipe", "1f1b", "interleaved", "zb1p", "pipedream"}
    assert set(CASES) == {f"{s}{r}" for s in schedules for r in ("", "-recompute")} | {"dp", "tp"}
    assert plan_inputs("dp", MODEL, 2, 4, 1).global_batch == 8
    assert plan_inputs("tp", MODEL, 4, 4, 1).tp == 4
    assert plan_inputs("interleaved-recompute", MODEL, 2, 4, 1).chunks == 2


def test_the_verdict_and_table_from_hand_made_rows():
    def rank(r, predicted, measured):
        return {"rank": r, "predicted_bytes": predicted, "measured_bytes": measured,
                "relative_error": predicted / measured - 1}
    results = [{"case": "1f1b", "layout": "", "ranks": [rank(0, 1_000_000, 1_040_000), rank(1, 1_000_000, 900_000)]}]
    summary = summarize(results)
    assert summary["within_target"] == 1 and not summary["target_met"]
    assert summary["max_abs_error"] == pytest.approx(100_000 / 900_000)
    assert summarize(results[:0])["target_met"]
    table = format_table(results, summary, [], None)
    assert "| 1f1b | 1 | 1.00 | 0.90 | +11.1% |" in table
    assert f"1 of 2 ranks within {TARGET_ERROR * 100:.0f}%" in table and "target NOT met" in table


@pytest.mark.parametrize("options,message", [
    ({"ranks": 5}, "--ranks must be 2, 3 or 4, got 5"),
    ({"cases": "1f1b,nope"}, "--cases: unknown 'nope'"),
    ({"model": "cnn:layers=2"}, "--model must be a gpt spec"),
    ({"microbatches": 0}, "--microbatches must be >= 1, got 0"),
    ({"overhead_repeats": -1}, "--overhead-repeats must be >= 0, got -1"),
])
def test_bad_input_is_refused_naming_the_flag(tmp_path, options, message):
    with pytest.raises(SpecError, match=message):
        memory_real.run(out=tmp_path, **options)
    assert list(tmp_path.iterdir()) == []  # refused before any run
