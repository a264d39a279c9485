"""Megatron tensor parallelism's building blocks: the group's timed collectives, the f and g operators, and the
vocabulary-parallel cross entropy (Shoeybi et al. 2019, arXiv 1909.08053 §3).

A tensor-parallel group of T processes runs one pipeline rank's program in lock step; each holds a 1/T shard of every
layer (:mod:`executor.nn.gpt_parallel`) and the shards meet in collectives that sit *inside* the forward and
backward passes, exactly where Megatron puts them:

* ``f`` (:func:`copy_to_region`): identity in the forward, all-reduce of the gradient in the backward. It stands
  before every column-parallel Linear, whose input each shard sees whole and whose input gradient each shard only
  knows its part of.
* ``g`` (:func:`reduce_from_region`): all-reduce in the forward, identity in the backward. It stands after every
  row-parallel Linear (each shard holds a partial sum) and after the vocabulary-parallel embedding (each shard
  looked up only its own rows).
* :func:`vocab_parallel_cross_entropy`: the loss over logits split by vocabulary, with three all-reduces of one
  fp32 value per token (the maximum, the target's logit, the sum of exponentials) and a purely local backward.

:class:`TensorParallelComm` runs every one of them and adds up the seconds spent inside the collective calls, so
that the interpreter can report them as the plan's ``TP_F``/``TP_B``/``TP_R`` span after the compute op that ran
them (``executor.nn.collective_clock``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from executor.nn.collective_clock import CollectiveClock

__all__ = ["TensorParallelComm", "copy_to_region", "reduce_from_region", "vocab_parallel_cross_entropy"]


class TensorParallelComm(CollectiveClock):
    """One process's tensor-parallel group of T shards (``rank`` its shard index), and a clock of the time its
    collectives take (:class:`executor.nn.collective_clock.CollectiveClock`)."""

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """All-reduce ``tensor`` in place over the group (timed); returns it."""
        self.timed(lambda: dist.all_reduce(tensor, op=op, group=self.group))
        return tensor


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: the input passes unchanged; its gradient is summed over the group."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TensorParallelComm) -> Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return ctx.comm.all_reduce(grad.clone()), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: the partial outputs are summed over the group; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: TensorParallelComm) -> Tensor:  # type: ignore[override]
        return comm.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


def copy_to_region(x: Tensor, comm: TensorParallelComm) -> Tensor:
    """f: identity forward, all-reduce backward (before a column-parallel layer)."""
    return _CopyToRegion.apply(x, comm)


def reduce_from_region(x: Tensor, comm: TensorParallelComm) -> Tensor:
    """g: all-reduce forward, identity backward (after a row-parallel layer or the vocabulary-parallel lookup)."""
    return _ReduceFromRegion.apply(x, comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy over tokens whose logits are split by vocabulary rows ``[first, first + V/T)``."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, comm: TensorParallelComm, first: int,  # type: ignore[override]
                vocab: int) -> Tensor:
        local = logits.reshape(-1, logits.shape[-1])
        rows = local.shape[1]
        if first + rows > vocab:  # padding rows (vocab rounded up to a multiple of T) are never a class
            local = local.clone()
            local[:, max(0, vocab - first):] = float("-inf")
        maximum = comm.all_reduce(local.max(dim=1).values, dist.ReduceOp.MAX)
        shifted = local - maximum.unsqueeze(1)
        flat = targets.reshape(-1)
        mine = (flat >= first) & (flat < first + rows)
        index = torch.where(mine, flat - first, torch.zeros_like(flat))
        picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1)
        target_logit = comm.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)))
        exp = shifted.exp()
        total = comm.all_reduce(exp.sum(dim=1))
        softmax = exp / total.unsqueeze(1)
        ctx.save_for_backward(softmax, index, mine)
        ctx.shape = logits.shape
        return (total.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        softmax, index, mine = ctx.saved_tensors
        # d(mean loss)/d(logit) = (softmax - one-hot of the target) / tokens; each shard owns its own columns.
        result = softmax.clone()
        rows = torch.arange(result.shape[0], device=result.device)
        result[rows, index] -= mine.to(result.dtype)
        result *= grad / result.shape[0]
        return result.reshape(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, comm: TensorParallelComm, *, first: int,
                                 vocab: int) -> Tensor:
    """Mean cross entropy of this shard's logits, the same on every shard of the group.

    Args:
        logits: (..., V/T) fp32, this shard's vocabulary columns ``[first, first + V/T)`` of the LM head's output.
        targets: (...) int64 class indices in ``[0, vocab)``.
        comm: the tensor-parallel group.
        first: the global index of this shard's first vocabulary row.
        vocab: V, the model's vocabulary; columns at ``vocab`` or beyond are padding and take no probability.

    Returns:
        () fp32: the mean over tokens of ``log Σ_v exp(z_v) − z_target``, computed from the max-shifted logits as
        Megatron's ``vocab_parallel_cross_entropy`` does.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, comm, first, vocab)
