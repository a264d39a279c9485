"""The ``llama`` family and the HuggingFace configs it reads: parameter counts against the published totals, FLOPs
against torch's own FLOP counter, tensor-parallel shards against the whole, and refusals."""

import json

import pytest

from sim.core.errors import SpecError
from sim.models import build_model, format_model_list
from sim.models.hf_config import ARCHITECTURES, llama_values, preset_config, preset_names, resolve_config_spec
from sim.models.llama import DecoderShape, block_flops_fwd, block_params
from sim.models.sharding import Sharding

#: Published parameter totals: the safetensors count the HuggingFace Hub shows on each model's page (``safetensors.
#: total`` of the Hub's model API), e.g. meta-llama/Llama-3.1-8B: 8,030,261,248.
PUBLISHED = {
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "qwen2.5-7b": 7_615_616_512,
}

#: Qwen/Qwen3-8B's config.json (the fields read) and its published total, 8,190,735,360: a Qwen 3 with QK-norm and
#: an explicit head_dim, which no preset exercises.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
            "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False}


def test_presets_are_the_shipped_dense_configs():
    dense = [name for name in preset_names() if preset_config(name)["architectures"][0] in ARCHITECTURES]
    assert dense == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_equal_the_published_totals(name):
    assert build_model(name).total_params == PUBLISHED[name]


def test_qwen3_from_a_config_file_equals_its_published_total(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    for given in (f"hf:{tmp_path}", f"hf:{tmp_path / 'config.json'}"):  # a folder holding config.json, or the file
        graph = build_model(given + ",seq=4096")
        assert graph.total_params == 8_190_735_360
        assert "qk_norm=1" in graph.spec and "seq=4096" in graph.spec


def test_tied_embeddings_count_the_table_once(tmp_path):
    # Qwen/Qwen3-0.6B ties its LM head to the token table; published total 596,049,920.
    config = dict(QWEN3_8B, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072,
                  tie_word_embeddings=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert build_model(f"hf:{path}").total_params == 596_049_920


def test_a_config_spec_is_a_plain_llama_spec_that_rebuilds_the_same_graph():
    graph = build_model("llama3.1-8b,seq=8192")
    assert graph.spec.startswith("llama:") and build_model(graph.spec) == graph
    assert build_model("llama3.1-8b:seq=8192") == graph == build_model("llama3.1-8b")  # seq 8192 is the default


def test_model_list_shows_every_preset_with_its_count():
    text = format_model_list()
    for name, total in PUBLISHED.items():
        assert f"{name}  " in text and f"{total:,} parameters" in text


def _reference_block_flops(shape: DecoderShape) -> int:
    """Forward FLOPs of a Llama block written in torch, counted by ``torch.utils.flop_counter.FlopCounterMode``:
    the GEMMs and the two attention matmuls (explicit, over the key/value heads repeated to the query heads)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    s, h, a, g, d, f = shape.seq, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    linear = torch.nn.functional.linear
    w = {name: torch.randn(out, inp) for name, (out, inp) in {
        "q": (a * d, h), "k": (g * d, h), "v": (g * d, h), "o": (h, a * d),
        "gate": (f, h), "up": (f, h), "down": (h, f)}.items()}
    x = torch.randn(1, s, h)
    with FlopCounterMode(display=False) as counter:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        q = linear(normed, w["q"]).view(1, s, a, d).transpose(1, 2)
        k = linear(normed, w["k"]).view(1, s, g, d).transpose(1, 2).repeat_interleave(a // g, dim=1)
        v = linear(normed, w["v"]).view(1, s, g, d).transpose(1, 2).repeat_interleave(a // g, dim=1)
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        attended = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + linear(attended.transpose(1, 2).reshape(1, s, a * d), w["o"])
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        x = x + linear(torch.nn.functional.silu(linear(normed, w["gate"])) * linear(normed, w["up"]), w["down"])
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [
    DecoderShape(1, 128, 8, 2, 16, 352, 100, 64),  # grouped-query
    DecoderShape(1, 96, 4, 4, 24, 256, 100, 32),  # multi-head
    DecoderShape(1, 64, 4, 1, 32, 160, 100, 48),  # multi-query, head_dim × heads ≠ hidden
])
def test_block_flops_equal_torchs_flop_counter(shape):
    assert block_flops_fwd(shape) == _reference_block_flops(shape)


def test_tensor_parallel_shards_add_up_to_the_whole():
    # Oracle: the split parts over t shards plus the replicated norms once equal the whole block; the vocabulary
    # shards cover the (padded) vocabulary.
    spec = "llama:layers=2,hidden=256,heads=8,kv_heads=4,ffn=704,vocab=1001,seq=128,qkv_bias=1,qk_norm=1"
    whole = build_model(spec)
    shape = DecoderShape(2, 256, 8, 4, 32, 704, 1001, 128, qkv_bias=True, qk_norm=True)
    replicated = 2 * 256 + 2 * 32
    for t in (2, 4):
        shard = build_model(spec, Sharding(tp=t))
        assert block_params(shape, t) * t - (t - 1) * replicated == block_params(shape)
        assert shard.param_count(1) == block_params(shape, t)
        assert shard.layers[1].flops_fwd * t == whole.layers[1].flops_fwd
        assert shard.layers[1].tp_comm_fwd_count == 2 and shard.layers[1].tp_comm_bwd_count == 2
        assert shard.param_count(0) * t == -(-1001 // t) * t * 256  # vocabulary rows padded to a multiple of t


@pytest.mark.parametrize("spec, sharding, message", [
    ("llama:heads=32,kv_heads=8", Sharding(tp=16), "tp=16 must divide heads=32 and kv_heads=8"),
    ("llama:heads=32,kv_heads=6", Sharding(), "kv_heads \\(6\\) must divide heads \\(32\\)"),
    ("llama:qk_norm=2", Sharding(), "qk_norm must be 0 or 1"),
    ("llama:seq=4096", Sharding(cp=3), "multiple of 6"),
    ("llama3.1-8b,layers=2", Sharding(), "takes seq= only, got 'layers=2'"),
    ("hf:/no/such/config.json", Sharding(), "does not exist"),
])
def test_refusals_name_what_is_wrong(spec, sharding, message):
    with pytest.raises(SpecError, match=message):
        build_model(spec, sharding)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MixtralForCausalLM"]}, "architecture MixtralForCausalLM is not a dense decoder"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not read"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not read"),
    ({"attention_bias": True}, "attention_bias: true is not read"),
    ({"use_sliding_window": True}, "use_sliding_window: true is not read"),
    ({"num_key_value_heads": "8"}, "num_key_value_heads must be a positive integer, got '8'"),
])
def test_configs_the_family_cannot_express_are_refused_by_field(change, message):
    with pytest.raises(SpecError, match=message):
        llama_values({**QWEN3_8B, **change}, "test")


def test_mistral_reads_its_sliding_window():
    config = {**QWEN3_8B, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    config.pop("head_dim")
    assert llama_values(config, "test")["window"] == 4096
    assert resolve_config_spec("gpt:layers=2") is None  # not a config spec: the zoo reads it
