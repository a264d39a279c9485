"""The model zoo: exact parameter counts, FLOPs, bytes, canonical specs and spec errors (sim/models)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.models import MODELS, build_model, format_model_list
from sim.models.graph import canonical_spec

# --- independent closed forms: one function per torch module, summed per layer ---------------------------------


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def layernorm(h: int) -> int:
    return 2 * h  # weight and bias


def embedding(rows: int, h: int) -> int:
    return rows * h


def gpt_layer_params(layers: int, h: int, s: int, v: int) -> list[int]:
    block = layernorm(h) + linear(h, 3 * h) + linear(h, h) + layernorm(h) + linear(h, 4 * h) + linear(4 * h, h)
    embed = embedding(v, h) + embedding(s, h)
    head = layernorm(h) + linear(h, v, bias=False)
    return [embed] + [block] * layers + [head]


def gpt_block_flops(s: int, h: int) -> int:
    # Matmuls of one block per sample, 2 FLOPs per multiply-add (Narayanan et al. 2021, arXiv 2104.04473, App.).
    qkv = 2 * s * h * (3 * h)
    scores = 2 * s * s * h  # Q K^T over all heads
    context = 2 * s * s * h  # softmax(scores) V
    proj = 2 * s * h * h
    mlp = 2 * s * h * (4 * h) + 2 * s * (4 * h) * h
    return qkv + scores + context + proj + mlp


# --- gpt ----------------------------------------------------------------------------------------------------------


def test_gpt2_medium_matches_published_count_plus_untied_head():
    graph = build_model("gpt")  # defaults: GPT-2 medium
    h, v = 1024, 50257
    total = sum(graph.param_count(i) for i in range(len(graph)))
    # Radford et al. 2019 / HF "gpt2-medium": 354.8M parameters with the LM head tied to the token embedding.
    tied = total - v * h
    assert abs(tied - 354.8e6) < 0.05e6
    assert total == sum(gpt_layer_params(24, h, 1024, v)) == 354_823_168 + v * h
    assert graph.total_param_bytes() == 2 * total


@settings(max_examples=50, deadline=None)
@given(
    layers=st.integers(1, 6),
    heads=st.integers(1, 8),
    head_dim=st.integers(1, 40),
    seq=st.integers(1, 300),
    vocab=st.integers(1, 5000),
)
def test_gpt_param_counts_exact_per_layer(layers, heads, head_dim, seq, vocab):
    h = heads * head_dim
    graph = build_model(f"gpt:layers={layers},hidden={h},heads={heads},seq={seq},vocab={vocab}")
    assert [graph.param_count(i) for i in range(len(graph))] == gpt_layer_params(layers, h, seq, vocab)
    assert [layer.name for layer in graph] == ["embed"] + [f"block{i}" for i in range(layers)] + ["head"]
    assert [layer.kind for layer in graph] == ["embedding"] + ["decoder"] * layers + ["head"]


@pytest.mark.parametrize(("s", "h", "a", "v"), [(1024, 1024, 16, 50257), (128, 64, 4, 1000), (7, 12, 3, 11)])
def test_gpt_flops_and_bytes(s, h, a, v):
    graph = build_model(f"gpt:layers=3,hidden={h},heads={a},seq={s},vocab={v}")
    for block in graph.layers[1:-1]:
        assert block.flops_fwd == gpt_block_flops(s, h) == 24 * s * h * h + 4 * s * s * h
        assert block.flops_bwd == 2 * block.flops_fwd
        # Korthikanti et al. 2022 (arXiv 2205.05198) §4.1: s*h*(34 + 5*a*s/h) bytes per block, fp16.
        assert block.saved_bytes == round(s * h * (34 + 5 * a * s / h))
        assert block.activation_bytes == 2 * s * h
    head = graph[-1]
    assert head.flops_fwd == 2 * s * h * v and head.flops_bwd == 4 * s * h * v
    assert graph[0].flops_fwd == 0
    assert [graph.boundary_bytes(c) for c in range(1, len(graph))] == [2 * s * h] * (len(graph) - 1)
    assert graph.input_bytes == 8 * s and graph.dtype_bytes == 2


def test_gpt_medium_block_flops_value():
    # 24*1024*1024^2 + 4*1024^2*1024 = 28 * 2^30
    assert build_model("gpt")[1].flops_fwd == 28 * 2**30


# --- uniform ------------------------------------------------------------------------------------------------------


def test_uniform_defaults_are_exact():
    graph = build_model("uniform")
    assert len(graph) == 8 and graph.dtype_bytes == 2
    for i, layer in enumerate(graph):
        assert layer.name == f"layer{i}" and layer.kind == "uniform"
        assert (layer.fwd_s, layer.bwd_s) == (0.001, 0.002)
        assert (layer.activation_bytes, layer.saved_bytes, layer.param_bytes) == (1_000_000, 1_000_000, 10_000_000)
        assert layer.flops_fwd == layer.flops_bwd == 0
        assert graph.param_count(i) == 5_000_000
    assert graph.input_bytes == 1_000_000
    assert graph.boundary_bytes(4) == 1_000_000


def test_uniform_custom_values():
    graph = build_model("uniform:layers=3,fwd_ms=0.5,bwd_ms=1.5,act_mb=0.1,param_mb=0")
    assert len(graph) == 3
    assert all((layer.fwd_s, layer.bwd_s) == (0.0005, 0.0015) for layer in graph)
    assert graph[0].activation_bytes == 100_000 and graph.total_param_bytes() == 0


# --- cnn ----------------------------------------------------------------------------------------------------------


def conv2d(k: int, c_in: int, c_out: int) -> int:
    return c_out * c_in * k * k + c_out  # weight [c_out, c_in, k, k] + bias


@pytest.mark.parametrize(
    ("layers", "c", "k", "size"), [(10, 16, 5, 256), (30, 16, 5, 64), (3, 48, 15, 20), (1, 2, 1, 1)]
)
def test_cnn_params_flops_bytes(layers, c, k, size):
    graph = build_model(f"cnn:layers={layers},features={c},kernel={k},size={size}")
    assert len(graph) == layers and graph.dtype_bytes == 4
    assert graph.input_bytes == 4 * 3 * size * size
    for i, layer in enumerate(graph):
        c_in = 3 if i == 0 else c
        assert layer.name == f"conv{i}" and layer.kind == "conv"
        assert graph.param_count(i) == conv2d(k, c_in, c)
        assert layer.flops_fwd == 2 * k * k * c_in * c * size * size
        assert layer.flops_bwd == 2 * layer.flops_fwd
        assert layer.activation_bytes == layer.saved_bytes == 4 * c * size * size
    if layers > 1:
        assert graph.boundary_bytes(1) == 4 * c * size * size


def test_cnn_defaults_follow_partime_basic_configuration():
    graph = build_model("cnn")
    assert graph.spec == "cnn:features=16,kernel=5,layers=10,size=256"
    assert graph.param_count(0) == 5 * 5 * 3 * 16 + 16 == 1216
    assert graph.param_count(1) == 5 * 5 * 16 * 16 + 16 == 6416


# --- specs --------------------------------------------------------------------------------------------------------


def test_spec_is_canonical_and_round_trips():
    graph = build_model("gpt:layers=2")
    assert graph.spec == "gpt:heads=16,hidden=1024,layers=2,seq=1024,vocab=50257"
    assert build_model(graph.spec) == graph
    assert (
        build_model("gpt:seq=64,layers=2,hidden=64,heads=4").spec
        == build_model("gpt: heads=4 , hidden=64,layers=2,seq=64").spec
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_default_spec_round_trips(name):
    graph = build_model(name)
    assert graph.spec == canonical_spec(name, MODELS[name].defaults)
    assert build_model(graph.spec) == graph


@settings(max_examples=50, deadline=None)
@given(fwd=st.floats(0, 1e3, allow_nan=False), act=st.floats(0, 1e3, allow_nan=False))
def test_uniform_float_specs_round_trip(fwd, act):
    graph = build_model(f"uniform:layers=2,fwd_ms={fwd!r},act_mb={act!r}")
    assert graph[0].fwd_s == fwd / 1e3
    again = build_model(graph.spec)
    assert again == graph and again.spec == graph.spec


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("resnet9000", "'resnet9000'"),
        ("gpt:layers=0", "got 0"),
        ("gpt:layers=-3", "got -3"),
        ("gpt:hidden=abc", "'abc'"),
        ("gpt:foo=1", "foo"),
        ("uniform:fwd_ms=-1", "'-1'"),
        ("uniform:act_mb=inf", "'inf'"),
        ("cnn:kernel=4", "kernel=4"),
        ("gpt:hidden=100,heads=16", "hidden=100, heads=16"),
        ("cnn:size=0", "got 0"),
        ("gpt:layers=2.5", "'2.5'"),
    ],
)
def test_bad_specs_raise_spec_error_naming_the_value(spec, shown):
    with pytest.raises(SpecError) as info:
        build_model(spec)
    assert shown in str(info.value)


def test_unknown_model_lists_known_ones():
    with pytest.raises(SpecError, match="known: amoebanet, cnn, gpt, llama, moe, supernet, uniform, vgg16; "
                       "presets: deepseek-v3, gpt-oss-120b, llama3.1-405b, llama3.1-70b, llama3.1-8b, mixtral-8x7b, "
                       "qwen2.5-7b, qwen3-235b-a22b, qwen3-30b-a3b"):
        build_model("bert")


def test_format_model_list_mentions_every_model_and_default():
    text = format_model_list()
    for name, entry in MODELS.items():
        assert entry.description in text
        line = next(line for line in text.splitlines() if line.startswith(f"{name}:"))
        for key, value in entry.defaults.items():
            assert f"{key}={value:g}" in line


def test_registry_entries_are_consistent():
    assert set(MODELS) == {"uniform", "gpt", "llama", "moe", "cnn", "supernet", "vgg16", "amoebanet"}
    for name, entry in MODELS.items():
        assert entry.name == name and entry.description and "\n" not in entry.description
        with pytest.raises(TypeError):
            entry.defaults["layers"] = 1  # type: ignore[index]


def test_sim_models_never_import_torch():
    code = "import sys, sim.models; sim.models.build_model('gpt:layers=1'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("spec,message", [
    ("uniform:layers=100000000", "at most 100,000"),
    ("gpt:layers=100001", "at most 100,000"),
    ("supernet:blocks=1000,choices=10000", "at most 1,000,000 candidates"),
])
def test_a_model_too_large_to_build_is_refused_before_building(spec, message):
    # Refused from the spec's numbers alone: building 1e8 layers first took minutes and gigabytes.
    with pytest.raises(SpecError, match=message):
        build_model(spec)


def test_the_largest_allowed_model_builds():
    assert len(build_model("uniform:layers=100000")) == 100_000
