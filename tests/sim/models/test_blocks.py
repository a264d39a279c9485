"""What a block keeps under each implementation (sim.models.blocks): Transformer Engine blocks against the list of
tensors Megatron-Core's TE layers save, counted one by one; the MoE family's bf16 count unchanged; the precision's
width from the format; and the combinations refused."""

import math
from fractions import Fraction

import pytest

from sim.core.errors import SpecError
from sim.cost.plan_settings import saved_input_bytes
from sim.models import build_model
from sim.models.blocks import TRANSFORMER_ENGINE
from sim.models.sharding import Sharding

H, A, G, D, F, S = 64, 4, 2, 16, 128, 32
LLAMA = f"llama:layers=2,hidden={H},heads={A},kv_heads={G},head_dim={D},ffn={F},vocab=512,seq={S}"


def _engine_block_tensors(w: Fraction) -> list[tuple[str, int, Fraction, bool]]:
    """(tensor, elements per sample, bytes per element, split by tp or lying between the TP regions) of one Llama
    block as Transformer Engine layers save it: LayerNormLinear keeps the norm's input (the block's input, counted as
    the previous layer's output), its statistics and its quantized output; fused attention q, k, v, its output and
    the log-sum-exp; the o projection a quantized copy of its input when narrower; bias-SwiGLU its fc1 input; fc2
    its quantized input."""
    q, kv = A * D, G * D
    return [("block output", S * H, Fraction(2), False), ("residual sum", S * H, Fraction(2), False),
            ("qkv input (norm output)", S * H, w, False), ("fc1 input (norm output)", S * H, w, False),
            ("two norms' rsigma", 2 * S, Fraction(4), False),
            ("q", S * q, Fraction(2), True), ("k", S * kv, Fraction(2), True), ("v", S * kv, Fraction(2), True),
            ("attention output", S * q, Fraction(2), True), ("softmax lse", S * A, Fraction(4), True),
            ("o input (quantized copy)", S * q, w if w < 2 else Fraction(0), True),
            ("fc1 output (gate, up)", 2 * S * F, Fraction(2), True), ("fc2 input", S * F, w, True)]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("w", [Fraction(2), Fraction(1), Fraction(33, 32), Fraction(9, 16)])
def test_a_llama_block_keeps_what_transformer_engine_saves(tp, sp, w):
    sharding = Sharding(tp=tp, sequence_parallel=sp, blocks=TRANSFORMER_ENGINE, saved_input_bytes=float(w))
    block = build_model(LLAMA, sharding).layers[1]
    expected = sum(n * width / (tp if split or sp else 1) for _, n, width, split in _engine_block_tensors(w))
    assert block.saved_bytes == math.floor(expected)


def test_in_bf16_the_engine_block_differs_from_the_eager_one_by_the_fused_swiglu():
    eager = build_model(LLAMA).layers[1]
    engine = build_model(LLAMA, Sharding(blocks=TRANSFORMER_ENGINE)).layers[1]
    # eager keeps gate, up, SiLU and product (8sf); bias-SwiGLU keeps fc1's output 4sf and fc2 its input 2sf
    assert eager.saved_bytes - engine.saved_bytes == 2 * S * F
    assert (engine.flops_fwd, engine.param_bytes, engine.activation_bytes) == (
        eager.flops_fwd, eager.param_bytes, eager.activation_bytes)


MOES = ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"]


@pytest.mark.parametrize("spec", MOES)
@pytest.mark.parametrize("sharding", [dict(), dict(tp=2, sequence_parallel=True), dict(ep=8),
                                      dict(selective_recompute=True, ep=4)])
def test_moe_engine_blocks_in_bf16_are_the_moe_family_count(spec, sharding):
    # the moe family already counts Megatron-Core's fused SwiGLU; only narrower inputs change it
    assert (build_model(spec, Sharding(blocks=TRANSFORMER_ENGINE, **sharding))
            == build_model(spec, Sharding(**sharding)))


