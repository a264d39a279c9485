"""The ``moe`` family and the mixture-of-experts configs it reads: parameter counts against the published totals
(exact where the Hub publishes the count, to the published digits for the active counts), FLOPs against the
parameters they multiply, tensor-parallel shards against the whole, and refusals."""

import json
from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.core.spec import SpecParams, parse_spec
from sim.models import build_model
from sim.models.hf_config import moe_values, preset_config
from sim.models.moe import (
    MoeShape,
    active_params,
    attention_params,
    block_flops_fwd,
    expert_params,
    is_moe_layer,
    is_windowed_layer,
    shape_of,
    total_params,
)
from sim.models.recompute_modules import RECOMPUTE_MODULES
from sim.models.sharding import Sharding

#: Exact totals: the safetensors parameter count the HuggingFace Hub shows for each model (DeepSeek-V3's main model
#: without its multi-token-prediction module, as DeepSeek's README_WEIGHTS.md counts the 671 B).
EXACT_TOTALS = {
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
    "gpt-oss-120b": 116_829_156_672,
    "deepseek-v3,mtp=0": 671_026_419_200,
}

#: Published counts, billions, to the digits published: Mistral's announcement (46.7 B total, 12.9 B per token);
#: Qwen3's model cards (30.5 B / 3.3 B activated; 235 B / 22 B); OpenAI's gpt-oss model card (116.83 B total,
#: 5.13 B active, the token table not counted); DeepSeek-V3's README_WEIGHTS.md (671 B; 36.6 B activated, the output
#: head counted and the token table not).
PUBLISHED = {  # name: (total, active, digits, the token table counted as active)
    "mixtral-8x7b": (46.7, 12.9, 1, True),
    "qwen3-30b-a3b": (30.5, 3.3, 1, True),
    "qwen3-235b-a22b": (235, 22, 0, True),
    "gpt-oss-120b": (116.83, 5.13, 2, False),
    "deepseek-v3,mtp=0": (671, 36.6, 1, False),
}


def _shape(name: str) -> MoeShape:
    spec = build_model(name).spec
    family, raw = parse_spec(spec)
    assert family == "moe"
    return shape_of(SpecParams(spec, raw))[0]


