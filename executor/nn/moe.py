"""Torch layers of the ``moe`` model: the token embedding and LM head of ``executor.nn.llama``, and pre-norm blocks
of grouped-query or latent attention followed by a dense SwiGLU or a mixture of experts.

Mirrors ``sim/models/moe.py`` layer for layer: the parameter counts there are exact for these modules and the
simulator's forward GEMM FLOPs of a block equal what ``torch.utils.flop_counter.FlopCounterMode`` counts on
:class:`MoeBlock` (``tests/executor/nn/test_moe.py``): each token visits exactly ``topk`` experts (dropless), so the
experts' FLOPs do not depend on where the router sends it.

The mixture (Shazeer et al. 2017, arXiv 1701.06538 §2): router logits ``x·W_r (+ b_r)``; scores softmax (or sigmoid,
``sigmoid=1``) of them; each token's ``topk`` highest-scoring experts, their scores renormalised to sum to one; the
token's output is their SwiGLUs' outputs weighted by those scores, plus the shared experts' SwiGLU (width
``shared_experts · expert_ffn``). GPT-OSS's experts have biases and clamp their SwiGLU (``swiglu_clamp`` L: the gate
clamped above at L, the up projection to [−L, L], ``(up + 1) · gate · σ(1.702 · gate)``). The experts are held as
three stacked weight tensors (E × h × f, E × h × f, E × f × h) and each runs on the tokens routed to it.

Latent attention (DeepSeek-V2 §2.1.2): ``q = W_qb · RMSNorm(W_qa · x)`` (or ``W_q · x`` without ``q_lora``), split
per head into a non-rotary part of d and a rotary part of r; ``[c, k_r] = W_kva · x``; ``[k_n, v] = W_kvb ·
RMSNorm(c)`` per head; the key is ``[k_n, rotate(k_r)]`` with ``k_r`` shared by every head; attention over heads of
query/key dimension d + r and value dimension v.

Attention sinks (GPT-OSS): one learned logit per head joins every query's softmax denominator (a column of the
scores that no value is weighted by); computed explicitly, as SDPA has no sink.

As ``executor.nn.llama``: fp32 on the CPU, rotary base 10,000, tied embeddings refused; the same initialisation
(every Linear and expert weight N(0, 0.02²), the projections writing into the residual stream scaled by 1/√(2L),
biases and sinks 0, norms 1). Tensor and context parallelism are not run for this family (refused by
``executor.parallel``).

In a run the executor forces the plan's routing on every mixture (:mod:`executor.nn.forced_routing`: balanced unless
the plan names a skew or a trace, as the published benchmarks force it, with the plan's capacity factor), and under
expert parallelism each process keeps a block of the experts and exchanges the tokens by all-to-all, or under the
plan's all-gather dispatcher gathers every token and reduce-scatters the outputs (:mod:`executor.nn.expert_parallel`;
a plan's deduplicated dispatcher runs as the all-to-all: the same rows arrive, not sent once per server). A module
built on its own routes by the router's top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.nn.expert_parallel import EXPERT_PARAMETERS, ExpertParallelComm, exchange, gather_rows, scatter_sum
from executor.nn.forced_routing import ForcedRouting, expert_capacity, kept_slots
from executor.nn.llama import INIT_STD, LlamaEmbedding, LlamaHead, _rotate, rotation, window_mask
from sim.core.errors import SpecError
from sim.models.routing import Routing

__all__ = ["MoeBlock", "GroupedQueryAttention", "LatentAttention", "Mixture", "SwiGLU", "check_values", "make_layer",
           "force_routing", "shard_experts"]

#: GPT-OSS's SwiGLU: σ(α · gate) with α = 1.702 (the published model code).
CLAMPED_SWIGLU_ALPHA = 1.702


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` of width ``f`` (a dense block's, or the shared experts')."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def init_parameters(self, generator: torch.Generator, residual_std: float) -> None:
        with torch.no_grad():
            for linear, std in ((self.gate, INIT_STD), (self.up, INIT_STD), (self.down, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Mixture(nn.Module):
    """The routed experts, the router and the shared experts of one block (module docstring).

    Attributes:
        moe_index: the block's position among the model's MoE blocks (what a forced routing's spread depends on).
        forced: the plan's routing forced on the tokens (:mod:`executor.nn.forced_routing`), or ``None``: the
            router's own top-k.
        capacity_factor: each expert computes at most ⌈c·k·T/E⌉ slots of a microbatch (0: dropless).
        expert_parallel: the expert-parallel group when the experts are split over processes
            (:mod:`executor.nn.expert_parallel`), else ``None``.
        first_expert: the global index of this process's first expert (0 without expert parallelism).
    """

    def __init__(self, hidden: int, experts: int, topk: int, expert_ffn: int, shared_ffn: int, *,
                 router_bias: bool, expert_bias: bool, sigmoid: bool, swiglu_clamp: int, moe_index: int = 0) -> None:
        super().__init__()
        self.experts, self.topk, self.sigmoid, self.clamp = experts, topk, sigmoid, swiglu_clamp
        self.moe_index = moe_index
        self.forced: ForcedRouting | None = None
        self.capacity_factor = 0.0
        self.expert_parallel: ExpertParallelComm | None = None
        self.gathers = False  # Megatron-Core's all-gather dispatcher instead of the all-to-all (shard_experts)
        self.first_expert = 0
        self.router = nn.Linear(hidden, experts, bias=router_bias)
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, expert_ffn))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, expert_ffn))
        self.w_down = nn.Parameter(torch.empty(experts, expert_ffn, hidden))
        self.b_gate_up = nn.Parameter(torch.empty(experts, 2 * expert_ffn)) if expert_bias else None
        self.b_down = nn.Parameter(torch.empty(experts, hidden)) if expert_bias else None
        self.shared = SwiGLU(hidden, shared_ffn) if shared_ffn else None

    def init_parameters(self, generator: torch.Generator, residual_std: float) -> None:
        with torch.no_grad():
            self.router.weight.normal_(0.0, INIT_STD, generator=generator)
            if self.router.bias is not None:
                self.router.bias.zero_()
            self.w_gate.normal_(0.0, INIT_STD, generator=generator)
            self.w_up.normal_(0.0, INIT_STD, generator=generator)
            self.w_down.normal_(0.0, residual_std, generator=generator)
            for bias in (self.b_gate_up, self.b_down):
                if bias is not None:
                    bias.zero_()
        if self.shared is not None:
            self.shared.init_parameters(generator, residual_std)

    def force_routing(self, routing: Routing, capacity_factor: float = 0.0) -> None:
        """Route by ``routing`` instead of the router's top-k, and drop beyond ``capacity_factor`` (0: dropless)."""
        self.forced = ForcedRouting(routing, self.moe_index, self.experts, self.topk)
        self.capacity_factor = capacity_factor

    def shard_experts(self, comm: ExpertParallelComm, dispatcher: str = "all-to-all") -> None:
        """Keep only expert-parallel rank ``comm.rank``'s block of ``E / comm.size`` experts, and exchange tokens over
        ``comm`` (``executor.nn.expert_parallel``) as ``dispatcher`` says (``all-gather``: gathered and
        reduce-scattered; any other: the all-to-all).

        Raises:
            ValueError: E not divisible by the group's size, or experts already sharded.
        """
        if self.expert_parallel is not None:
            raise ValueError("this mixture's experts are already split over an expert-parallel group")
        if self.experts % comm.size:
            raise ValueError(f"{self.experts} experts do not split over {comm.size} expert-parallel processes")
        local = self.experts // comm.size
        first = comm.rank * local
        for name in EXPERT_PARAMETERS:
            whole = getattr(self, name)
            if whole is not None:
                setattr(self, name, nn.Parameter(whole.detach()[first:first + local].clone()))
        self.expert_parallel, self.first_expert = comm, first
        self.gathers = dispatcher == "all-gather"

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, h) → each token's ``topk`` experts and their weights, (tokens, k) each: the router's highest
        scores, or the forced experts weighted by their scores (:mod:`executor.nn.forced_routing`)."""
        logits = self.router(x)
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if self.forced is None:
            weights, chosen = scores.topk(self.topk, dim=-1)
        else:
            chosen = self.forced(x.shape[0], x.device)
            weights = scores.gather(1, chosen)
        return chosen, weights / weights.sum(dim=-1, keepdim=True)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """This process's expert ``e`` (global index ``first_expert + e``) on its tokens (m, h)."""
        f = self.w_gate.shape[-1]
        gate, up = x @ self.w_gate[e], x @ self.w_up[e]
        if self.b_gate_up is not None:
            gate, up = gate + self.b_gate_up[e, :f], up + self.b_gate_up[e, f:]
        if self.clamp:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            hidden = (up + 1) * gate * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * gate)
        else:
            hidden = F.silu(gate) * up
        out = hidden @ self.w_down[e]
        return out + self.b_down[e] if self.b_down is not None else out

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) → the same shape: each token's experts' outputs weighted and summed, plus the shared experts'."""
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(tokens)
        capacity = expert_capacity(tokens.shape[0], self.topk, self.experts, self.capacity_factor)
        kept = kept_slots(chosen, capacity) if capacity is not None else None
        if self.expert_parallel is not None and self.gathers:
            out = self._gathered(tokens, chosen, weights, kept)
        elif self.expert_parallel is not None:
            out = self._exchanged(tokens, chosen, weights, kept)
        else:
            out = torch.zeros_like(tokens)
            for e in range(self.experts):
                taken = chosen == e if kept is None else (chosen == e) & kept
                rows, slot = taken.nonzero(as_tuple=True)
                if rows.numel():
                    out = out.index_add(0, rows, self.expert(e, tokens[rows]) * weights[rows, slot, None])
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(x.shape)

    def _exchanged(self, tokens: Tensor, chosen: Tensor, weights: Tensor, kept: Tensor | None) -> Tensor:
        """The routed experts' weighted sum under expert parallelism: dispatch each token copy to the process owning
        its expert, run this process's experts on what arrives, combine back (``executor.nn.expert_parallel``)."""
        comm = self.expert_parallel
        assert comm is not None
        local = self.experts // comm.size
        flat = chosen.reshape(-1)
        copies = torch.arange(flat.numel(), device=flat.device)
        if kept is not None:
            copies = copies[kept.reshape(-1)]
        copies = copies[torch.argsort(flat[copies], stable=True)]  # by expert, so by owning process
        experts = flat[copies]
        send = torch.bincount(experts // local, minlength=comm.size)
        receive = comm.counts(send)
        send_sizes, receive_sizes = send.tolist(), receive.tolist()
        arrived = exchange(tokens[copies // self.topk], comm, send_sizes, receive_sizes)
        arrived_experts = comm.all_to_all(experts, send_sizes, receive_sizes) - self.first_expert
        computed = torch.zeros_like(arrived)
        for e in range(local):
            rows = (arrived_experts == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                computed = computed.index_add(0, rows, self.expert(e, arrived[rows]))
        returned = exchange(computed, comm, receive_sizes, send_sizes)
        weighted = returned * weights.reshape(-1)[copies, None]
        return torch.zeros_like(tokens).index_add(0, copies // self.topk, weighted)

    def _gathered(self, tokens: Tensor, chosen: Tensor, weights: Tensor, kept: Tensor | None) -> Tensor:
        """The routed experts' weighted sum under Megatron-Core's all-gather dispatcher: every process's tokens, their
        routing map and their scores (tokens × experts, dense, as Megatron gathers them) gathered to all; this
        process's experts run on the rows routed to them among all the group's tokens; their weighted outputs summed
        over the processes and scattered back to the tokens' own (``executor.nn.expert_parallel``)."""
        comm = self.expert_parallel
        assert comm is not None
        routed = torch.ones_like(chosen, dtype=torch.uint8) if kept is None else kept.to(torch.uint8)
        routing_map = torch.zeros(tokens.shape[0], self.experts, dtype=torch.uint8,
                                  device=tokens.device).scatter(1, chosen, routed)
        scores = torch.zeros(tokens.shape[0], self.experts, dtype=weights.dtype,
                             device=tokens.device).scatter(1, chosen, weights)
        every_token, every_score = gather_rows(tokens, comm), gather_rows(scores, comm)
        every_map = comm.all_gather(routing_map)
        out = torch.zeros_like(every_token)
        for e in range(self.experts // comm.size):
            column = self.first_expert + e
            rows = every_map[:, column].nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, self.expert(e, every_token[rows]) * every_score[rows, column, None])
        return scatter_sum(out, comm)


def _attend(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: Tensor | None) -> Tensor:
    """Causal (or windowed) attention of q (n, a, s, d) over k (n, g, s, d), v (n, g, s, dv); with ``sinks`` (a,) a
    per-head logit joins every softmax's denominator."""
    s = q.shape[2]
    mask = window_mask(window, s, q.device)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=k.shape[1] != q.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = mask if mask is not None else torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return weights @ v


class GroupedQueryAttention(nn.Module):
    """q, k, v (with biases where asked), QK-norm, rotary, causal or windowed attention with optional sinks, o."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, sinks: bool, window: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(heads)) if sinks else None
        self.o = nn.Linear(heads * head_dim, hidden, bias=o_bias)

    def init_parameters(self, generator: torch.Generator, residual_std: float) -> None:
        with torch.no_grad():
            for norm in (self.q_norm, self.k_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            for linear, std in ((self.q, INIT_STD), (self.k, INIT_STD), (self.v, INIT_STD), (self.o, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)
                if linear.bias is not None:
                    linear.bias.zero_()
            if self.sinks is not None:
                self.sinks.zero_()

    def forward(self, x: Tensor) -> Tensor:
        n, s, _ = x.shape
        q = self.q(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.k(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotation(self.head_dim, s, x.device)
        attended = _attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v, self.window, self.sinks)
        return self.o(attended.transpose(1, 2).reshape(n, s, self.heads * self.head_dim))


class LatentAttention(nn.Module):
    """Multi-head latent attention (module docstring): ``head_dim`` d non-rotary, ``rope_dim`` r rotary, ``v_dim``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, q_lora: int, kv_lora: int, rope_dim: int,
                 v_dim: int) -> None:
        super().__init__()
        self.heads, self.d, self.r, self.v_dim, self.kv_lora = heads, head_dim, rope_dim, v_dim, kv_lora
        qk = head_dim + rope_dim
        if q_lora:
            self.q_down, self.q_norm = nn.Linear(hidden, q_lora, bias=False), nn.RMSNorm(q_lora)
            self.q_up = nn.Linear(q_lora, heads * qk, bias=False)
        else:
            self.q_down, self.q_norm, self.q_up = None, None, nn.Linear(hidden, heads * qk, bias=False)
        self.kv_down = nn.Linear(hidden, kv_lora + rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora)
        self.kv_up = nn.Linear(kv_lora, heads * (head_dim + v_dim), bias=False)
        self.o = nn.Linear(heads * v_dim, hidden, bias=False)

    def init_parameters(self, generator: torch.Generator, residual_std: float) -> None:
        with torch.no_grad():
            for norm in (self.q_norm, self.kv_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            for linear, std in ((self.q_down, INIT_STD), (self.q_up, INIT_STD), (self.kv_down, INIT_STD),
                                (self.kv_up, INIT_STD), (self.o, residual_std)):
                if linear is not None:
                    linear.weight.normal_(0.0, std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        n, s, _ = x.shape
        a, d, r = self.heads, self.d, self.r
        query_in = self.q_norm(self.q_down(x)) if self.q_down is not None and self.q_norm is not None else x
        q = self.q_up(query_in).unflatten(-1, (a, d + r)).transpose(1, 2)
        latent, k_rope = self.kv_down(x).split((self.kv_lora, r), dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).unflatten(-1, (a, d + self.v_dim)).transpose(1, 2)
        k_nope, v = kv.split((d, self.v_dim), dim=-1)
        cos, sin = rotation(r, s, x.device)
        q_nope, q_rope = q.split((d, r), dim=-1)
        q = torch.cat((q_nope, _rotate(q_rope, cos, sin)), dim=-1)
        k_shared = _rotate(k_rope.unsqueeze(1), cos, sin).expand(n, a, s, r)
        k = torch.cat((k_nope, k_shared), dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(n, s, a * self.v_dim))


class MoeBlock(nn.Module):
    """Layer ``block{i}``: ``x + Attention(RMSNorm(x))`` then ``x + FeedForward(RMSNorm(x))``, the feed-forward a
    dense SwiGLU or a :class:`Mixture`."""

    def __init__(self, hidden: int, attention: nn.Module, feed_forward: nn.Module, n_blocks: int) -> None:
        super().__init__()
        self.n_blocks = n_blocks
        self.input_norm = nn.RMSNorm(hidden)
        self.attention = attention
        self.post_attention_norm = nn.RMSNorm(hidden)
        self.feed_forward = feed_forward

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator`` (module docstring), in a fixed order."""
        residual_std = INIT_STD / math.sqrt(2 * self.n_blocks)
        with torch.no_grad():
            self.input_norm.weight.fill_(1.0)
            self.post_attention_norm.weight.fill_(1.0)
        self.attention.init_parameters(generator, residual_std)
        self.feed_forward.init_parameters(generator, residual_std)

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 hidden states → the same shape."""
        x = x + self.attention(self.input_norm(x))
        return x + self.feed_forward(self.post_attention_norm(x))


def force_routing(module: nn.Module, routing: Routing, capacity_factor: float = 0.0) -> None:
    """Route every mixture inside ``module`` by ``routing``, dropping beyond ``capacity_factor`` (0: dropless), as a
    plan that names them predicts (:mod:`executor.nn.forced_routing`)."""
    for mixture in module.modules():
        if isinstance(mixture, Mixture):
            mixture.force_routing(routing, capacity_factor)


def shard_experts(module: nn.Module, comm: ExpertParallelComm, dispatcher: str = "all-to-all") -> int:
    """Keep expert-parallel rank ``comm.rank``'s block of experts in every mixture inside ``module`` and route through
    ``comm`` by ``dispatcher`` (:meth:`Mixture.shard_experts`); returns how many mixtures were sharded."""
    sharded = 0
    for mixture in module.modules():
        if isinstance(mixture, Mixture):
            mixture.shard_experts(comm, dispatcher)
            sharded += 1
    return sharded


def check_values(values: dict[str, int]) -> None:
    """Refuse, before anything is built, what these modules do not run.

    Raises:
        SpecError: tied embeddings, an odd rotary dimension (rotary embeddings rotate pairs), a multi-token-prediction
            module (``mtp``: the simulator costs it, these modules do not build it).
    """
    if values.get("mtp", 0):
        raise SpecError(f"the executor does not run multi-token prediction (mtp={values['mtp']}): the simulator costs "
                        f"the module, these modules do not build it; use mtp=0")
    if values["tied"]:
        raise SpecError("the executor does not run tied embeddings (tied=1): the LM head would need the token table "
                        "of another layer")
    rotary = values["rope_dim"] if values["kv_lora"] else (values["head_dim"] or values["hidden"] // values["heads"])
    if rotary % 2:
        raise SpecError(f"rotary embeddings rotate pairs: the rotary dimension must be even, got {rotary}")


def make_layer(values: dict[str, int], i: int) -> nn.Module:
    """The uninitialised module of graph layer ``i`` (0 = embed, 1..L = blocks, L + 1 = head); the values passed
    :func:`check_values`."""
    n_blocks, h = values["layers"], values["hidden"]
    if i == 0:
        return LlamaEmbedding(values["vocab"], h)
    if i == n_blocks + 1:
        return LlamaHead(h, values["vocab"])
    assert 1 <= i <= n_blocks, (i, n_blocks)
    index = i - 1
    head_dim = values["head_dim"] or h // values["heads"]
    if values["kv_lora"]:
        attention: nn.Module = LatentAttention(h, values["heads"], head_dim, values["q_lora"], values["kv_lora"],
                                               values["rope_dim"], values["v_dim"])
    else:
        windowed = values["window"] and index % values["window_period"] == 0
        attention = GroupedQueryAttention(h, values["heads"], values["kv_heads"], head_dim,
                                          qkv_bias=bool(values["qkv_bias"]), o_bias=bool(values["o_bias"]),
                                          qk_norm=bool(values["qk_norm"]), sinks=bool(values["sinks"]),
                                          window=values["window"] if windowed else 0)
    if index < values["dense_layers"]:
        feed_forward: nn.Module = SwiGLU(h, values["ffn"])
    else:
        feed_forward = Mixture(h, values["experts"], values["topk"], values["expert_ffn"],
                               values["shared_experts"] * values["expert_ffn"],
                               router_bias=bool(values["router_bias"]), expert_bias=bool(values["expert_bias"]),
                               sigmoid=bool(values["sigmoid"]), swiglu_clamp=values["swiglu_clamp"],
                               moe_index=index - values["dense_layers"])
    return MoeBlock(h, attention, feed_forward, n_blocks)