def test_moe_engine_blocks_keep_each_linear_input_narrow():
    spec = ("moe:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,ffn=96,vocab=512,seq=32,experts=4,topk=2,"
            "expert_ffn=32,shared_experts=1,dense_layers=1")
    w = 1.0
    bf16 = build_model(spec).layers
    narrow = build_model(spec, Sharding(blocks=TRANSFORMER_ENGINE, saved_input_bytes=w)).layers
    norms = 2 * S * H  # the two norms' outputs
    o_copy = w * S * A * D  # the o projection's quantized input beside the attention's output
    dense = narrow[1].saved_bytes - bf16[1].saved_bytes
    assert dense == -(2 - w) * (norms + S * 96) + o_copy  # + the dense SwiGLU's fc2 input
    # a MoE layer: the routed tokens (S·k of them, balanced) enter fc1 and fc2 narrow, and the shared expert's fc2
    moe = narrow[2].saved_bytes - bf16[2].saved_bytes
    assert moe == -(2 - w) * (norms + S * 2 * (H + 32) + S * 32) + o_copy


def test_a_precisions_width_is_its_formats_value_and_scale_share():
    assert saved_input_bytes(None) == saved_input_bytes("bf16") == 2
    assert saved_input_bytes("fp8") == 1
    assert saved_input_bytes("mxfp8") == 1 + 1 / 32  # one E8M0 scale per 32 values
    assert saved_input_bytes("nvfp4") == 0.5 + 1 / 16  # one E4M3 scale per 16 values
    with pytest.raises(SpecError, match="torchao"):
        saved_input_bytes("fp8-rowwise")


def test_the_refused_combinations():
    with pytest.raises(ValueError, match="needs blocks 'transformer-engine'"):
        Sharding(saved_input_bytes=1.0)
    with pytest.raises(ValueError, match="eager, transformer-engine"):
        Sharding(blocks="apex")
    with pytest.raises(SpecError, match="llama and moe families only"):
        build_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512", Sharding(blocks=TRANSFORMER_ENGINE))
    with pytest.raises(SpecError, match="per-op policy"):
        build_model(LLAMA, Sharding(blocks=TRANSFORMER_ENGINE, selective_recompute=True))


def _peaks(**extra):
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs
    from sim.predict import predict_built

    inputs = PlanInputs(model="llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1536,vocab=4096,seq=2048",
                        topology="2xB200", pp=2, microbatches=4, **extra)
    built = build_plan(inputs)
    return built, [d["peak_memory_bytes"] for d in predict_built(built, check_memory=False).metrics["devices"]]


def test_a_plan_records_its_blocks_and_a_written_one_predicts_the_same():
    from sim.ir.plan import Plan
    from sim.predict import predict

    built, eager = _peaks(precision="mxfp8")
    assert built.plan.option("blocks") is None  # the default is not written: older plans stay byte-identical
    built, engine = _peaks(precision="mxfp8", blocks=TRANSFORMER_ENGINE)
    assert built.plan.option("blocks") == TRANSFORMER_ENGINE
    assert all(e < b for e, b in zip(engine, eager))  # narrower inputs, a fused SwiGLU: less kept on every stage
    again = predict(Plan.loads(built.plan.dumps()), check_memory=False)
    assert [d["peak_memory_bytes"] for d in again.metrics["devices"]] == engine


@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512", "--blocks", TRANSFORMER_ENGINE],
     "llama and moe families only"),
    (["--model", LLAMA, "--blocks", TRANSFORMER_ENGINE, "--precision", "fp8-rowwise"], "--precision fp8-rowwise"),
])
def test_sim_run_refuses_what_is_not_modelled_in_one_line(tmp_path, capsys, args, needle):
    from sim.run import main

    with pytest.raises(SystemExit) as info:
        main(["--topology", "1xH100", *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "out").exists()
