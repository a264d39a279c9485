"""Model FLOPs, MFU and token rates (``sim.cost.model_flops``) against the published counting formulas."""

import json

import pytest

from sim.cost.model_flops import training_rates
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


def _plan(model, topology, **layout):
    built = build_plan(PlanInputs(model, topology, "1f1b", microbatches=4, **layout))
    return built.plan, built.topology


def test_llama_counts_as_torchtitan_does():
    # torchtitan (models/utils.get_dense_model_nparams_and_flops): 6·(N − token table)·T + 12·L·H·Q·T² FLOPs per
    # sequence of T tokens, N the parameters.
    plan, topology = _plan("llama3.1-8b,seq=4096", "8xH100", pp=2, tp=2, dp=2)
    n, table, layers, heads, head_dim, t = 8_030_261_248, 128256 * 4096, 32, 32, 128, 4096
    per_sequence = 6 * (n - table) * t + 12 * layers * heads * head_dim * t * t
    # The count leaves out the norms' weights (elementwise): 2h per block and the final h.
    norms = 6 * (2 * 4096 * layers + 4096) * t
    sequences = 4 * 2  # 4 microbatches of 1 on each of 2 replicas
    rates = training_rates(plan, topology, 2.0)
    assert rates["model_flops_per_iteration"] == (per_sequence - norms) * sequences
    assert rates["tokens_per_iteration"] == sequences * t
    assert rates["tokens_per_s"] == sequences * t / 2.0
    assert rates["tokens_per_s_per_device"] == sequences * t / 2.0 / 8
    h100 = topology.devices[0].peak_flops
    assert rates["mfu"] == pytest.approx(rates["model_flops_per_iteration"] / 2.0 / (8 * h100), rel=1e-15)


def test_gpt_counts_as_megatron_does():
    # Narayanan et al. 2021 (arXiv 2104.04473) Appendix: 72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L)) per iteration.
    layers, h, s, v = 4, 256, 128, 1000
    plan, topology = _plan(f"gpt:layers={layers},hidden={h},heads=8,seq={s},vocab={v}", "2xA100", pp=2)
    batch = 4
    megatron = 72 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    assert training_rates(plan, topology, 1.0)["model_flops_per_iteration"] == pytest.approx(megatron, rel=1e-12)


def test_a_model_without_a_sequence_or_flops_has_no_token_rate_or_mfu():
    plan, topology = _plan("uniform:layers=2,fwd_ms=1,bwd_ms=2", "2xA100", pp=2)
    rates = training_rates(plan, topology, 1.0)
    assert rates["mfu"] is None and rates["tokens_per_s"] is None and rates["model_flops_per_iteration"] == 0
    assert training_rates(*_plan("gpt:layers=2", "2xA100", pp=2), 0.0)["mfu"] is None


def test_sim_run_reports_them_in_metrics_and_summary(tmp_path, capsys):
    from sim.run import main

    main(["--model", "llama:layers=2,hidden=256,heads=8,kv_heads=2,ffn=704,vocab=1000,seq=256", "--topology",
          "2xH100", "--schedule", "1f1b", "--microbatches", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0 < metrics["mfu"] < 1 and metrics["tokens_per_iteration"] == 2 * 256


@pytest.mark.parametrize("precision, peak", [("bf16", 989e12), ("fp8", 1979e12)])
def test_mfu_names_its_peak_and_times_it_gives_back_the_model_flops(precision, peak):
    # H100 SXM dense tensor-core peaks, NVIDIA H100 datasheet: 989 TFLOP/s BF16, 1,979 TFLOP/s FP8. The model FLOPs
    # are torchtitan's count (test_llama_counts_as_torchtitan_does): 6·(N − table)·T + 12·L·H·Q·T² per sequence,
    # without the norms' weights, 4 sequences of 4096 tokens.
    built = build_plan(PlanInputs("llama3.1-8b,seq=4096", "4xH100", "1f1b", microbatches=4, precision=precision))
    n, table, layers, heads, head_dim, t = 8_030_261_248, 128256 * 4096, 32, 32, 128, 4096
    flops = 4 * (6 * (n - table) * t + 12 * layers * heads * head_dim * t * t - 6 * (2 * 4096 * layers + 4096) * t)
    rates = training_rates(built.plan, built.topology, 3.0)
    assert rates["mfu_peak"] == {"precision": precision, "flop_per_s": 4 * peak}
    assert rates["mfu"] * rates["mfu_peak"]["flop_per_s"] * 3.0 == pytest.approx(flops, rel=1e-12)
    # beside it, the same FLOPs against the BF16 peak: the same figure under bf16, twice the fp8 one under fp8
    assert rates["mfu_bf16"] * 4 * 989e12 * 3.0 == pytest.approx(flops, rel=1e-12)
    assert rates["mfu_bf16"] / rates["mfu"] == pytest.approx(peak / 989e12, rel=1e-12)


def test_the_summary_says_which_peak_the_mfu_is_against():
    from sim.report.outputs import mfu_text

    assert mfu_text({"mfu": 0.412, "mfu_bf16": 0.824, "mfu_peak": {"precision": "fp8", "flop_per_s": 1.0}}) == \
        "41.2 % of FP8 peak (82.4 % of BF16 peak)"
    assert mfu_text({"mfu": 0.412, "mfu_bf16": 0.412, "mfu_peak": {"precision": "bf16", "flop_per_s": 1.0}}) == \
        "41.2 % of BF16 peak"