@pytest.mark.parametrize("name", sorted(EXACT_TOTALS))
def test_preset_totals_equal_the_hub_counts_exactly(name):
    assert build_model(name).total_params == EXACT_TOTALS[name] == total_params(_shape(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_counts_agree_with_the_published_figures_to_their_last_digit(name):
    # Within one unit of the last published digit: the cards round (Qwen3-235B's 233.85 B without embeddings is
    # "234B") or cut (Qwen3-30B-A3B's 3.353 B active is "3.3B"), so either reading of a figure must hold.
    total, active, digits, table = PUBLISHED[name]
    shape = _shape(name)
    unit = 10.0 ** -digits
    assert abs(total_params(shape) / 1e9 - total) < unit
    assert abs(active_params(shape, count_embedding=table) / 1e9 - active) < unit


def test_active_parameters_leave_out_exactly_the_unvisited_experts():
    shape = _shape("mixtral-8x7b")
    # Mixtral: 32 layers, 8 experts of 3·4096·14336, 2 visited
    assert total_params(shape) - active_params(shape) == 32 * 6 * 3 * 4096 * 14336
    gpt_oss = _shape("gpt-oss-120b")
    assert active_params(gpt_oss) - active_params(gpt_oss, count_embedding=False) == 201088 * 2880


def test_configs_read_what_each_architecture_adds():
    deepseek = _shape("deepseek-v3")
    assert (deepseek.kv_lora, deepseek.q_lora, deepseek.rope_dim, deepseek.v_dim, deepseek.head_dim) == (
        512, 1536, 64, 128, 128)
    assert (deepseek.dense_layers, deepseek.shared_experts, deepseek.sigmoid, deepseek.router_bias) == (
        3, 1, True, True)
    assert not is_moe_layer(deepseek, 2) and is_moe_layer(deepseek, 3)
    gpt_oss = _shape("gpt-oss-120b")
    assert (gpt_oss.window, gpt_oss.window_period, gpt_oss.sinks, gpt_oss.expert_bias, gpt_oss.swiglu_clamp) == (
        128, 2, True, True, 7)
    assert [is_windowed_layer(gpt_oss, i) for i in range(4)] == [True, False, True, False]
    layer_types = preset_config("gpt-oss-120b")["layer_types"]
    assert all(is_windowed_layer(gpt_oss, i) == (kind == "sliding_attention") for i, kind in enumerate(layer_types))
    qwen = _shape("qwen3-30b-a3b")
    assert qwen.qk_norm and (qwen.experts, qwen.topk, qwen.expert_ffn) == (128, 8, 768)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_block_flops_are_twice_the_weights_a_token_multiplies_plus_the_attention(name):
    shape = replace(_shape(name), seq=4096)
    h, s, a = shape.hidden, shape.seq, shape.heads
    for index in (0, shape.layers - 1):
        # the block's parameters a token uses, less what is not a GEMM weight (norms, biases, sinks)
        weights = attention_params(shape) - h  # the input RMSNorm
        if shape.latent:
            weights -= shape.q_lora + shape.kv_lora  # the latents' RMSNorms
        else:
            weights -= (a * shape.head_dim + 2 * shape.kv_heads * shape.head_dim) * shape.qkv_bias
            weights -= h * shape.o_bias + 2 * shape.head_dim * shape.qk_norm + a * shape.sinks
        if is_moe_layer(shape, index):
            per_expert = expert_params(shape) // shape.experts - shape.expert_bias * (2 * shape.expert_ffn + h)
            weights += h * shape.experts + shape.topk * per_expert + 3 * h * shape.shared_ffn
        else:
            weights += 3 * h * shape.ffn
        keys = min(s, shape.window) if is_windowed_layer(shape, index) else s
        attention = 2 * s * keys * a * (shape.qk_dim + shape.value_dim)
        assert block_flops_fwd(shape, index) == 2 * s * weights + attention


@pytest.mark.parametrize("name, tp", [("qwen3-30b-a3b", 4), ("deepseek-v3", 8), ("gpt-oss-120b", 8),
                                      ("mixtral-8x7b", 2)])
def test_a_tensor_parallel_shard_splits_what_megatron_splits(name, tp):
    whole = build_model(name + ",seq=4096")
    shard = build_model(name + ",seq=4096", Sharding(tp=tp, sequence_parallel=True))
    shape = _shape(name)
    for i, (one, part) in enumerate(zip(whole.layers[1:-1], shard.layers[1:-1], strict=True)):
        assert part.flops_fwd == one.flops_fwd // tp
        # what the shard replicates, and the routed experts (split by expert parallelism instead), stay whole
        split_whole = one.param_bytes - part.param_bytes
        assert split_whole % (tp - 1) == 0
        if is_moe_layer(shape, i):
            assert part.param_bytes > 2 * expert_params(shape)
        assert part.tp_comm_fwd_count == (2 if not is_moe_layer(shape, i) or shape.shared_experts else 1)


@pytest.mark.parametrize("spec, sharding, message", [
    ("moe:kv_lora=512,head_dim=128", Sharding(), "needs head_dim .*, rope_dim and v_dim"),
    ("moe:q_lora=64", Sharding(), "belong to latent attention"),
    ("moe:topk=9,experts=8", Sharding(), r"topk \(9\) must be at most experts \(8\)"),
    ("moe:kv_lora=512,rope_dim=64,v_dim=128,qk_norm=0,sinks=1", Sharding(),
     "sinks is modelled for grouped-query attention"),
    ("moe", Sharding(tp=2), "needs sequence parallelism"),
    ("moe", Sharding(tp=3, sequence_parallel=True), "tp=3 must divide heads=32"),
    ("moe:mtp=2", Sharding(), "mtp must be 0 or 1"),
    ("moe:window=128", Sharding(cp=2), "no sliding window"),
    ("moe:sigmoid=2", Sharding(), "sigmoid must be 0 or 1"),
])
def test_refusals_name_what_is_wrong(spec, sharding, message):
    with pytest.raises(SpecError, match=message):
        build_model(spec, sharding)


QWEN3_MOE = preset_config("qwen3-30b-a3b")


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step must be 1"),
    ({"mlp_only_layers": [1, 3]}, "mlp_only_layers must be the first layers"),
    ({"use_sliding_window": True}, "use_sliding_window: true is not read"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "is not a mixture of experts"),
])
def test_moe_configs_the_family_cannot_express_are_refused_by_field(change, message):
    with pytest.raises(SpecError, match=message):
        moe_values({**QWEN3_MOE, **change}, "test")


def test_first_dense_layers_and_gpt_oss_patterns_are_read(tmp_path):
    values = moe_values({**QWEN3_MOE, "mlp_only_layers": [0, 1]}, "test")
    assert values["dense_layers"] == 2 and values["ffn"] == 6144
    gpt_oss = preset_config("gpt-oss-120b")
    flipped = {**gpt_oss, "layer_types": list(reversed(gpt_oss["layer_types"]))}
    with pytest.raises(SpecError, match="alternate sliding and full from the first layer"):
        moe_values(flipped, "test")
    full = {**gpt_oss, "layer_types": ["full_attention"] * 36}
    assert moe_values(full, "test")["window"] == 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt_oss))
    assert build_model(f"hf:{path},seq=2048").spec == build_model("gpt-oss-120b,seq=2048").spec


