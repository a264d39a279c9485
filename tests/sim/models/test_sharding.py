"""The gpt model per tensor-parallel shard: Korthikanti et al. Table 2 memory, Megatron parameter splits, FLOPs,
collectives, and the unsharded graph left unchanged (sim/models/sharding.py, sim/models/gpt.py)."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.models import MODELS, NO_SHARDING, Sharding, build_model
from sim.models.graph import Layer
from sim.models.sharding import padded_vocab


def gpt(s: int, h: int, a: int, v: int = 1000, layers: int = 2) -> str:
    return f"gpt:layers={layers},hidden={h},heads={a},seq={s},vocab={v}"


def fields(layer: Layer) -> tuple:
    return dataclasses.astuple(layer)


# --- Korthikanti et al. 2022 (arXiv 2205.05198) Table 2: activation bytes per transformer layer, b = 1 ----------
# Written from the paper, in its own terms (s, h, a, t); the paper counts a layer's input, which our convention
# moves to the producer, so the test compares saved - own output + received input.

def table2(row: str, s: int, h: int, a: int, t: int) -> Fraction:
    sh, attn = Fraction(s * h), Fraction(5 * a * s, h * t)
    return {
        "no parallelism": sh * (34 + Fraction(5 * a * s, h)),
        "tensor parallel": sh * (10 + Fraction(24, t) + attn),
        "tensor + sequence parallel": sh * (Fraction(34, t) + attn),
        "tensor parallel + selective recompute": sh * (10 + Fraction(24, t)),
        "tensor + sequence parallel + selective recompute": sh * Fraction(34, t),
    }[row]


ROWS = {
    "no parallelism": lambda t: Sharding(),
    "tensor parallel": lambda t: Sharding(tp=t),
    "tensor + sequence parallel": lambda t: Sharding(tp=t, sequence_parallel=True),
    "tensor parallel + selective recompute": lambda t: Sharding(tp=t, selective_recompute=True),
    "tensor + sequence parallel + selective recompute": lambda t: Sharding(
        tp=t, sequence_parallel=True, selective_recompute=True),
}


def paper_layer_bytes(spec: str, sharding: Sharding) -> list[int]:
    graph = build_model(spec, sharding)
    return [graph[i].saved_bytes - graph[i].activation_bytes + graph[i - 1].activation_bytes
            for i in range(1, len(graph) - 1)]


@pytest.mark.parametrize("row", sorted(ROWS))
@pytest.mark.parametrize(("s", "h", "a", "t"), [(2048, 12288, 96, 8), (1024, 1024, 16, 4), (64, 48, 6, 2),
                                                (12, 6, 3, 3)])
def test_block_memory_is_korthikanti_table2(row, s, h, a, t):
    expected = table2(row, s, h, a, t if row != "no parallelism" else 1)
    assert expected.denominator == 1
    assert paper_layer_bytes(gpt(s, h, a, layers=3), ROWS[row](t)) == [int(expected)] * 3


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 8), heads_per_shard=st.integers(1, 4), head_dim=st.integers(1, 16),
       seq_per_shard=st.integers(1, 40), row=st.sampled_from(sorted(ROWS)))
def test_block_memory_is_table2_for_any_divisible_shape(t, heads_per_shard, head_dim, seq_per_shard, row):
    a, s = t * heads_per_shard, t * seq_per_shard
    h = a * head_dim
    tt = t if row != "no parallelism" else 1
    assert paper_layer_bytes(gpt(s, h, a, layers=1), ROWS[row](t)) == [table2(row, s, h, a, tt)]


def test_selective_recompute_drops_exactly_the_attention_core_and_recomputes_its_matmuls():
    s, h, a, t = 256, 128, 8, 4
    kept, recomputed = (build_model(gpt(s, h, a), Sharding(tp=t, selective_recompute=r))[1] for r in (False, True))
    # §5: softmax output 2as^2, its dropout mask as^2 and the dropout output 2as^2, split by heads over t.
    assert kept.saved_bytes - recomputed.saved_bytes == 5 * a * s * s // t
    assert recomputed.workspace_bytes == 5 * a * s * s // t and kept.workspace_bytes == 0
    # The re-run matmuls: QK^T (2s^2h) and attention over V (2s^2h), per shard.
    assert recomputed.recompute_flops == 4 * s * s * h / t and kept.recompute_flops == 0
    assert recomputed.flops_bwd == kept.flops_bwd  # the recompute is its own field, not folded into flops_bwd


# --- parameters, Megatron-LM (arXiv 1909.08053) §3 ----------------------------------------------------------------

@pytest.mark.parametrize(("h", "a", "t"), [(1024, 16, 2), (1024, 16, 8), (48, 6, 3), (12288, 96, 8)])
def test_block_shard_parameters_recombine_to_the_whole_block(h, a, t):
    shard = build_model(gpt(64, h, a), Sharding(tp=t)).param_count(1)
    # Replicated on every shard: the two row-parallel Linears' biases and both LayerNorms (weight + bias).
    replicated = h + h + 2 * h + 2 * h
    # Split: QKV weight + bias, attention-output weight, MLP-up weight + bias, MLP-down weight.
    assert shard == (3 * h * h + 3 * h) // t + h * h // t + (4 * h * h + 4 * h) // t + 4 * h * h // t + replicated
    assert shard * t - replicated * (t - 1) == 12 * h * h + 13 * h


@pytest.mark.parametrize(("v", "t", "rows"), [(1000, 4, 250), (50257, 2, 25129), (50257, 8, 6283), (7, 1, 7)])
def test_embed_and_head_shards_are_vocabulary_parallel(v, t, rows):
    s, h = 32, 16
    graph = build_model(gpt(s, h, 8, v=v), Sharding(tp=t))
    assert padded_vocab(v, t) == rows * t
    assert graph.param_count(0) == rows * h + s * h  # token-table rows of this shard + replicated positions
    assert graph.param_count(len(graph) - 1) == 2 * h + rows * h  # replicated final LN + LM-head columns
    whole = build_model(gpt(s, h, 8, v=v))
    if v % t == 0:
        assert graph.param_count(0) * t - s * h * (t - 1) == whole.param_count(0)
        assert graph.param_count(len(graph) - 1) * t - 2 * h * (t - 1) == whole.param_count(len(whole) - 1)


@settings(max_examples=60, deadline=None)
@given(v=st.integers(1, 10**6), t=st.integers(1, 64))
def test_padded_vocab_is_the_least_multiple_of_t_not_below_v(v, t):
    p = padded_vocab(v, t)
    assert p % t == 0 and v <= p < v + t


# --- FLOPs ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sharding", [Sharding(tp=2), Sharding(tp=4, sequence_parallel=True),
                                      Sharding(tp=8, selective_recompute=True)])
def test_flops_split_evenly(sharding):
    s, h, a, v, t = 128, 256, 8, 4096, sharding.tp
    whole, shard = build_model(gpt(s, h, a, v=v)), build_model(gpt(s, h, a, v=v), sharding)
    for full, part in zip(whole, shard):
        assert part.flops_fwd * t == full.flops_fwd and part.flops_bwd * t == full.flops_bwd
    assert shard[1].flops_fwd == (24 * s * h * h + 4 * s * s * h) / t  # Narayanan et al. 2021 Appendix


def test_head_flops_and_memory_use_the_padded_vocabulary_shard():
    s, h, v, t = 16, 8, 101, 4
    rows = math.ceil(v / t)
    head = build_model(gpt(s, h, 4, v=v), Sharding(tp=t))[-1]
    assert (head.flops_fwd, head.flops_bwd) == (2 * s * h * rows, 4 * s * h * rows)
    assert head.saved_bytes == 2 * s * h + 4 * s * rows  # LM-head input (fp16) + fp32 logits
    assert head.workspace_bytes == 2 * s * rows
    sp = build_model(gpt(s, h, 4, v=v), Sharding(tp=t, sequence_parallel=True))[-1]
    assert sp.saved_bytes == 2 * s * h // t + 4 * s * rows  # the input is kept s/t long (§4.3)


# --- activations between layers ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("sp", "long"), [(False, 1), (True, 4)])
def test_boundaries_carry_the_whole_tensor_or_its_sequence_shard(sp, long):
    s, h, t = 64, 32, 4
    graph = build_model(gpt(s, h, 4, layers=3), Sharding(tp=t, sequence_parallel=sp))
    assert [graph.boundary_bytes(c) for c in range(1, len(graph))] == [2 * s * h // long] * (len(graph) - 1)
    assert graph[0].saved_bytes == (2 * s * h + s * h) // long  # embedding output + its dropout mask
    assert graph.input_bytes == 8 * s  # every shard reads all token ids


# --- collectives --------------------------------------------------------------------------------------------------

def comm(layer: Layer) -> tuple[int, int, int, int]:
    return layer.tp_comm_fwd_bytes, layer.tp_comm_fwd_count, layer.tp_comm_bwd_bytes, layer.tp_comm_bwd_count


def test_megatron_collectives_without_sequence_parallelism():
    s, h = 64, 32
    graph = build_model(gpt(s, h, 4), Sharding(tp=4))
    x = 2 * s * h  # one fp16 s x h tensor
    assert comm(graph[0]) == (x, 1, 0, 0)  # VocabParallelEmbedding: all-reduce forward, identity backward
    assert comm(graph[1]) == comm(graph[2]) == (2 * x, 2, 2 * x, 2)  # Megatron §3: f and g, twice per block
    assert comm(graph[-1]) == (3 * 4 * s, 3, x, 1)  # cross entropy: max, target logit, sum-exp (fp32); input grad


def test_sequence_parallel_collectives_are_all_reduce_equivalents():
    s, h = 64, 32
    graph = build_model(gpt(s, h, 4), Sharding(tp=4, sequence_parallel=True))
    x = 2 * s * h
    # A lone all-gather or reduce-scatter of an x-byte tensor is half a ring all-reduce of it.
    assert comm(graph[0]) == (x, 1, x // 2, 1)  # all-reduce then local split; backward all-gathers
    assert comm(graph[1]) == (2 * x, 2, 2 * x, 2)  # §4.2.2: same volume as tensor parallelism alone
    assert comm(graph[-1]) == (3 * 4 * s + x // 2, 4, x // 2, 1)  # gather the LM-head input; scatter its gradient


@pytest.mark.parametrize("spec", ["gpt", "cnn", "uniform", "supernet"])
def test_no_collectives_or_recompute_without_sharding(spec):
    for layer in build_model(spec, Sharding(sequence_parallel=True)):
        assert comm(layer) == (0, 0, 0, 0) and layer.recompute_flops == 0


# --- the unsharded graph is unchanged ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [*sorted(MODELS), gpt(7, 12, 3, v=11), gpt(1024, 1024, 16, v=50257)])
@pytest.mark.parametrize("sharding", [NO_SHARDING, Sharding(tp=1, sequence_parallel=True)])
def test_default_sharding_builds_the_same_graph_field_by_field(spec, sharding):
    plain, sharded = build_model(spec), build_model(spec, sharding)
    assert [fields(a) for a in plain] == [fields(b) for b in sharded]
    assert (plain.spec, plain.dtype_bytes, plain.input_bytes, plain.edge_bytes()) == (
        sharded.spec, sharded.dtype_bytes, sharded.input_bytes, sharded.edge_bytes())


def test_spec_stays_canonical_under_sharding():
    spec = "gpt:layers=2,hidden=64,heads=4,seq=32"
    assert build_model(spec, Sharding(tp=4, sequence_parallel=True)).spec == build_model(spec).spec


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kw", "shown"), [({"tp": 0}, "got 0"), ({"tp": -2}, "got -2"), ({"tp": True}, "True"),
                                           ({"tp": 2.0}, "2.0"), ({"sequence_parallel": 1}, "got 1"),
                                           ({"selective_recompute": "yes"}, "'yes'")])
def test_bad_sharding_is_rejected(kw, shown):
    with pytest.raises(ValueError, match=shown):
        Sharding(**kw)


@pytest.mark.parametrize(
    ("spec", "sharding", "shown"),
    [
        ("cnn", Sharding(tp=2), "tensor parallelism is modelled for gpt, llama and moe only, got 'cnn'"),
        ("uniform:layers=2", Sharding(selective_recompute=True),
         "selective recomputation is modelled for gpt, llama and moe only"),
        ("supernet", Sharding(tp=2, sequence_parallel=True), "gpt, llama and moe only, got 'supernet'"),
        (gpt(64, 48, 6), Sharding(tp=4), "tp=4 must divide heads=6"),
        (gpt(30, 64, 8), Sharding(tp=4, sequence_parallel=True), "tp=4 must divide seq=30"),
    ],
)
def test_bad_combinations_raise_spec_error_naming_the_values(spec, sharding, shown):
    with pytest.raises(SpecError, match=shown):
        build_model(spec, sharding)


def test_sequence_not_divisible_is_fine_without_sequence_parallelism():
    assert build_model(gpt(30, 64, 8), Sharding(tp=4))[1].activation_bytes == 2 * 30 * 64


@pytest.mark.parametrize(("attr", "value"), [
    *((attr, value) for attr in ("tp_comm_fwd_bytes", "tp_comm_bwd_bytes", "tp_comm_fwd_count", "tp_comm_bwd_count")
      for value in (-1, 1.5, True)),
    ("recompute_flops", -1.0), ("recompute_flops", math.nan), ("recompute_flops", math.inf),
])
def test_layer_rejects_bad_sharding_fields(attr, value):
    with pytest.raises(ValueError, match=f"{attr} must be .* got {value!r}"):
        Layer(name="x", kind="k", flops_fwd=0.0, flops_bwd=0.0, param_bytes=0, activation_bytes=0,
              saved_bytes=0, **{attr: value})
