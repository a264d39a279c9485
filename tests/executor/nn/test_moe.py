"""The ``moe`` torch modules against the simulator's graph: parameters, GEMM FLOPs (torch's own counter), and the
mixture's routing and sinks against brute-force references."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from executor.nn.moe import Mixture, _attend
from executor.nn.stages import build_layers
from sim.core.spec import SpecParams, parse_spec
from sim.models import build_model
from sim.models.moe import block_flops_fwd, shape_of

SPECS = [
    # Qwen3-MoE-like: GQA with QK-norm, 8 experts top 2
    "moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=64,vocab=50,seq=8,experts=8,topk=2,expert_ffn=16",
    # GPT-OSS-like: biases, sinks, a window on every other layer, expert biases, router bias, clamped SwiGLU
    "moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=64,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16,"
    "qk_norm=0,qkv_bias=1,o_bias=1,sinks=1,window=4,window_period=2,router_bias=1,expert_bias=1,swiglu_clamp=7",
    # DeepSeek-V3-like: latent attention, a dense first layer, a shared expert, sigmoid routing with its bias
    "moe:layers=2,hidden=32,heads=4,head_dim=8,ffn=64,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16,qk_norm=0,"
    "q_lora=16,kv_lora=12,rope_dim=4,v_dim=8,dense_layers=1,shared_experts=1,sigmoid=1,router_bias=1",
]


def _shape(spec):
    graph = build_model(spec)
    return shape_of(SpecParams(graph.spec, parse_spec(graph.spec)[1]))[0]


@pytest.mark.parametrize("spec", SPECS)
def test_every_module_has_the_graphs_parameter_count(spec):
    graph = build_model(spec)
    layers = build_layers(spec)
    assert [sum(p.numel() for p in layer.parameters()) for layer in layers] == [
        graph.param_count(i) for i in range(len(graph))]


@pytest.mark.parametrize("spec", SPECS)
def test_block_gemm_flops_equal_torchs_flop_counter(spec):
    # On the CPU torch's counter counts the GEMMs but not SDPA's fused kernel: the model's block FLOPs less the
    # attention core. A sink layer's explicit matmuls, and latent attention's SDPA (its value dimension differs from
    # the query's, so torch runs the math path), are counted, over the whole s × s.
    shape, layers = _shape(spec), build_layers(spec)
    torch.manual_seed(0)
    for i in range(shape.layers):
        x = torch.randn(1, shape.seq, shape.hidden)
        with FlopCounterMode(display=False) as counter:
            layers[1 + i](x)
        attention = 2 * shape.seq * shape.seq * shape.heads * (shape.qk_dim + shape.value_dim)
        window = shape.window if shape.window and i % shape.window_period == 0 else 0
        keys = min(shape.seq, window) if window else shape.seq
        model_attention = 2 * shape.seq * keys * shape.heads * (shape.qk_dim + shape.value_dim)
        counted_attention = attention if shape.sinks or shape.latent else 0
        assert counter.get_total_flops() == block_flops_fwd(shape, i) - model_attention + counted_attention, (spec, i)


def test_the_mixture_equals_a_token_by_token_reference():
    torch.manual_seed(1)
    mixture = Mixture(16, 4, 2, 8, 8, router_bias=True, expert_bias=True, sigmoid=False, swiglu_clamp=0)
    mixture.init_parameters(torch.Generator().manual_seed(2), 0.02)
    with torch.no_grad():
        for p in mixture.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 5, 16)
    out = mixture(x)
    tokens = x.reshape(-1, 16)
    scores = torch.softmax(mixture.router(tokens), dim=-1)
    for t in range(tokens.shape[0]):
        top = scores[t].topk(2)
        weights = top.values / top.values.sum()
        want = sum(w * mixture.expert(int(e), tokens[t:t + 1])[0] for w, e in zip(weights, top.indices))
        want = want + mixture.shared(tokens[t:t + 1])[0]
        torch.testing.assert_close(out.reshape(-1, 16)[t], want, rtol=1e-5, atol=1e-6)


def test_sinks_join_every_softmax_denominator():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    sinks = torch.tensor([0.5, -1.0])
    out = _attend(q, k, v, 0, sinks)
    for head in range(2):
        for i in range(5):
            logits = q[0, head, i] @ k[0, head, : i + 1].T / 2.0
            denominator = logits.exp().sum() + sinks[head].exp()
            want = (logits.exp() / denominator) @ v[0, head, : i + 1]
            torch.testing.assert_close(out[0, head, i], want, rtol=1e-5, atol=1e-6)
    # sinks of -inf are plain causal attention
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(_attend(q, k, v, 0, torch.full((2,), float("-inf"))), plain, rtol=1e-5, atol=1e-6)


def test_the_executor_refuses_a_multi_token_prediction_module_by_name():
    from executor.nn.stages import check_torch_model
    from sim.core.errors import SpecError

    spec = "moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16"
    check_torch_model(spec)  # the main model alone runs
    with pytest.raises(SpecError, match=r"does not run multi-token prediction \(mtp=1\)"):
        check_torch_model(spec + ",mtp=1")


class _OneProcessGroup:
    """An expert-parallel group of one process: every collective returns its input; the calls are recorded, so a
    test sees which dispatcher the mixture ran."""

    size, rank = 1, 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def counts(self, send):
        self.calls.append("counts")
        return send.clone()

    def all_to_all(self, rows, send, receive):
        self.calls.append("all_to_all")
        return rows.clone()

    def all_gather(self, rows):
        self.calls.append("all_gather")
        return rows.clone()

    def reduce_scatter(self, rows):
        self.calls.append("reduce_scatter")
        return rows.clone()


@pytest.mark.parametrize("dispatcher, exchanged", [
    ("all-to-all", {"counts", "all_to_all"}), ("deduplicated", {"counts", "all_to_all"}),
    ("all-gather", {"all_gather", "reduce_scatter"})])
def test_each_dispatcher_runs_its_own_exchange_and_computes_the_unsharded_mixture(dispatcher, exchanged):
    # Over a group of one process the exchange moves nothing, so the output and the gradients must be the plain
    # mixture's; the recorded calls show which exchange ran (the deduplicated one runs as the all-to-all). The
    # all-gather path gathers the tokens, the dense scores and the routing map (three gathers), then reduce-scatters.
    torch.manual_seed(4)
    plain = Mixture(16, 4, 2, 8, 0, router_bias=False, expert_bias=False, sigmoid=False, swiglu_clamp=0)
    plain.init_parameters(torch.Generator().manual_seed(5), 0.02)
    sharded = Mixture(16, 4, 2, 8, 0, router_bias=False, expert_bias=False, sigmoid=False, swiglu_clamp=0)
    sharded.load_state_dict(plain.state_dict())
    group = _OneProcessGroup()
    sharded.shard_experts(group, dispatcher)  # type: ignore[arg-type]
    x = torch.randn(2, 5, 16)
    want, got = plain(x), sharded(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert set(group.calls) == exchanged
    if dispatcher == "all-gather":
        assert group.calls.count("all_gather") >= 3 and group.calls.count("reduce_scatter") >= 1
