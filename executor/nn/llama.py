"""Torch layers of the ``llama`` model: token embedding, pre-norm decoder blocks with grouped-query attention and a
SwiGLU, and an LM head.

Mirrors ``sim/models/llama.py`` layer for layer; the parameter counts there are exact for these modules
(``tests/executor/nn/test_llama.py``), and the simulator's forward FLOPs of a block equal what
``torch.utils.flop_counter.FlopCounterMode`` counts on :class:`LlamaBlock`.

Notation as there: n samples, s sequence, h hidden, a query heads, g key/value heads, d head dimension, f the SwiGLU's
inner width, V vocabulary.

Differences from the simulator's picture, none of which changes a parameter count or an activation shape:

* dtype: the graph's bf16 describes mixed-precision training on a GPU; these modules train in fp32 on the CPU, as
  ``executor.nn.gpt`` does (the numeric checks against a single process stay tight).
* rotary base: 10,000 (Su et al. 2021, RoFormer §3.4.2). The spec does not record a config's ``rope_theta``: it
  changes no cost, and any base trains.
* tied embeddings: refused (:func:`check_values`): the LM head would need the token table, which lives in another layer
  and, under pipelining, on another rank.

Batches and the loss are ``executor.nn.gpt``'s: random token sequences with their next-token targets, and the mean
cross entropy over every position (``executor.nn.stages`` registers them for both families).

Initialisation: every Linear and Embedding weight N(0, 0.02²), the two projections that write into the residual
stream (o and down) scaled by 1/√(2L) as GPT-2 does, biases 0, norms 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.nn.context_parallel import ContextParallel, causal_mask, gather_sequence, local_positions
from sim.core.errors import SpecError

__all__ = ["INIT_STD", "ROPE_BASE", "LlamaEmbedding", "LlamaBlock", "LlamaHead", "check_values", "make_layer",
           "rotation", "window_mask", "rotate_and_attend"]

INIT_STD = 0.02
ROPE_BASE = 10_000.0


class LlamaEmbedding(nn.Module):
    """Layer ``embed``: the token table (V × h); positions come later, as rotations inside attention."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, hidden)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill the table from ``generator``: N(0, 0.02²)."""
        with torch.no_grad():
            self.token.weight.normal_(0.0, INIT_STD, generator=generator)

    def forward(self, ids: Tensor) -> Tensor:
        """(n, s) int64 token ids → (n, s, h) fp32 hidden states."""
        return self.token(ids)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (n, heads, s, d): each pair (x_i, x_{i + d/2}) rotated by its position's
    angle (the half-split pairing of the HuggingFace Llama code)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def rotation(head_dim: int, s: int, device: torch.device, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles of positions ``0 .. s-1`` (or of ``positions``, s of them), (s, d), the two
    halves repeated (RoFormer §3.4.2, base :data:`ROPE_BASE`)."""
    inverse = ROPE_BASE ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    where = torch.arange(s, device=device) if positions is None else positions
    angles = torch.outer(where.to(torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_and_attend(q: Tensor, k: Tensor, v: Tensor, window: int, context: ContextParallel | None) -> Tensor:
    """Rotate q (n, a, s, d) and k (n, g, s, d) by their positions and attend causally (grouped-query where g < a):
    over the sequence, or under context parallelism (``context``) the local tokens' queries over the whole sequence,
    its keys and values gathered from the group (:mod:`executor.nn.context_parallel`)."""
    s, head_dim, gqa = q.shape[2], q.shape[3], k.shape[1] != q.shape[1]
    if context is None:
        cos, sin = rotation(head_dim, s, q.device)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        mask = window_mask(window, s, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    length = s * context.size
    cos, sin = rotation(head_dim, s, q.device, local_positions(length, context, q.device))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = gather_sequence(k, context), gather_sequence(v, context)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(length, context, q.device), enable_gqa=gqa)


def window_mask(window: int, s: int, device: torch.device) -> Tensor | None:
    """The sliding window's boolean mask (query i sees keys i − window < j ≤ i), or ``None`` for plain causal
    attention (no window, or one no shorter than the sequence)."""
    if not window or window >= s:
        return None
    position = torch.arange(s, device=device)
    offset = position[:, None] - position[None, :]
    return (offset >= 0) & (offset < window)


class LlamaBlock(nn.Module):
    """Layer ``block{i}``: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``.

    Args:
        hidden: h.
        heads: a.
        kv_heads: g, dividing a.
        head_dim: d (even: rotary embeddings rotate pairs).
        ffn: f.
        n_blocks: L, for the 1/√(2L) residual-projection init.
        qkv_bias: biases on q, k and v.
        qk_norm: an RMSNorm of d on each head's q and k, before the rotation (Qwen 3).
        window: sliding-window attention's window in tokens, 0 for full causal attention.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, n_blocks: int, *,
                 qkv_bias: bool, qk_norm: bool, window: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.n_blocks, self.window = n_blocks, window
        #: Under context parallelism, this process's place in its group (set by ``executor.parallel``).
        self.context: ContextParallel | None = None
        self.input_norm = nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim) if qk_norm else None
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator`` (module docstring), in a fixed order."""
        residual_std = INIT_STD / math.sqrt(2 * self.n_blocks)
        with torch.no_grad():
            for norm in (self.input_norm, self.post_attention_norm, self.q_norm, self.k_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            for linear, std in ((self.q, INIT_STD), (self.k, INIT_STD), (self.v, INIT_STD), (self.o, residual_std),
                                (self.gate, INIT_STD), (self.up, INIT_STD), (self.down, residual_std)):
                linear.weight.normal_(0.0, std, generator=generator)
                if linear.bias is not None:
                    linear.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 hidden states → the same shape."""
        n, s, _ = x.shape
        normed = self.input_norm(x)
        q = self.q(normed).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.k(normed).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v(normed).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        attended = rotate_and_attend(q, k, v, self.window, self.context)
        x = x + self.o(attended.transpose(1, 2).reshape(n, s, self.heads * self.head_dim))
        normed = self.post_attention_norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


