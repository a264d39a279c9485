"""The kernels of a mixture-of-experts block: their GEMM FLOPs against the model's (the weights a token multiplies),
the grouped GEMM's tile quantisation against per-product brute force, expert parallelism's invariants, and what a
skewed routing costs the slowest rank."""

import math

import pytest

from sim.cost.gpu_time import default_kernel_model, kernel_seconds, transformer_layer_seconds
from sim.cost.kernels.llama import LlamaBlockShape
from sim.cost.kernels.moe import MoeBlockShape, moe_block_kernels
from sim.cost.kernels.record import gemm, grouped_gemm
from sim.hw.catalog import get_device
from sim.models import build_model
from sim.models.routing import Routing
from sim.models.sharding import Sharding

H100 = get_device("H100")
MODEL = default_kernel_model()


def _attention_model_flops(part, seq):
    qk = part.head_dim + (part.mla.rope_dim if part.mla else 0)
    dv = part.mla.v_dim if part.mla else part.head_dim
    keys = min(seq, part.window) if part.window else seq
    return 2 * seq * keys * part.heads * (qk + dv)


def _kernels(part, b=1, backward=False):
    mla = part.mla
    qk = part.head_dim + mla.rope_dim if mla else part.head_dim
    attention = LlamaBlockShape(b, part.seq, part.hidden, part.heads, part.kv_heads, qk, part.ffn, part.tp,
                                qkv_bias=part.qkv_bias, qk_norm=part.qk_norm, window=part.window,
                                sequence_parallel=part.sequence_parallel, o_bias=part.o_bias,
                                value_dim=mla.v_dim if mla else 0)
    return moe_block_kernels(MoeBlockShape(attention, mla, part.moe, mtp=bool(part.mtp)), backward=backward,
                             compiled=True, recomputed=part.recomputed if backward else ())


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"])
def test_gemm_flops_are_the_model_flops_less_the_attention_core(name):
    graph = build_model(name + ",seq=4096")
    # DeepSeek-V3: a dense block, a MoE block and the multi-token-prediction module's (with its 2h → h projection)
    for layer in (graph.layers[1], graph.layers[-3], graph.layers[-2]):
        part = layer.transformer
        forward = sum(k.flops for k in _kernels(part) if k.kind == "gemm")
        assert forward == pytest.approx(layer.flops_fwd - _attention_model_flops(part, part.seq), rel=1e-12)
        backward = sum(k.flops for k in _kernels(part, backward=True) if k.kind == "gemm")
        assert backward == pytest.approx(2 * forward, rel=1e-12)


def test_a_grouped_gemm_cuts_each_product_into_its_own_tiles():
    tile = MODEL.gemm_tile
    rows = (tile + 1, 3, 0, 2 * tile)  # ragged experts, one without tokens
    grouped = grouped_gemm("g", rows, 4096, 2048, 2)
    assert grouped.flops == sum(2.0 * m * 4096 * 2048 for m in rows)
    # brute force: each product's own tiles, summed, then waves over the device; at least the fused GEMM's time
    assert kernel_seconds(grouped, H100, MODEL) >= kernel_seconds(gemm("one", sum(rows), 4096, 2048, 2), H100, MODEL)
    # equal products are a batched GEMM: the same tiles, FLOPs and bytes, so the same time
    for m in (tile, tile + 5, 3 * tile):
        even = grouped_gemm("even", (m,) * 8, 4096, 2048, 2)
        batched = gemm("batched", m, 4096, 2048, 2, batch=8)
        assert (even.flops, even.bytes) == (batched.flops, batched.bytes)
        assert kernel_seconds(even, H100, MODEL) == kernel_seconds(batched, H100, MODEL)


def test_expert_parallelism_splits_the_experts_not_a_balanced_device_s_work():
    whole = build_model("qwen3-30b-a3b,seq=4096")
    split = build_model("qwen3-30b-a3b,seq=4096", Sharding(ep=8))
    one, part = whole.layers[1], split.layers[1]
    experts = 128 * 3 * 2048 * 768 * 2  # bytes of the routed experts
    assert one.param_bytes - part.param_bytes == experts - experts // 8
    assert part.flops_fwd == one.flops_fwd
    kernels_one = _kernels(one.transformer)
    kernels_split = _kernels(part.transformer)
    fc1 = [k for k in kernels_split if k.name == "experts_fc1"][0]
    assert len(fc1.group) == 16 and sum(fc1.group) == 4096 * 8  # 16 local experts, the group's 8 x 4096 x k / 8
    gemm_flops = [sum(k.flops for k in kernels if k.kind == "gemm") for kernels in (kernels_one, kernels_split)]
    assert gemm_flops[0] == gemm_flops[1]


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5])
def test_a_skewed_routing_slows_the_slowest_expert_rank(exponent):
    base = Sharding(ep=8)
    skewed = Sharding(ep=8, routing=Routing("skew", exponent, seed=3))
    times = []
    for sharding in (base, skewed):
        layer = build_model("qwen3-30b-a3b,seq=4096", sharding).layers[1]
        seconds = transformer_layer_seconds(layer.transformer, 1, H100, MODEL, compiled=True)
        times.append(seconds.fwd + seconds.bwd)
        fc1 = [k for k in _kernels(layer.transformer) if k.name == "experts_fc1"][0]
        if sharding is skewed:
            assert sum(fc1.group) > 4096 * 8  # the hottest rank computes more than its balanced share
    assert times[1] > times[0]