def test_a_config_spec_is_a_plain_moe_spec_that_rebuilds_the_same_graph():
    graph = build_model("deepseek-v3,seq=4096")
    assert graph.spec.startswith("moe:") and build_model(graph.spec) == graph


# --- selective recomputation (Megatron-Core's layernorm, moe_act and mla_up_proj recompute modules) ---------------

#: A small mixture: s = 32 tokens, h = 64, a = 4 query heads and g = 2 key/value heads of d = 16, E = 4 experts of
#: f_e = 32, k = 2, no QK-norm, no shared expert.
SMALL = ("moe:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,ffn=96,vocab=100,seq=32,experts=4,topk=2,expert_ffn=32,"
         "qk_norm=0")
#: The same sizes with latent attention: q_lora 24, kv_lora 16, rope 8, v 12.
SMALL_MLA = ("moe:layers=2,hidden=64,heads=4,head_dim=16,ffn=96,vocab=100,seq=32,experts=4,topk=2,expert_ffn=32,"
             "qk_norm=0,q_lora=24,kv_lora=16,rope_dim=8,v_dim=12")


def test_selective_recomputation_keeps_a_mixture_blocks_tensors_by_hand():
    s, h, a, g, d, e, k, f = 32, 64, 4, 2, 16, 4, 2, 32
    # Kept without recomputation (bf16 2 bytes, fp32 4, int64 8): output, two norms' outputs, residual 2·4sh and the
    # norms' statistics 4·2s; q 2s·a·d, k and v 2·2s·g·d, the attention output 2s·a·d, its log-sum-exp 4s·a; the
    # router's scores 4sE and indices 8sk; the s·k routed tokens' input h, fc1 output 2f and activation f; the
    # experts' outputs back at their tokens 2ksh.
    attention = 2 * s * a * d + 2 * 2 * s * g * d + 2 * s * a * d + 4 * s * a
    mixture = 4 * s * e + 8 * s * k + 2 * s * k * (h + 3 * f) + 2 * k * s * h
    none = 2 * 4 * s * h + 4 * 2 * s + attention + mixture
    # Selective: the norms' outputs and statistics (2·2sh + 4·2s) and the activation (2·s·k·f) are recomputed.
    selective = 2 * 2 * s * h + attention + mixture - 2 * s * k * f
    plain = build_model(SMALL)
    chosen = build_model(SMALL, Sharding(selective_recompute=True))
    assert [layer.saved_bytes for layer in plain.layers[1:3]] == [none, none]
    assert [layer.saved_bytes for layer in chosen.layers[1:3]] == [selective, selective]
    # Grouped-query attention: only elementwise work is re-run, no FLOPs; the forward and backward are unchanged.
    assert all(layer.recompute_flops == 0 for layer in chosen.layers)
    assert [lay.flops_bwd for lay in chosen.layers] == [lay.flops_bwd for lay in plain.layers]
    assert chosen.layers[1].transformer.recomputed == RECOMPUTE_MODULES and not plain.layers[1].transformer.recomputed


def test_selective_recomputation_under_latent_attention_re_runs_the_up_projections():
    s, h, a, d, r, v, ql, kl, k, f = 32, 64, 4, 16, 8, 12, 24, 16, 2, 32
    plain = build_model(SMALL_MLA)
    chosen = build_model(SMALL_MLA, Sharding(selective_recompute=True))
    # mla_up_proj drops q (a·(d + r)) and the assembled k and v (a·(d + r) + a·v), bf16, on top of the norms and the
    # experts' activation.
    dropped = 2 * 2 * s * h + 4 * 2 * s + 2 * s * a * (d + r) + 2 * s * a * (d + r + v) + 2 * s * k * f
    assert plain.layers[1].saved_bytes - chosen.layers[1].saved_bytes == dropped
    # the two up-projections re-run: 2s·(q_lora·a·(d + r) + kv_lora·a·(d + v))
    assert chosen.layers[1].recompute_flops == 2 * s * (ql * a * (d + r) + kl * a * (d + v))
    # under tensor parallelism by heads the shard re-runs its half
    half = build_model(SMALL_MLA, Sharding(tp=2, sequence_parallel=True, selective_recompute=True))
    assert half.layers[1].recompute_flops == chosen.layers[1].recompute_flops / 2


@pytest.mark.parametrize("modules", [("layernorm",), ("moe_act",), ("mla_up_proj",), ("layernorm", "mla_up_proj"),
                                     ("moe_act", "mla_up_proj")])
