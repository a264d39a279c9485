"""The Llama-family kernel inventory (``sim.cost.kernels.llama``) against the model's FLOPs (themselves held to torch's
FLOP counter), FlashAttention's causal tiles counted by brute force, and the kernel model wired to the family."""

import math

import pytest

from sim.cost.kernels.attention import FLASH_QUERY_TILE
from sim.cost.kernels.llama import (
    LlamaBlockShape,
    attention_fraction,
    llama_block_kernels,
    llama_embedding_kernels,
    llama_head_kernels,
)
from sim.models import Sharding, build_model
from sim.models.llama import DecoderShape, block_flops_fwd
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


@pytest.mark.parametrize("s, window", [(128, 0), (1000, 0), (8192, 0), (4096, 1000), (300, 4096)])
def test_attention_fraction_counts_the_causal_tiles(s, window):
    tiles = math.ceil(s / FLASH_QUERY_TILE)
    reach = tiles if not window else math.ceil(window / FLASH_QUERY_TILE) + 1
    # Brute force: the (query tile, key tile) pairs on or below the diagonal and within the window's reach.
    computed = sum(1 for q in range(tiles) for k in range(tiles) if k <= q and q - k < reach)
    assert attention_fraction(s, window) == computed / tiles ** 2
    if not window:
        assert attention_fraction(s) == (tiles + 1) / (2 * tiles)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("qk_norm, qkv_bias", [(False, False), (True, True)])
def test_block_kernels_do_the_models_flops(t, qk_norm, qkv_bias):
    # Oracle: the model's block FLOPs (tests/sim/models/test_llama.py holds them to torch's FlopCounterMode): the
    # GEMMs' FLOPs plus the attention's, the attention scaled by the tiles a causal kernel computes. The backward:
    # twice the forward's GEMMs, and FlashAttention's 5 recomputing matmuls against 2.
    b, s, h, a, g, d, f = 2, 1024, 512, 8, 2, 64, 1408
    shape = LlamaBlockShape(b, s, h, a, g, d, f, t, qk_norm=qk_norm, qkv_bias=qkv_bias)
    model = b * block_flops_fwd(DecoderShape(1, h, a, g, d, f, 100, s)) / t
    attention = 4 * b * a * s * s * d / t
    fraction = attention_fraction(s)
    forward = llama_block_kernels(shape, backward=False)
    backward = llama_block_kernels(shape, backward=True)
    gemms = sum(k.flops for k in forward if k.kind == "gemm")
    assert gemms == pytest.approx(model - attention, rel=1e-12)
    assert sum(k.flops for k in forward if k.kind == "attention") == pytest.approx(attention * fraction, rel=1e-12)
    assert sum(k.flops for k in backward if k.kind == "gemm") == pytest.approx(2 * gemms, rel=1e-12)
    assert sum(k.flops for k in backward if k.kind == "attention") == pytest.approx(2.5 * attention * fraction,
                                                                                    rel=1e-12)
    names = [k.name for k in forward]
    assert any(name.startswith("q_norm") for name in names) is qk_norm
    assert names.index("flash_attention") < names.index("wo")


def test_the_ends_have_no_position_table_and_an_rms_norm():
    forward = [k.name for k in llama_embedding_kernels(1, 16, 32, 100, 1, backward=False)]
    assert forward == ["token_embedding_lookup"]
    head = [k.name for k in llama_head_kernels(1, 16, 32, 100, 1, backward=False)]
    assert head[0].startswith("final_norm") and "logits" in head
    assert [k.name for k in llama_head_kernels(1, 16, 32, 100, 1, backward=True)][-1].startswith("final_norm")


def test_gpu_plans_of_the_family_are_costed_by_the_kernel_model():
    from sim.cost.gpu_time import transformer_layer_seconds
    from sim.predict import describe_cost_source

    built = build_plan(PlanInputs("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1408,vocab=1000,seq=1024",
                                  "2xH100", "1f1b", microbatches=2))
    oracle = built.costs.oracle
    assert describe_cost_source(oracle, 2).startswith("GPU kernel model")
    graph = build_model(built.plan.model)
    assert all(layer.transformer is not None and layer.transformer.family == "llama" for layer in graph.layers)
    device = built.topology.devices[0]
    block = graph.layers[1]
    assert oracle.layer_costs(device).fwd[1] == transformer_layer_seconds(block.transformer, 1, device,
                                                                          oracle.kernel_model).fwd


def test_sequence_parallelism_splits_the_norms_and_the_residual_stream():
    # Oracle (Korthikanti et al. §4.2.2): under SP the norms and residual adds run on 1/t of the tokens, the GEMMs and
    # attention are unchanged, and what crosses a layer boundary (and a checkpointed input) is 1/t as large.
    b, s, h, a, g, d, f, t = 2, 1024, 512, 8, 4, 64, 1408, 4
    plain = LlamaBlockShape(b, s, h, a, g, d, f, t)
    split = LlamaBlockShape(b, s, h, a, g, d, f, t, sequence_parallel=True)
    for backward in (False, True):
        one = llama_block_kernels(plain, backward=backward, compiled=True)
        other = llama_block_kernels(split, backward=backward, compiled=True)
        assert [k for k in one if k.kind in ("gemm", "attention")] == [k for k in other if k.kind in ("gemm",
                                                                                                         "attention")]
        norms = {k.name: k.bytes for k in one if k.kind == "norm"}
        for kernel in other:
            if kernel.kind == "norm":
                assert kernel.bytes < norms[kernel.name] / 2
    spec = "llama:layers=2,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=1000,seq=1024"
    whole, sharded = build_model(spec, Sharding(tp=4)), build_model(spec, Sharding(tp=4, sequence_parallel=True))
    assert sharded.layers[1].activation_bytes * 4 == whole.layers[1].activation_bytes
    assert sharded.layers[1].saved_bytes < whole.layers[1].saved_bytes
    assert sharded.layers[1].flops_fwd == whole.layers[1].flops_fwd
