"""The ``llama`` torch modules against the simulator's graph: parameters, FLOPs (torch's own counter), shapes, and the
attention against a brute-force reference."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from executor.nn.llama import LlamaBlock, _rotate, rotation
from executor.nn.stages import boundary_specs, build_layers, check_torch_model
from sim.core.errors import SpecError
from sim.core.spec import parse_spec
from sim.models import build_model
from sim.models.llama import DecoderShape, block_flops_fwd

SPECS = [
    "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,vocab=100,seq=32",  # grouped-query
    "llama:layers=1,hidden=64,heads=4,kv_heads=4,ffn=96,vocab=50,seq=16,qkv_bias=1",  # multi-head, Qwen 2's biases
    "llama:layers=1,hidden=64,heads=4,kv_heads=1,ffn=96,vocab=50,seq=16,qk_norm=1,head_dim=24",  # MQA, QK-norm
    "llama:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,vocab=50,seq=16,window=4",  # sliding window
]


@pytest.mark.parametrize("spec", SPECS)
def test_every_module_has_the_graphs_parameter_count(spec):
    graph = build_model(spec)
    layers = build_layers(spec)
    assert [sum(p.numel() for p in layer.parameters()) for layer in layers] == [
        graph.param_count(i) for i in range(len(graph))]


@pytest.mark.parametrize("spec", SPECS[:3])
def test_block_flops_equal_torchs_flop_counter_on_the_executors_module(spec):
    # On the meta device torch's SDPA dispatches to a kernel the counter knows (on the CPU it counts none).
    graph = build_model(spec)
    v = {key: int(value) for key, value in parse_spec(graph.spec)[1].items()}
    head_dim = v["head_dim"] or v["hidden"] // v["heads"]
    shape = DecoderShape(v["layers"], v["hidden"], v["heads"], v["kv_heads"], head_dim, v["ffn"], v["vocab"], v["seq"],
                         bool(v["qkv_bias"]), bool(v["qk_norm"]))
    block = build_layers(spec)[1].to("meta")
    with FlopCounterMode(display=False) as counter:
        block(torch.empty(1, v["seq"], v["hidden"], device="meta"))
    assert counter.get_total_flops() == block_flops_fwd(shape) == graph.layers[1].flops_fwd


def test_boundaries_match_the_graphs_bytes():
    spec = SPECS[0]
    specs = boundary_specs(spec, [0, 1, 3, 4], 2)
    assert specs[1].shape == (2, 32, 64) and specs[4].shape == (2, 32, 100)  # hidden states, then the logits


def _brute_force_attention(block: LlamaBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's attention sublayer (x + o(attention)), position by position: query i attends keys j with
    i − window < j ≤ i (all j ≤ i without a window), over its key/value head a // g."""
    n, s, _ = x.shape
    normed = block.input_norm(x)
    q = block.q(normed).unflatten(-1, (block.heads, block.head_dim)).transpose(1, 2)
    k = block.k(normed).unflatten(-1, (block.kv_heads, block.head_dim)).transpose(1, 2)
    v = block.v(normed).unflatten(-1, (block.kv_heads, block.head_dim)).transpose(1, 2)
    cos, sin = rotation(block.head_dim, s, x.device)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = torch.zeros_like(q)
    group = block.heads // block.kv_heads
    for head in range(block.heads):
        for i in range(s):
            keys = [j for j in range(i + 1) if not block.window or i - j < block.window]
            scores = torch.stack([(q[:, head, i] * k[:, head // group, j]).sum(-1) for j in keys], -1)
            weights = (scores / math.sqrt(block.head_dim)).softmax(-1)
            out[:, head, i] = sum(weights[:, m, None] * v[:, head // group, j] for m, j in enumerate(keys))
    return x + block.o(out.transpose(1, 2).reshape(n, s, -1))


@pytest.mark.parametrize("window", [0, 3])
def test_attention_equals_a_brute_force_reference(window):
    block = LlamaBlock(32, 4, 2, 8, 48, 1, qkv_bias=False, qk_norm=False, window=window)
    block.init_parameters(torch.Generator().manual_seed(0))
    block.down.weight.data.zero_()  # the MLP adds nothing: the block's output is its attention sublayer's
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(block(x), _brute_force_attention(block, x), rtol=1e-5, atol=1e-6)


def test_what_the_executor_does_not_run_is_refused_before_building():
    with pytest.raises(SpecError, match="tied embeddings"):
        check_torch_model("llama:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,vocab=50,seq=8,tied=1")
    with pytest.raises(SpecError, match="head dimension must be even, got 5"):
        check_torch_model("llama:layers=1,hidden=32,heads=2,kv_heads=1,ffn=64,vocab=50,seq=8,head_dim=5")


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_have_the_simulators_counts_and_put_back_together_bitwise(tp):
    from executor.nn.llama_parallel import shard_layer, unshard_state
    from executor.nn.tensor_parallel import TensorParallelComm
    from sim.models.sharding import Sharding

    spec = "llama:layers=1,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=51,seq=16,qkv_bias=1,qk_norm=1"
    graph = build_model(spec, Sharding(tp=tp))
    values = {key: int(value) for key, value in parse_spec(graph.spec)[1].items()}
    layers = build_layers(spec, seed=3)
    shards = [[shard_layer(layer, values, TensorParallelComm(None, tp, t)) for layer in layers] for t in range(tp)]
    for t in range(tp):
        assert [sum(p.numel() for p in shard.parameters()) for shard in shards[t]] == [
            graph.param_count(i) for i in range(len(graph))]
    for i, layer in enumerate(layers):
        back = unshard_state([shards[t][i].state_dict() for t in range(tp)], vocab=51)
        assert sorted(back) == sorted(layer.state_dict())
        for name, tensor in layer.state_dict().items():
            assert torch.equal(back[name], tensor), name
