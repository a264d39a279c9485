"""Context parallelism in the executor's Llama-family layers: each sequence split over the C processes of a
context-parallel group with the causal load balance the simulator costs (``sim.cost.context_parallel``: 2C chunks,
process c holding chunks c and 2C − 1 − c), keys and values all-gathered for attention (``--cp-comm allgather``'s
form; on these CPU ranks the ring's steps would compute the same numbers in C pieces).

* The data: every process of a group reads its replica's microbatch and keeps its own two chunks of the tokens and
  of the targets (:func:`local_tokens`); the loss is the mean over its own tokens, and the data-parallel reduction,
  which spans the group (``sim.ir.parallel``), averages the C equal parts into the mean over the whole sequence.
* A block: queries, keys and values of its own tokens, rotated by their positions in the whole sequence
  (:func:`local_positions`); the keys and values of the group gathered in sequence order (:func:`gather_sequence`,
  whose backward sums each process's gradient of the gathered tensor and keeps its own part: a reduce-scatter);
  attention of the local queries over the whole sequence with the causal mask of their true positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ContextParallel", "local_positions", "local_tokens", "gather_sequence", "causal_mask"]


@dataclass(frozen=True)
class ContextParallel:
    """This process's place in its context-parallel group.

    Attributes:
        group: the process group of the C processes that split the replica's sequences.
        part: this process's index c in the group.
        size: C.
    """

    group: Any
    part: int
    size: int


def _chunks(length: int, part: int, size: int) -> tuple[range, range]:
    chunk = length // (2 * size)
    return (range(part * chunk, (part + 1) * chunk),
            range((2 * size - 1 - part) * chunk, (2 * size - part) * chunk))


def local_positions(length: int, context: ContextParallel, device: torch.device) -> Tensor:
    """Positions in the whole sequence of ``length`` of the tokens this process holds, in its order."""
    first, second = _chunks(length, context.part, context.size)
    return torch.tensor([*first, *second], device=device, dtype=torch.long)


def local_tokens(tensor: Tensor, context: ContextParallel) -> Tensor:
    """This process's two chunks of ``tensor``'s sequence dimension (dim 1), e.g. token ids (n, s) → (n, s / C)."""
    return tensor.index_select(1, local_positions(tensor.shape[1], context, tensor.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of (n, heads, s / C, d)), reordered into the whole sequence."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, context: ContextParallel) -> Tensor:  # type: ignore[override]
        ctx.context = context
        size, length = context.size, local.shape[2] * context.size
        gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=context.group)
        gathered = gathered.view(size, *local.shape)
        whole = local.new_empty((*local.shape[:2], length, local.shape[3]))
        for part in range(size):
            positions = local_positions(length, ContextParallel(None, part, size), local.device)
            whole[:, :, positions] = gathered[part]
        return whole

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        context: ContextParallel = ctx.context
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=context.group)
        return total[:, :, local_positions(grad.shape[2], context, grad.device)], None


def gather_sequence(local: Tensor, context: ContextParallel) -> Tensor:
    """The whole sequence of keys or values (n, g, s, d) from each process's (n, g, s / C, d), differentiably."""
    return _GatherSequence.apply(local, context)


def causal_mask(length: int, context: ContextParallel, device: torch.device) -> Tensor:
    """(s / C, s) boolean: which keys of the whole sequence each local query may see (its own position and
    earlier)."""
    positions = local_positions(length, context, device)
    return positions[:, None] >= torch.arange(length, device=device)[None, :]