class LlamaHead(nn.Module):
    """Layer ``head``: the final RMSNorm and the LM head Linear(h, V) without bias; returns the logits (the loss is
    :func:`loss`, as for ``executor.nn.gpt``)."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Norm 1, LM head N(0, 0.02²)."""
        with torch.no_grad():
            self.norm.weight.fill_(1.0)
            self.out.weight.normal_(0.0, INIT_STD, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) → (n, s, V) fp32 logits."""
        return self.out(self.norm(x))


def check_values(values: dict[str, int]) -> None:
    """Refuse, before anything is built, what these modules do not run.

    Raises:
        SpecError: tied embeddings (module docstring), or an odd head dimension (rotary embeddings rotate pairs).
    """
    if values["tied"]:
        raise SpecError("the executor does not run tied embeddings (tied=1): the LM head would need the token table "
                        "of another layer")
    head_dim = values["head_dim"] or values["hidden"] // values["heads"]
    if head_dim % 2:
        raise SpecError(f"rotary embeddings rotate pairs: the head dimension must be even, got {head_dim}")


def make_layer(values: dict[str, int], i: int) -> nn.Module:
    """The uninitialised module of graph layer ``i`` (0 = embed, 1..L = blocks, L + 1 = head); the values passed
    :func:`check_values`."""
    n_blocks, h = values["layers"], values["hidden"]
    head_dim = values["head_dim"] or h // values["heads"]
    if i == 0:
        return LlamaEmbedding(values["vocab"], h)
    if i <= n_blocks:
        return LlamaBlock(h, values["heads"], values["kv_heads"], head_dim, values["ffn"], n_blocks,
                          qkv_bias=bool(values["qkv_bias"]), qk_norm=bool(values["qk_norm"]),
                          window=values["window"])
    assert i == n_blocks + 1, (i, n_blocks)
    return LlamaHead(h, values["vocab"])