def test_a_capacity_factor_drops_what_exceeds_it():
    skewed = Routing("skew", 1.2, seed=0)
    dropless = build_model("mixtral-8x7b,seq=4096", Sharding(routing=skewed)).layers[1].transformer.moe
    capped = build_model("mixtral-8x7b,seq=4096", Sharding(routing=skewed, capacity_factor=1.25)).layers[1]
    rows = capped.transformer.moe.expert_tokens(4096)
    assert max(rows) <= math.ceil(1.25 * 4096 * 2 / 8)
    assert sum(rows) < sum(dropless.expert_tokens(4096)) == 4096 * 2


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_selective_recomputation_re_runs_the_norms_the_experts_swiglu_and_mlas_up_projections(name):
    graph = build_model(name + ",seq=4096", Sharding(selective_recompute=True))
    plain = build_model(name + ",seq=4096")
    layer, reference = graph.layers[-3], plain.layers[-3]  # a MoE block
    backward, before = _kernels(layer.transformer, backward=True), _kernels(reference.transformer, backward=True)
    recomputed = [k for k in backward if k.name.startswith("recompute_")]
    assert backward[len(recomputed):] == before  # the backward starts with the recomputation, then is unchanged
    names = {k.name.removeprefix("recompute_") for k in recomputed}
    assert {"attention_norm", "ffn_norm"} <= names and any(n.startswith("experts_") for n in names)
    # the recomputed GEMMs are exactly the layer's recompute FLOPs (MLA's up-projections; none under GQA)
    assert sum(k.flops for k in recomputed if k.kind == "gemm") == pytest.approx(layer.recompute_flops, rel=1e-12)
    assert (layer.recompute_flops > 0) is (name == "deepseek-v3")
    selective = transformer_layer_seconds(layer.transformer, 1, H100, MODEL)
    full = transformer_layer_seconds(reference.transformer, 1, H100, MODEL)
    assert selective.fwd == full.fwd and selective.bwd > full.bwd


def test_recomputing_only_the_up_projections_re_runs_only_their_kernels():
    every = build_model("deepseek-v3,seq=4096", Sharding(selective_recompute=True)).layers[-3]
    ups = build_model("deepseek-v3,seq=4096", Sharding(selective_recompute=True,
                                                        recompute_modules=("mla_up_proj",))).layers[-3]
    names = {k.name for k in _kernels(ups.transformer, backward=True) if k.name.startswith("recompute_")}
    assert names and all(n.removeprefix("recompute_").startswith(("q_up", "kv_up", "mla_query_rope",
                                                                  "mla_key_assemble")) for n in names)
    all_names = {k.name for k in _kernels(every.transformer, backward=True) if k.name.startswith("recompute_")}
    assert names < all_names and ups.recompute_flops == every.recompute_flops  # the same GEMMs, fewer elementwise
    fewer = transformer_layer_seconds(ups.transformer, 1, H100, MODEL)
    assert fewer.bwd < transformer_layer_seconds(every.transformer, 1, H100, MODEL).bwd


def test_the_shared_head_scoring_the_mtp_prediction_costs_a_second_head_pass():
    with_mtp, main = build_model("deepseek-v3,seq=4096"), build_model("deepseek-v3,mtp=0,seq=4096")
    twice = transformer_layer_seconds(with_mtp.layers[-1].transformer, 1, H100, MODEL)
    once = transformer_layer_seconds(main.layers[-1].transformer, 1, H100, MODEL)
    # the head's kernels run twice in a row: twice the device time, less the host time the second pass hides
    for got, alone in ((twice.fwd, once.fwd), (twice.bwd, once.bwd)):
        assert 1.9 * alone < got <= 2 * alone * (1 + 1e-12)
