"""The ``gpt`` layers split over a tensor-parallel group of T processes (Megatron-LM, arXiv 1909.08053 §3).

Each module here is one shard of the matching :mod:`executor.nn.gpt` layer, made from that layer as the seed built
it (:func:`shard_layer`), so the T shards together ARE the single-process layer, split:

* ``block``: the fused QKV projection and the MLP's up projection are column-parallel (shard t holds attention heads
  ``[t·a/T, (t+1)·a/T)``, i.e. the rows of Q, K and V for those heads, and rows ``[t·4h/T, (t+1)·4h/T)`` of the
  up projection, with their biases); the attention output and the MLP's down projection are row-parallel (the
  matching input columns, no bias in the matmul: the bias is added once, after the all-reduce); both LayerNorms are
  replicated. ``f`` stands before each column-parallel Linear and ``g`` after each row-parallel one.
* ``embed``: the token table is vocabulary-parallel (rows ``[t·V'/T, (t+1)·V'/T)`` of the table padded to
  ``V' = padded_vocab(V, T)`` rows; padding rows are zero and never looked up); each shard looks up the tokens it
  holds, zero elsewhere, and ``g`` sums the shards. The position table is replicated.
* ``head``: the final LayerNorm is replicated; ``f`` then the vocabulary-parallel LM head, whose (n, s, V'/T) logits
  go to :func:`executor.nn.tensor_parallel.vocab_parallel_cross_entropy` (padding columns take no probability).

Parameter counts equal ``sim.models.build_model(spec, Sharding(tp=T))`` layer for layer (block
``12h²/T + 7h/T + 6h``, embed ``V'h/T + sh``, head ``2h + V'h/T``), which the tests check.

The sharded Linears are plain ``nn.Linear`` modules (a row-parallel one without bias, its bias a separate
``proj_bias``/``down_bias`` parameter), so zero-bubble's split backward (``executor.nn.split_backward``) defers their
weight gradients as it does the single-process model's. :func:`unshard_state` maps the T shards' state dicts back to
the whole layer's names and shapes (``--save-state`` writes whole layers whatever the parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.nn.gpt import GPTBlock, GPTEmbedding, GPTHead
from executor.nn.tensor_parallel import (
    TensorParallelComm,
    copy_to_region,
    reduce_from_region,
    vocab_parallel_cross_entropy,
)
from sim.models.sharding import padded_vocab

__all__ = ["ParallelEmbedding", "ParallelBlock", "ParallelHead", "shard_layer", "shard_state", "unshard_state",
           "parallel_loss", "vocab_parallel_lookup"]

#: How each parameter of a whole layer is split, by its name in the whole layer: ``rows`` (dim 0 in T equal
#: parts), ``qkv`` (dim 0 as three blocks Q, K, V, each split in T), ``cols`` (dim 1), ``vocab`` (dim 0 after
#: padding to a multiple of T rows); absent: replicated.
_SPLITS = {
    "token.weight": "vocab", "out.weight": "vocab",
    "qkv.weight": "qkv", "qkv.bias": "qkv", "up.weight": "rows", "up.bias": "rows",
    "proj.weight": "cols", "down.weight": "cols",
}
#: A whole layer's parameter name → the shard module's, where they differ (row-parallel biases stand apart).
_LOCAL_NAME = {"proj.bias": "proj_bias", "down.bias": "down_bias"}


def shard_state(state: Mapping[str, Tensor], t: int, size: int, *, splits: Mapping[str, str] = _SPLITS,
                local_names: Mapping[str, str] = _LOCAL_NAME) -> dict[str, Tensor]:
    """Shard ``t`` of ``size`` of a whole layer's state dict, under the shard module's names (copies).

    Args:
        splits: how each parameter is split, by its whole-layer name (:data:`_SPLITS`'s kinds; the gpt layers'
            by default, ``executor.nn.llama_parallel`` passes its own).
        local_names: whole-layer names that the shard module names otherwise.
    """
    shards: dict[str, Tensor] = {}
    for name, full in state.items():
        how = splits.get(name)
        if how == "vocab":
            rows = padded_vocab(full.shape[0], size)
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        if how == "qkv":
            part = torch.cat([block.chunk(size, dim=0)[t] for block in full.chunk(3, dim=0)])
        elif how in ("rows", "vocab"):
            part = full.chunk(size, dim=0)[t]
        elif how == "cols":
            part = full.chunk(size, dim=1)[t]
        else:
            part = full
        shards[local_names.get(name, name)] = part.clone()
    return shards


def unshard_state(shards: Sequence[Mapping[str, Tensor]], vocab: int, *, splits: Mapping[str, str] = _SPLITS,
                  local_names: Mapping[str, str] = _LOCAL_NAME) -> dict[str, Tensor]:
    """The whole layer's state dict from its shards' (in shard order): the inverse of :func:`shard_state`.

    Args:
        shards: each shard module's ``state_dict()``, shard 0 first.
        vocab: V, the model's vocabulary: vocabulary-parallel tables lose their padding rows.
        splits, local_names: as for :func:`shard_state`.
    """
    whole: dict[str, Tensor] = {}
    back = {local: name for name, local in local_names.items()}
    for local in shards[0]:
        name = back.get(local, local)
        parts = [shard[local] for shard in shards]
        how = splits.get(name)
        if how == "qkv":
            whole[name] = torch.cat([torch.cat([p.chunk(3, dim=0)[k] for p in parts]) for k in range(3)])
        elif how in ("rows", "vocab"):
            whole[name] = torch.cat(parts)[:vocab] if how == "vocab" else torch.cat(parts)
        elif how == "cols":
            whole[name] = torch.cat(parts, dim=1)
        else:
            whole[name] = parts[0]
        whole[name] = whole[name].clone()
    return whole


class ParallelEmbedding(nn.Module):
    """Shard of ``embed``: vocabulary-parallel token table, replicated position table, ``g`` on the lookup."""

    def __init__(self, vocab: int, seq: int, hidden: int, comm: TensorParallelComm) -> None:
        super().__init__()
        self.comm = comm
        self.rows = padded_vocab(vocab, comm.size) // comm.size
        self.first = comm.rank * self.rows
        self.token = nn.Embedding(self.rows, hidden)
        self.position = nn.Embedding(seq, hidden)

    def forward(self, ids: Tensor) -> Tensor:
        """(n, s') int64 token ids -> (n, s', h) fp32, the same on every shard."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        return vocab_parallel_lookup(self.token, ids, self.first, self.comm) + self.position(positions)