def test_each_recomputed_module_drops_its_own_tensors_and_nothing_else(modules):
    s, h, a, d, r, v, k, f = 32, 64, 4, 16, 8, 12, 2, 32
    each = {"layernorm": 2 * 2 * s * h + 4 * 2 * s,  # the two norms' bf16 outputs and fp32 statistics
            "moe_act": 2 * s * k * f,  # the routed experts' SwiGLU output (bf16, k copies of each token)
            "mla_up_proj": 2 * s * a * (d + r) + 2 * s * a * (d + r + v)}  # q, and the assembled k and v
    plain = build_model(SMALL_MLA)
    chosen = build_model(SMALL_MLA, Sharding(selective_recompute=True, recompute_modules=modules))
    assert plain.layers[1].saved_bytes - chosen.layers[1].saved_bytes == sum(each[m] for m in modules)
    assert chosen.layers[1].transformer.recomputed == modules
    assert (chosen.layers[1].recompute_flops > 0) is ("mla_up_proj" in modules)  # only the up-projections are GEMMs


def test_recompute_modules_are_checked():
    with pytest.raises(ValueError, match="needs selective_recompute"):
        Sharding(recompute_modules=("mla_up_proj",))
    with pytest.raises(ValueError, match="'core_attn' is not modelled; choose from layernorm, moe_act, mla_up_proj"):
        Sharding(selective_recompute=True, recompute_modules=("core_attn",))
    with pytest.raises(ValueError, match="in the order"):
        Sharding(selective_recompute=True, recompute_modules=("mla_up_proj", "layernorm"))
    with pytest.raises(ValueError, match="non-empty"):
        Sharding(selective_recompute=True, recompute_modules=())


# --- multi-token prediction (DeepSeek-V3 §2.2, depth 1) -----------------------------------------------------------

def test_the_mtp_module_of_deepseek_v3_counted_by_hand_from_its_config():
    c = preset_config("deepseek-v3")
    assert c["num_nextn_predict_layers"] == 1
    h, a, v = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * a * qk  # query down, norm, up
                 + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]  # key/value down, norm
                 + c["kv_lora_rank"] * a * (c["qk_nope_head_dim"] + c["v_head_dim"])  # key/value up
                 + a * c["v_head_dim"] * h + h)  # output projection, input norm
    ffn = (h + h * c["n_routed_experts"] + c["n_routed_experts"]  # norm, router and its score-correction bias
           + (c["n_routed_experts"] + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"])
    module = attention + ffn + 2 * h + 2 * h * h + h  # enorm, hnorm, eh_proj (2h → h), shared_head.norm
    with_mtp, main = build_model("deepseek-v3"), build_model("deepseek-v3,mtp=0")
    assert with_mtp.total_params - main.total_params == module
    assert main.total_params == 671_026_419_200  # the main model, as before
    # DeepSeek's README_WEIGHTS.md: 685 B on HuggingFace = 671 B main model + 14 B MTP module, whose stored weights
    # hold their own copies of the token table and the output head (V·h each).
    stored = module + 2 * v * h
    assert abs(stored / 1e9 - 14) < 0.6 and abs((main.total_params + stored) / 1e9 - 685) < 0.6


def test_the_mtp_module_is_one_more_block_and_a_second_scoring_by_the_shared_head():
    spec = SMALL + ",mtp=1"
    s, h, v = 32, 64, 100
    plain, graph = build_model(SMALL), build_model(spec)
    assert [layer.name for layer in graph.layers] == ["embed", "block0", "block1", "mtp", "head"]
    mtp, block = graph.layers[3], plain.layers[2]
    assert mtp.flops_fwd == block.flops_fwd + 2 * s * 2 * h * h  # the block and the 2h → h projection
    assert mtp.flops_bwd == 2 * mtp.flops_fwd
    assert mtp.param_bytes == block.param_bytes + 2 * (2 * h + 2 * h * h + h)
    assert mtp.activation_bytes == 2 * block.activation_bytes  # the main hidden state passes on beside its own
    assert graph.layers[-1].flops_fwd == 2 * plain.layers[-1].flops_fwd == 2 * 2 * s * h * v
    assert graph.layers[-1].param_bytes == plain.layers[-1].param_bytes  # the output head is shared
    assert graph.spec.endswith("mtp=1,o_bias=0,q_lora=0,qk_norm=0,qkv_bias=0,rope_dim=0,router_bias=0,seq=32,"
                               "shared_experts=0,sigmoid=0,sinks=0,swiglu_clamp=0,tied=0,topk=2,v_dim=0,vocab=100,"
                               "window=0,window_period=1") and "mtp" not in plain.spec
    assert build_model(graph.spec) == graph


def test_a_preset_takes_mtp_only_for_a_mixture():
    assert "mtp=1" in build_model("deepseek-v3,seq=4096").spec  # the config's num_nextn_predict_layers: 1
    assert "mtp" not in build_model("deepseek-v3,mtp=0,seq=4096").spec
    assert "mtp=1" in build_model("qwen3-30b-a3b,mtp=1").spec and "mtp" not in build_model("qwen3-30b-a3b").spec
    with pytest.raises(SpecError, match="a model config takes seq= only, got 'mtp=1'"):
        build_model("llama3.1-8b,mtp=1")
