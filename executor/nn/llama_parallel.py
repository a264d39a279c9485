"""The ``llama`` layers split over a tensor-parallel group of T processes (Megatron-LM, arXiv 1909.08053 §3, as for
``gpt`` in :mod:`executor.nn.gpt_parallel`).

Each module is one shard of the matching :mod:`executor.nn.llama` layer, made from that layer as the seed built it
(:func:`shard_layer`), so the T shards together are the single-process layer, split:

* ``block``: q, k and v are column-parallel by heads (shard t holds query heads ``[t·a/T, (t+1)·a/T)`` and key/value
  heads ``[t·g/T, (t+1)·g/T)``, so each shard's query heads keep their own key/value head: grouped-query attention
  needs no communication), with their biases; QK-norm's weights (one per head dimension; their gradients summed over
  the group, since each shard normalises only its heads) and both RMSNorms are replicated; o is row-parallel; the
  SwiGLU's gate and up are column-parallel by its width and down row-parallel. ``f`` stands before each
  column-parallel group and ``g`` after each row-parallel Linear.
* ``embed``: the token table is vocabulary-parallel (padded to ``V' = padded_vocab(V, T)`` rows); each shard looks up
  the tokens it holds, zero elsewhere, and ``g`` sums the shards.
* ``head``: the final RMSNorm is replicated; ``f`` then the vocabulary-parallel LM head, whose logits go to the
  vocabulary-parallel cross entropy (:func:`executor.nn.gpt_parallel.parallel_loss`).

Parameter counts equal ``sim.models.build_model(spec, Sharding(tp=T))`` layer for layer, which the tests check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.nn import gpt_parallel
from executor.nn.context_parallel import ContextParallel
from executor.nn.llama import LlamaBlock, LlamaEmbedding, LlamaHead, rotate_and_attend
from executor.nn.tensor_parallel import TensorParallelComm, copy_to_region, reduce_from_region
from sim.models.sharding import padded_vocab

__all__ = ["ParallelLlamaEmbedding", "ParallelLlamaBlock", "ParallelLlamaHead", "shard_layer", "unshard_state"]

#: How each parameter of a whole layer is split (``gpt_parallel.shard_state``'s kinds); absent: replicated.
_SPLITS = {
    "token.weight": "vocab", "out.weight": "vocab",
    "q.weight": "rows", "q.bias": "rows", "k.weight": "rows", "k.bias": "rows", "v.weight": "rows", "v.bias": "rows",
    "o.weight": "cols", "gate.weight": "rows", "up.weight": "rows", "down.weight": "cols",
}


class ParallelLlamaEmbedding(nn.Module):
    """Shard of ``embed``: the vocabulary-parallel token table, ``g`` on the lookup."""

    def __init__(self, vocab: int, hidden: int, comm: TensorParallelComm) -> None:
        super().__init__()
        self.comm = comm
        self.rows = padded_vocab(vocab, comm.size) // comm.size
        self.first = comm.rank * self.rows
        self.token = nn.Embedding(self.rows, hidden)

    def forward(self, ids: Tensor) -> Tensor:
        """(n, s) int64 token ids → (n, s, h) fp32, the same on every shard."""
        return gpt_parallel.vocab_parallel_lookup(self.token, ids, self.first, self.comm)


class ParallelLlamaBlock(nn.Module):
    """Shard of ``block{i}``: this shard's query and key/value heads and SwiGLU columns (module docstring). Built
    from the whole :class:`~executor.nn.llama.LlamaBlock` for its shapes and flags."""

    def __init__(self, whole: LlamaBlock, comm: TensorParallelComm) -> None:
        super().__init__()
        size = comm.size
        self.comm, self.head_dim, self.window = comm, whole.head_dim, whole.window
        #: Under context parallelism, this process's place in its group (set by ``executor.parallel``).
        self.context: ContextParallel | None = None
        self.heads, self.kv_heads = whole.heads // size, whole.kv_heads // size
        hidden, ffn = whole.q.in_features, whole.gate.out_features // size
        bias = whole.q.bias is not None
        self.input_norm = nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim) if whole.q_norm is not None else None
        self.k_norm = nn.RMSNorm(self.head_dim) if whole.k_norm is not None else None
        self.o = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.post_attention_norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 → the same, on every shard."""
        n, s, _ = x.shape
        normed = copy_to_region(self.input_norm(x), self.comm)
        q = self.q(normed).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.k(normed).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v(normed).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            # The QK-norm weights are whole on every shard but see only its heads: f on the weight sums their
            # gradients over the group (a 2d-parameter all-reduce the cost model leaves out).
            q = F.rms_norm(q, (self.head_dim,), copy_to_region(self.q_norm.weight, self.comm), self.q_norm.eps)
            k = F.rms_norm(k, (self.head_dim,), copy_to_region(self.k_norm.weight, self.comm), self.k_norm.eps)
        attended = rotate_and_attend(q, k, v, self.window, self.context)
        partial = self.o(attended.transpose(1, 2).reshape(n, s, self.heads * self.head_dim))
        x = x + reduce_from_region(partial, self.comm)
        normed = copy_to_region(self.post_attention_norm(x), self.comm)
        partial = self.down(F.silu(self.gate(normed)) * self.up(normed))
        return x + reduce_from_region(partial, self.comm)


class ParallelLlamaHead(nn.Module):
    """Shard of ``head``: the replicated final RMSNorm, ``f``, this shard's vocabulary rows of the LM head."""

    def __init__(self, hidden: int, vocab: int, comm: TensorParallelComm) -> None:
        super().__init__()
        self.comm = comm
        self.rows = padded_vocab(vocab, comm.size) // comm.size
        self.norm = nn.RMSNorm(hidden)
        self.out = nn.Linear(hidden, self.rows, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 → (n, s, V'/T) logits of this shard's rows."""
        return self.out(copy_to_region(self.norm(x), self.comm))


def shard_layer(layer: nn.Module, values: Mapping[str, int], comm: TensorParallelComm) -> nn.Module:
    """This process's shard of a whole, initialised :mod:`executor.nn.llama` layer, its parameters copied from the
    layer's."""
    with torch.random.fork_rng(devices=[]):  # the constructors' initialisation is overwritten below
        if isinstance(layer, LlamaEmbedding):
            shard: nn.Module = ParallelLlamaEmbedding(values["vocab"], values["hidden"], comm)
        elif isinstance(layer, LlamaBlock):
            shard = ParallelLlamaBlock(layer, comm)
        elif isinstance(layer, LlamaHead):
            shard = ParallelLlamaHead(values["hidden"], values["vocab"], comm)
        else:
            raise TypeError(f"no tensor-parallel shard of {type(layer).__name__}")
    shard.load_state_dict(gpt_parallel.shard_state(layer.state_dict(), comm.rank, comm.size, splits=_SPLITS,
                                                   local_names={}))
    return shard


def unshard_state(shards: Sequence[Mapping[str, Tensor]], vocab: int) -> dict[str, Tensor]:
    """The whole layer's state dict from its shards' (shard 0 first): the inverse of :func:`shard_layer`'s split."""
    return gpt_parallel.unshard_state(shards, vocab, splits=_SPLITS, local_names={})
