"""Data parallelism in the executor: the ``REDUCE_GRAD`` and ``GATHER_PARAMS`` ops of one process, ZeRO-1 and 2.

D replicas of the whole pipeline each train on their own slice of the global batch (``executor.parallel``) and keep
identical parameters: after its last backward, each vstage's gradients are summed over the replicas and divided by
D, so every replica steps with the mean gradient over the global batch, as one process training on the whole batch
would (``executor.reference.train_reference`` with ``replicas``). Where the ops sit and what waits for them is the
lowering's (``sim.plan.lower_collectives``); this module is what they do:

* ``REDUCE_GRAD`` of vstage v: the stage's gradients, flattened in parameter order into one buffer (zero-padded to
  a multiple of D), are all-reduced over the data-parallel group, issued without blocking (``async_op=True``); the
  ``OPT_STEP`` that depends on it waits, and the buffer, divided by D, becomes the parameters' gradients.
* ZeRO-1 (Rajbhandari et al., arXiv 1910.02054 §5.1, P_os): replica d keeps the optimizer state for elements
  ``[d·L/D, (d+1)·L/D)`` of the flattened, padded parameters only. ``REDUCE_GRAD`` is a reduce-scatter (each
  replica receives the sum of its slice; gloo has one in torch 2.13, NCCL always had), ``OPT_STEP`` updates that
  slice (a leaf tensor the optimizer owns), and ``GATHER_PARAMS`` all-gathers the updated slices into every replica's
  parameters, again without blocking; the iteration's end waits for it (nothing in the program depends on it).
* ZeRO-2 (§5.2, P_os+g): the gradients are sharded too. The lowering puts a ``REDUCE_GRAD`` after each microbatch's
  backward of the vstage; it reduce-scatters that microbatch's gradients (flattened into a buffer of their own, so
  the parameters' gradients are dropped as soon as it is issued and the next microbatch's backward starts from
  none) and adds the replica's slice, divided by D, to the slice's gradient. ``OPT_STEP`` waits for all of them;
  then ``GATHER_PARAMS`` as under ZeRO-1. The sum over microbatches is taken slice by slice after the reduction
  rather than before it: the same numbers added in another order.

The optimizers are PyTorch's single-tensor loops (``executor.nn.optim``), whose arithmetic is elementwise, so an
optimizer over a slice computes, element by element, what one over the whole parameters would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from executor.nn.optim import make_optimizer

__all__ = ["DataParallel", "ShardOptimizer", "flatten_padded"]


def flatten_padded(tensors: list[Tensor | None], params: list[nn.Parameter], length: int) -> Tensor:
    """``tensors`` (shaped like ``params``; ``None`` is zeros) flattened in parameter order into one buffer of
    ``length`` elements, zero-padded at the end (so that it splits into equal slices)."""
    parts = [(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(tensors, params, strict=True)]
    padding = length - sum(p.numel() for p in params)
    if padding:
        parts.append(params[0].new_zeros(padding))
    return torch.cat(parts)


class ShardOptimizer:
    """ZeRO-1's optimizer of one vstage on one replica: the update of its slice of the flattened parameters.

    Quacks like the ``torch.optim.Optimizer`` the interpreter's ``OPT_STEP`` calls (``step``, ``zero_grad``).

    Attributes:
        shard: the replica's slice, a leaf tensor whose ``grad`` the reduce-scatter fills.
        inner: the optimizer over ``[shard]``.
    """

    def __init__(self, shard: Tensor, inner: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self.shard, self.inner, self.params = shard, inner, params

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for param in self.params:  # their gradients were reduced into the shard's; the next backward starts afresh
            param.grad = None


class DataParallel:
    """One process's share of data parallelism: its vstages' reductions and, under ZeRO-1, sharded steps.

    Args:
        stages: vstage → module, the vstages this process runs.
        group: the data-parallel process group (the D processes holding the same shard of the same pipeline rank).
        size: D.
        rank: this process's replica index in ``0..D-1`` (its position in the group).
        zero: 0, 1 (ZeRO-1) or 2 (ZeRO-2).
        optimizer, lr: the update rule (``executor.nn.optim.make_optimizer``).
    """

    def __init__(self, stages: Mapping[int, nn.Module], group: Any, size: int, rank: int, *, zero: int,
                 optimizer: str, lr: float | None) -> None:
        self.group, self.size, self.rank, self.zero = group, size, rank, zero
        self.params = {v: list(stage.parameters()) for v, stage in stages.items()}
        self.numel = {v: sum(p.numel() for p in params) for v, params in self.params.items()}
        self.padded = {v: -(-n // size) * size for v, n in self.numel.items()}
        self.optimizers: dict[int, Any] = {}
        for v, params in self.params.items():
            if zero:
                width = self.padded[v] // size
                shard = self._flat(v, [p.detach() for p in params])[rank * width:(rank + 1) * width].clone()
                shard.requires_grad_(True)
                self.optimizers[v] = ShardOptimizer(shard, make_optimizer(optimizer, [shard], lr), params)
            else:
                self.optimizers[v] = make_optimizer(optimizer, params, lr)

    def _flat(self, v: int, tensors: list[Tensor | None]) -> Tensor:
        """``tensors`` (shaped like vstage v's parameters; ``None`` is zeros) flattened into one padded buffer."""
        return flatten_padded(tensors, self.params[v], self.padded[v])

    def reduce(self, v: int) -> tuple[Any, Callable[[], None]]:
        """Issue vstage v's gradient reduction (under ZeRO-2, one microbatch's); returns its work handle and what to do
        once it has completed."""
        grads = self._flat(v, [p.grad for p in self.params[v]])
        if self.zero == 2:
            for param in self.params[v]:  # now in the buffer: the next microbatch's backward starts afresh
                param.grad = None
        if not self.zero:
            work = dist.all_reduce(grads, group=self.group, async_op=True)

            def done() -> None:
                grads.div_(self.size)
                self._scatter_into(v, grads, grad=True)

            return work, done
        shard = self.optimizers[v].shard
        received = torch.empty_like(shard)
        work = dist.reduce_scatter_single(received, grads, group=self.group, async_op=True)

        def done_shard() -> None:
            received.div_(self.size)
            if self.zero == 2 and shard.grad is not None:  # another microbatch's slice is already there
                shard.grad.add_(received)
            else:
                shard.grad = received

        return work, done_shard

    def gather(self, v: int) -> tuple[Any, Callable[[], None]]:
        """ZeRO-1: issue the all-gather of vstage v's updated slices; its work handle and what to do after it."""
        if not self.zero:
            raise RuntimeError("GATHER_PARAMS without ZeRO-1 or 2: the plan and the process disagree")
        gathered = self.params[v][0].new_empty(self.padded[v])
        work = dist.all_gather_single(gathered, self.optimizers[v].shard.detach(), group=self.group, async_op=True)
        return work, lambda: self._scatter_into(v, gathered, grad=False)

    def _scatter_into(self, v: int, flat: Tensor, *, grad: bool) -> None:
        """Copy ``flat`` back into vstage v's parameters (``grad``: their gradients) in parameter order."""
        offset = 0
        with torch.no_grad():
            for param in self.params[v]:
                part = flat[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
                if grad:  # into the gradient in place: no second gradient-sized set of tensors while flat lives
                    param.grad.copy_(part)
                else:
                    param.copy_(part)
