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

* Expert parallelism (``executor.nn.expert_parallel``): a process holds only its block of each mixture's experts,
  and the processes holding the same block form the expert-data-parallel group (``sim.ir.parallel``). Each vstage's
  parameters are then two sets, flattened and reduced on their own: the experts' over the expert-data-parallel group,
  the rest over the data-parallel group, and under ZeRO each set's optimizer state is sharded over its own group.
  Both are divided by D: a process's expert gradient already sums the tokens of every replica of its
  expert-parallel group (the all-to-alls brought them), so the sum over the expert-data-parallel group covers the
  global batch once.

The optimizers are PyTorch's single-tensor loops (``executor.nn.optim``), whose arithmetic is elementwise, so an
optimizer over a slice computes, element by element, what one over the whole parameters would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from executor.nn.optim import make_optimizer

__all__ = ["DataParallel", "ReductionGroup", "ShardOptimizer", "flatten_padded"]


def flatten_padded(tensors: list[Tensor | None], params: list[nn.Parameter], length: int) -> Tensor:
    """``tensors`` (shaped like ``params``; ``None`` is zeros) flattened in parameter order into one buffer of
    ``length`` elements, zero-padded at the end (so that it splits into equal slices)."""
    parts = [(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(tensors, params, strict=True)]
    padding = length - sum(p.numel() for p in params)
    if padding:
        parts.append(params[0].new_zeros(padding))
    return torch.cat(parts)


@dataclass(frozen=True)
class ReductionGroup:
    """The processes a set of parameters reduces its gradients with.

    Attributes:
        group: the process group (``None`` with ``size`` 1: nothing to exchange).
        size: processes in it.
        rank: this process's index in it.
    """

    group: Any
    size: int
    rank: int


class _Bucket:
    """One vstage's parameters that reduce over one group: flattened in parameter order into a buffer zero-padded to
    a multiple of the group's size; under ZeRO, this process's slice of it (a leaf the optimizer owns)."""

    def __init__(self, params: list[nn.Parameter], where: ReductionGroup, divisor: int, zero: int) -> None:
        self.params, self.where, self.divisor = params, where, divisor
        self.padded = -(-sum(p.numel() for p in params) // where.size) * where.size
        self.shard: Tensor | None = None
        if zero:
            width = self.padded // where.size
            flat = self.flat([p.detach() for p in params])
            self.shard = flat[where.rank * width:(where.rank + 1) * width].clone().requires_grad_(True)

    def flat(self, tensors: list[Tensor | None]) -> Tensor:
        return flatten_padded(tensors, self.params, self.padded)


class _Works:
    """The work handles of one op's collectives, waited on together (``None``: nothing was exchanged)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = [work for work in works if work is not None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class ShardOptimizer:
    """ZeRO-1's optimizer of one vstage on one replica: the update of its slices of the flattened parameters.

    Quacks like the ``torch.optim.Optimizer`` the interpreter's ``OPT_STEP`` calls (``step``, ``zero_grad``).

    Attributes:
        shards: the replica's slices (one per reduction group), leaf tensors whose ``grad`` the reduce-scatters fill.
        inner: the optimizer over them.
    """

    def __init__(self, shards: list[Tensor], inner: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
        self.shards, self.inner, self.params = shards, inner, params

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for param in self.params:  # their gradients were reduced into the shards'; the next backward starts afresh
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The update's state: the inner optimizer's and the slices' values (for ``executor.checkpoint``)."""
        return {"inner": self.inner.state_dict(), "shards": [shard.detach().cpu().clone() for shard in self.shards]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put :meth:`state_dict`'s values back (the slices in place: the inner optimizer holds them)."""
        with torch.no_grad():
            for shard, saved in zip(self.shards, state["shards"], strict=True):
                shard.copy_(saved)
        self.inner.load_state_dict(state["inner"])


class DataParallel:
    """One process's share of data parallelism: its vstages' reductions and, under ZeRO-1 and 2, sharded steps.

    Args:
        stages: vstage → module, the vstages this process runs.
        group: the data-parallel process group (the D processes holding the same shard of the same pipeline rank).
        size: D.
        rank: this process's replica index in ``0..D-1`` (its position in the group).
        zero: 0, 1 (ZeRO-1) or 2 (ZeRO-2).
        optimizer, lr: the update rule (``executor.nn.optim.make_optimizer``).
        experts: under expert parallelism, the expert-data-parallel group (the processes that hold the same experts)
            and which parameters are experts' (by name): those reduce over it instead (module docstring).
        zeno: Zeno's aggregation instead of the mean (``executor.zeno``; plain data parallelism only).
        byzantine: this replica's corruption of the gradients it sends (``executor.byzantine``), or ``None``.
    """

    def __init__(self, stages: Mapping[int, nn.Module], group: Any, size: int, rank: int, *, zero: int,
                 optimizer: str, lr: float | None,
                 experts: tuple[ReductionGroup, Callable[[str], bool]] | None = None, zeno: Any = None,
                 byzantine: Any = None) -> None:
        self.zero, self.zeno, self.byzantine = zero, zeno, byzantine
        self.reductions = 0  # REDUCE_GRAD ops issued: the step a Byzantine replica's noise is drawn for
        self.named = {v: list(stage.named_parameters()) for v, stage in stages.items()}
        self.buckets: dict[int, list[_Bucket]] = {}
        self.optimizers: dict[int, Any] = {}
        for v, stage in stages.items():
            named = list(stage.named_parameters())
            if experts is None:
                split = [([p for _, p in named], ReductionGroup(group, size, rank))]
            else:
                expert_group, is_expert = experts
                split = [([p for name, p in named if not is_expert(name)], ReductionGroup(group, size, rank)),
                         ([p for name, p in named if is_expert(name)], expert_group)]
            # Every replica's gradient is the sum over its own samples: dividing the sum over whoever holds the
            # same parameters by D gives the mean over the global batch, for the experts too (their holders
            # received the tokens of all D replicas through the all-to-alls).
            self.buckets[v] = [_Bucket(params, where, size, zero) for params, where in split if params]
            params = [p for _, p in named]
            if zero:
                shards = [bucket.shard for bucket in self.buckets[v]]
                self.optimizers[v] = ShardOptimizer(shards, make_optimizer(optimizer, shards, lr), params)
            else:
                self.optimizers[v] = make_optimizer(optimizer, params, lr)

    def start_at(self, iteration: int) -> None:
        """A run resumed at ``iteration`` (``executor.checkpoint``): the steps a Byzantine replica's noise and Zeno's
        validation batch are drawn for continue from there (one reduction per iteration: no pipeline, one vstage)."""
        if self.byzantine is not None or self.zeno is not None:
            self.reductions = iteration
            if self.zeno is not None:
                self.zeno.step = iteration

    def reduce(self, v: int) -> tuple[Any, Callable[[], None]]:
        """Issue vstage v's gradient reductions (under ZeRO-2, one microbatch's); returns their work handle and what
        to do once they have completed."""
        works, completions = [], []
        for bucket in self.buckets[v]:
            work, done = self._reduce(bucket)
            works.append(work)
            completions.append(done)
        return _Works(works), _in_turn(completions)

    def _reduce(self, bucket: _Bucket) -> tuple[Any, Callable[[], None]]:
        grads = bucket.flat([p.grad for p in bucket.params])
        if self.byzantine is not None:  # what this replica sends instead (executor.byzantine)
            from executor.byzantine import corrupt

            grads = corrupt(grads, self.byzantine, self.reductions)
        self.reductions += 1
        if self.zeno is not None:
            return self._reduce_zeno(bucket, grads)
        if self.zero == 2:
            for param in bucket.params:  # now in the buffer: the next microbatch's backward starts afresh
                param.grad = None
        where = bucket.where
        if not self.zero:
            work = dist.all_reduce(grads, group=where.group, async_op=True) if where.size > 1 else None

            def done() -> None:
                grads.div_(bucket.divisor)
                _scatter_into(bucket.params, grads, grad=True)

            return work, done
        shard = bucket.shard
        assert shard is not None
        if where.size > 1:
            received = torch.empty_like(shard)
            work = dist.reduce_scatter_single(received, grads, group=where.group, async_op=True)
        else:
            received, work = grads, None

        def done_shard() -> None:
            received.div_(bucket.divisor)
            if self.zero == 2 and shard.grad is not None:  # another microbatch's slice is already there
                shard.grad.add_(received)
            else:
                shard.grad = received

        return work, done_shard

    def _reduce_zeno(self, bucket: _Bucket, grads: Tensor) -> tuple[Any, Callable[[], None]]:
        """Zeno (``executor.zeno``): all-gather every replica's gradient; once there, score them and keep the mean of
        the best as the parameters' gradients."""
        where = bucket.where
        gathered = grads.new_empty(where.size * grads.numel())
        work = dist.all_gather_single(gathered, grads, group=where.group, async_op=True)

        def done() -> None:
            rows = gathered.view(where.size, -1)
            candidates = []
            for row in rows:
                offset, split = 0, []
                for param in bucket.params:
                    split.append(row[offset:offset + param.numel()].view_as(param))
                    offset += param.numel()
                candidates.append(split)
            (v,) = list(self.named)  # one vstage: Zeno runs without a pipeline (executor.run checks it)
            mean = self.zeno.aggregate(self.named[v], candidates)
            with torch.no_grad():
                for param, value in zip(bucket.params, mean, strict=True):
                    param.grad = value.clone()

        return work, done

    def gather(self, v: int) -> tuple[Any, Callable[[], None]]:
        """ZeRO-1 and 2: issue the all-gathers of vstage v's updated slices; their work handle and what to do after."""
        if not self.zero:
            raise RuntimeError("GATHER_PARAMS without ZeRO-1 or 2: the plan and the process disagree")
        works, completions = [], []
        for bucket in self.buckets[v]:
            assert bucket.shard is not None
            if bucket.where.size > 1:
                gathered = bucket.params[0].new_empty(bucket.padded)
                works.append(dist.all_gather_single(gathered, bucket.shard.detach(), group=bucket.where.group,
                                                    async_op=True))
            else:
                gathered = bucket.shard.detach()
            completions.append(lambda bucket=bucket, gathered=gathered: _scatter_into(bucket.params, gathered,
                                                                                       grad=False))
        return _Works(works), _in_turn(completions)

    def settle(self) -> None:
        """ZeRO-1 with the parameter gather at each iteration's start (the plan's ``param_gather_overlap``): gather
        every vstage's updated slices now, so that the replica holds the parameters the last step made before its
        state is saved or checkpointed (the next iteration's gather would bring them otherwise)."""
        for v in sorted(self.buckets):
            work, done = self.gather(v)
            work.wait()
            done()


def _in_turn(steps: list[Callable[[], None]]) -> Callable[[], None]:
    """One completion that runs ``steps`` in order."""
    def run() -> None:
        for step in steps:
            step()

    return run


def _scatter_into(params: list[nn.Parameter], flat: Tensor, *, grad: bool) -> None:
    """Copy ``flat`` back into ``params`` (``grad``: their gradients) in parameter order."""
    offset = 0
    with torch.no_grad():
        for param in params:
            part = flat[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
            if grad and param.grad is None:  # no gradient here (an expert no token reached): the others' sum
                param.grad = part.clone()
            elif grad:  # into the gradient in place: no second gradient-sized set of tensors while flat lives
                param.grad.copy_(part)
            else:
                param.copy_(part)
