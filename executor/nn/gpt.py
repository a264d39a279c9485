"""Torch layers of the ``gpt`` model: GPT-2 style embedding, pre-LN decoder blocks and an untied LM head.

Mirrors ``sim/models/gpt.py`` layer for layer; the parameter counts there (block ``12h^2 + 13h``, embed
``V*h + s*h``, head ``2h + V*h``) are exact for these modules, and ``tests/executor/nn/test_stages.py`` checks it.

Notation: n = samples in the microbatch, s = sequence length, h = hidden size, a = attention heads, d = h / a,
V = vocabulary size, L = number of decoder blocks.

Differences from the simulator's picture, none of which changes a parameter count or an activation shape:

* dtype: the graph's ``dtype_bytes = 2`` describes mixed-precision fp16 training on a GPU; these modules train in
  fp32 on CPU, where fp16 kernels are slow or missing and fp32 keeps the executor's numeric checks tight.
  Parameter and element *counts* match the graph; the graph's bytes are count x ``graph.dtype_bytes``.
* dropout: none (p = 0). The graph budgets dropout masks in ``saved_bytes`` because real GPU training keeps them,
  but a random mask would make pipeline and single-process runs differ; memory is the simulator's business.
* GELU: the tanh approximation GPT-2 used (Radford et al. 2019, code ``gelu``), so the numbers are GPT-2's.

Initialisation (GPT-2, Radford et al. 2019, §2.3 and its released code): every Linear and Embedding weight is
N(0, 0.02^2), biases are 0, LayerNorms are (weight 1, bias 0), and the two projections that write into the
residual stream (attention output, MLP down) are scaled by 1/sqrt(2L) so the residual's variance does not grow
with depth. The scale depends on L, a property of the spec, never of the stage split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["INIT_STD", "GPTEmbedding", "GPTBlock", "GPTHead", "make_layer", "make_batch", "loss"]

INIT_STD = 0.02  # GPT-2's weight init standard deviation


class GPTEmbedding(nn.Module):
    """Layer ``embed``: token embedding (V x h) plus learned position embedding (s x h).

    Args:
        vocab: V, rows of the token table.
        seq: s, rows of the position table (the longest sequence the model accepts).
        hidden: h, the embedding width.
    """

    def __init__(self, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq, hidden)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator``: both tables N(0, 0.02^2)."""
        with torch.no_grad():
            self.token.weight.normal_(0.0, INIT_STD, generator=generator)
            self.position.weight.normal_(0.0, INIT_STD, generator=generator)

    def forward(self, ids: Tensor) -> Tensor:
        """Embed token ids.

        Args:
            ids: (n, s') int64 token ids in ``[0, V)``, s' <= s.

        Returns:
            (n, s', h) fp32 hidden states.
        """
        positions = torch.arange(ids.shape[1], device=ids.device)
        # (n, s', h) + (s', h): every sample gets the same position vectors.
        return self.token(ids) + self.position(positions)


class GPTBlock(nn.Module):
    """Layer ``block{i}``: one pre-LN GPT-2 decoder block.

    ``x + Attn(LN1(x))`` then ``x + MLP(LN2(x))``, with causal multi-head self-attention through a fused QKV
    projection and a 4h-wide GELU MLP, every Linear with a bias.

    Args:
        hidden: h.
        heads: a; must divide h (``sim.models.gpt`` already rejects specs where it does not).
        n_blocks: L, the model's block count, for the 1/sqrt(2L) residual-projection init.
    """

    def __init__(self, hidden: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        assert hidden % heads == 0, (hidden, heads)  # the spec parser enforces it
        self.heads = heads
        self.n_blocks = n_blocks
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.gelu = nn.GELU(approximate="tanh")
        self.down = nn.Linear(4 * hidden, hidden)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator`` (GPT-2 scheme, module docstring), in a fixed order."""
        residual_std = INIT_STD / math.sqrt(2 * self.n_blocks)
        with torch.no_grad():
            for norm in (self.ln1, self.ln2):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
            for linear, std in (
                (self.qkv, INIT_STD),
                (self.proj, residual_std),
                (self.up, INIT_STD),
                (self.down, residual_std),
            ):
                linear.weight.normal_(0.0, std, generator=generator)
                linear.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: (n, s, h) fp32 hidden states.

        Returns:
            (n, s, h) fp32 hidden states.
        """
        n, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        # (n, s, h) -> (n, a, s, d): scaled_dot_product_attention treats every dim before the last two as batch.
        q, k, v = (t.unflatten(-1, (self.heads, h // self.heads)).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, s, h))
        return x + self.down(self.gelu(self.up(self.ln2(x))))


class GPTHead(nn.Module):
    """Layer ``head``: final LayerNorm and the LM head Linear(h, V) without bias, untied from the token table.

    Returns the logits; the cross-entropy that ``sim.models.gpt`` also counts in this layer is :func:`loss`,
    applied by whoever holds the targets (see ``executor.nn.stages``, "Head and loss").

    Args:
        hidden: h.
        vocab: V.
    """

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator``: LN (1, 0), LM head N(0, 0.02^2)."""
        with torch.no_grad():
            self.ln.weight.fill_(1.0)
            self.ln.bias.zero_()
            self.out.weight.normal_(0.0, INIT_STD, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        """Map hidden states to next-token logits.

        Args:
            x: (n, s, h) fp32 hidden states.

        Returns:
            (n, s, V) fp32 logits.
        """
        return self.out(self.ln(x))


def make_layer(values: dict[str, int], i: int) -> nn.Module:
    """The uninitialised module of graph layer ``i`` (0 = embed, 1..L = blocks, L + 1 = head).

    Args:
        values: the canonical spec's keys: ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab``.
        i: layer index in ``[0, L + 2)``.
    """
    n_blocks, h = values["layers"], values["hidden"]
    if i == 0:
        return GPTEmbedding(values["vocab"], values["seq"], h)
    if i <= n_blocks:
        return GPTBlock(h, values["heads"], n_blocks)
    assert i == n_blocks + 1, (i, n_blocks)
    return GPTHead(h, values["vocab"])


def make_batch(values: dict[str, int], num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Uniformly random token sequences and their next-token targets.

    One (n, s + 1) sequence is drawn and split, so ``targets[:, t] == ids[:, t + 1]`` for t < s - 1: the usual
    language-model shift, with the last target being the token that would follow the window.

    Returns:
        ids: (n, s) int64 in ``[0, V)``; targets: (n, s) int64 in ``[0, V)``.
    """
    tokens = torch.randint(values["vocab"], (num_samples, values["seq"] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all n x s token positions.

    Args:
        logits: (n, s, V) fp32, the head's output.
        targets: (n, s) int64 next-token ids.

    Returns:
        () fp32 scalar.
    """
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