def vocab_parallel_lookup(table: nn.Embedding, ids: Tensor, first: int, comm: TensorParallelComm) -> Tensor:
    """The embeddings of ``ids`` from a vocabulary-parallel ``table`` holding rows ``[first, first + rows)``: each
    shard looks up the tokens it holds, exactly zero for the others, and ``g`` sums the shards."""
    mine = (ids >= first) & (ids < first + table.num_embeddings)
    local = table(torch.where(mine, ids - first, torch.zeros_like(ids)))
    return reduce_from_region(local * mine.unsqueeze(-1).to(local.dtype), comm)


class ParallelBlock(nn.Module):
    """Shard of ``block{i}``: heads ``[t·a/T, (t+1)·a/T)`` and MLP columns ``[t·4h/T, (t+1)·4h/T)``."""

    def __init__(self, hidden: int, heads: int, comm: TensorParallelComm) -> None:
        super().__init__()
        size = comm.size
        assert heads % size == 0, (heads, size)  # sim.models.gpt refuses a tp that does not divide heads
        self.comm, self.heads, self.width = comm, heads // size, hidden // size
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * self.width)
        self.proj = nn.Linear(self.width, hidden, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(hidden))
        self.ln2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * self.width)
        self.gelu = nn.GELU(approximate="tanh")
        self.down = nn.Linear(4 * self.width, hidden, bias=False)
        self.down_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 -> (n, s, h) fp32, the same on every shard."""
        n, s, _ = x.shape
        q, k, v = self.qkv(copy_to_region(self.ln1(x), self.comm)).split(self.width, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, self.width // self.heads)).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = self.proj(attended.transpose(1, 2).reshape(n, s, self.width))
        x = x + (reduce_from_region(partial, self.comm) + self.proj_bias)
        partial = self.down(self.gelu(self.up(copy_to_region(self.ln2(x), self.comm))))
        return x + (reduce_from_region(partial, self.comm) + self.down_bias)


class ParallelHead(nn.Module):
    """Shard of ``head``: replicated final LayerNorm, ``f``, the LM head's vocabulary rows of this shard."""

    def __init__(self, hidden: int, vocab: int, comm: TensorParallelComm) -> None:
        super().__init__()
        self.comm = comm
        self.rows = padded_vocab(vocab, comm.size) // comm.size
        self.first = comm.rank * self.rows
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, self.rows, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 -> (n, s, V'/T) fp32 logits of this shard's vocabulary rows."""
        return self.out(copy_to_region(self.ln(x), self.comm))


def shard_layer(layer: nn.Module, values: Mapping[str, int], comm: TensorParallelComm) -> nn.Module:
    """This process's shard of a whole, initialised :mod:`executor.nn.gpt` layer: the shard module, its parameters
    copied from the layer's (:func:`shard_state`)."""
    # The constructors' own initialisation is overwritten below; forking the RNG keeps the global stream untouched.
    with torch.random.fork_rng(devices=[]):
        shard = _empty_shard(layer, values, comm)
    shard.load_state_dict(shard_state(layer.state_dict(), comm.rank, comm.size))
    return shard


def _empty_shard(layer: nn.Module, values: Mapping[str, int], comm: TensorParallelComm) -> nn.Module:
    h = values["hidden"]
    if isinstance(layer, GPTEmbedding):
        shard: nn.Module = ParallelEmbedding(values["vocab"], values["seq"], h, comm)
    elif isinstance(layer, GPTBlock):
        shard = ParallelBlock(h, values["heads"], comm)
    elif isinstance(layer, GPTHead):
        shard = ParallelHead(h, values["vocab"], comm)
    else:
        raise TypeError(f"no tensor-parallel shard of {type(layer).__name__}")
    return shard


def parallel_loss(values: Mapping[str, int], comm: TensorParallelComm):
    """``loss(shard's logits, targets) -> ()``: the mean cross entropy over the group's vocabulary shards."""
    rows = padded_vocab(values["vocab"], comm.size) // comm.size

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits, targets, comm, first=comm.rank * rows, vocab=values["vocab"])

    return loss
