"""ZeRO-3 (FSDP) in the executor: every layer's parameters live sharded over the data-parallel group and are gathered
for its forward and its backward, its gradients reduce-scattered after each backward, and the optimizer steps on the
shards.

PyTorch's own ``fully_shard`` needs collectives gloo lacks in the form it uses, so this is the project's own, with
the semantics of FSDP and of what :mod:`sim.cost.fsdp` costs (Rajbhandari et al., arXiv 1910.02054 §5.3, P_os+g+p;
Zhao et al., "PyTorch FSDP", arXiv 2304.11277 §3):

* **Units.** Each layer of a stage (``embed``, ``block3``, ``head``) is one unit: its parameters are flattened in
  parameter order into one buffer, zero-padded to a multiple of D, and replica d keeps elements ``[d·L/D,
  (d+1)·L/D)``, a leaf tensor the optimizer owns. The parameters keep their tensor objects, but their storage is
  freed (resized to 0 bytes) while they are sharded.
* **Gather.** Before a unit's forward (a forward pre-hook) its shards are all-gathered and copied into the
  parameters' storage; after the forward the storage is freed again (FSDP's ``reshard_after_forward``, the default;
  ``--no-reshard-after-forward`` keeps it until the backward). Before the unit's backward (a hook on the gradient of
  its output) they are gathered again. The copy writes through ``.data``, so the autograd graph that saved the
  parameters for the backward does not see a new version: the same tensors, refilled with the same values.
* **Reduce-scatter.** When the backward has accumulated every parameter's gradient of the unit (a post-accumulate
  hook per parameter), the gradients are flattened, reduce-scattered, divided by D and added to the shard's gradient;
  the parameters' gradients are dropped and their storage freed. Each microbatch's backward reduces its own, as under
  ZeRO-2: the sum over microbatches is taken slice by slice.
* **Update.** ``OPT_STEP`` steps the vstage's unit shards with the elementwise optimizer, so each element moves as it
  would in one process; the next forward gathers the new values. The lowering gives ZeRO-3 no ``REDUCE_GRAD`` or
  ``GATHER_PARAMS`` op: the collectives are inside the F and B ops, as the simulator costs them.
* **Once per step under a pipeline** (``Parallelism.fsdp_gathers_per_step``: ``--pp`` > 1 without resharding after
  the forward, as torchtitan runs FSDP with PyTorch's pipelining; ``sim.plan.lower_collectives``): the plan's
  ``GATHER_PARAMS`` of a vstage all-gathers every unit (:meth:`FullyShardedStages.gather`) and its first forward
  waits for it; the units stay gathered through every microbatch (the hooks find them gathered); each backward
  accumulates the whole gradients in the parameters' ``.grad`` instead of reduce-scattering them
  (``set_requires_gradient_sync(False)`` in ``torch/distributed/pipelining/stage.py``); the plan's ``REDUCE_GRAD``
  after the vstage's last backward reduce-scatters them once into the shards' gradients and frees the gathered
  parameters (:meth:`FullyShardedStages.reduce`, as ``_post_backward`` does), and the update waits for it.

The collectives are blocking here: the gathers are not prefetched under the previous unit's compute as the simulator
assumes FSDP does (``sim.cost.fsdp``), so on a slow link a measured F or B holds its gathers in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from executor.data_parallel import _in_turn, _Works, flatten_padded
from executor.nn.optim import make_optimizer

__all__ = ["FullyShardedUnit", "FullyShardedStages", "ShardedOptimizer"]


class FullyShardedUnit:
    """One layer's parameters, sharded over the data-parallel group (module docstring).

    Args:
        module: the layer.
        group, size, rank: the data-parallel process group, its size D and this process's index in it.
        reshard_after_forward: free the gathered parameters after the forward (FSDP's default).
    """

    def __init__(self, module: nn.Module, group: Any, size: int, rank: int, *, reshard_after_forward: bool,
                 per_step: bool = False) -> None:
        self.module, self.group, self.size, self.rank = module, group, size, rank
        self.reshard_after_forward = reshard_after_forward
        self.per_step = per_step
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // size) * size
        width = self.padded // size
        with torch.no_grad():
            flat = self._flat([p.detach() for p in self.params])
            self.shard = flat[rank * width:(rank + 1) * width].clone().requires_grad_(True)
        self.nbytes = [p.untyped_storage().nbytes() for p in self.params]
        self.gathered = True
        self.pending = 0  # parameters whose gradient this backward has accumulated
        self.free()
        module.register_forward_pre_hook(lambda _module, _args: self.gather())
        module.register_forward_hook(self._after_forward)
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._after_accumulate)

    def _flat(self, tensors: list[Tensor]) -> Tensor:
        return flatten_padded(list(tensors), self.params, self.padded)

    def gather(self) -> None:
        """All-gather the shards into the parameters (nothing if they are gathered)."""
        if self.gathered:
            return
        flat = self.shard.new_empty(self.padded)
        dist.all_gather_single(flat, self.shard.detach(), group=self.group)
        self._fill(flat)

    def issue_gather(self) -> tuple[Any, Any]:
        """Issue the all-gather of the shards without waiting: its work handle and what fills the parameters once it
        has completed (:meth:`FullyShardedStages.gather`)."""
        flat = self.shard.new_empty(self.padded)
        work = dist.all_gather_single(flat, self.shard.detach(), group=self.group, async_op=True)
        return work, lambda: self._fill(flat)

    def _fill(self, flat: Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for param, nbytes in zip(self.params, self.nbytes, strict=True):
                param.untyped_storage().resize_(nbytes)
                param.data.copy_(flat[offset:offset + param.numel()].view_as(param))
                offset += param.numel()
        self.gathered = True

    def free(self) -> None:
        """Release the gathered parameters' storage (the tensors stay, sized 0 bytes)."""
        for param in self.params:
            param.untyped_storage().resize_(0)
        self.gathered = False

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self._before_backward)
        if self.reshard_after_forward:
            self.free()

    def _before_backward(self, grad: Tensor) -> Tensor:
        self.gather()
        return grad

    def _after_accumulate(self, _param: Tensor) -> None:
        if self.per_step:  # the whole gradients accumulate in .grad until the step's REDUCE_GRAD
            return
        self.pending += 1
        if self.pending < len(self.params):
            return
        self.pending = 0
        grads = self._flat([p.grad for p in self.params])
        for param in self.params:
            param.grad = None
        received = torch.empty_like(self.shard)
        dist.reduce_scatter_single(received, grads, group=self.group)
        self._take(received)

    def issue_reduce(self) -> tuple[Any, Any]:
        """Issue the reduce-scatter of the step's accumulated whole gradients without waiting: its work handle and
        what adds the received slice to the shard's gradient and frees the gathered parameters once it has completed
        (:meth:`FullyShardedStages.reduce`)."""
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        for param in self.params:
            param.grad = None
        received = torch.empty_like(self.shard)
        work = dist.reduce_scatter_single(received, grads, group=self.group, async_op=True)
        return work, lambda: self._take(received)

    def _take(self, received: Tensor) -> None:
        received.div_(self.size)
        if self.shard.grad is None:
            self.shard.grad = received
        else:
            self.shard.grad.add_(received)
        self.free()

    def full(self) -> dict[str, Tensor]:
        """The unit's whole parameters by name (collective: every member of the group must call it)."""
        flat = self.shard.new_empty(self.padded)
        dist.all_gather_single(flat, self.shard.detach(), group=self.group)
        whole, offset = {}, 0
        names = {id(p): name for name, p in self.module.named_parameters()}
        for param in self.params:
            whole[names[id(param)]] = flat[offset:offset + param.numel()].view(param.shape).clone()
            offset += param.numel()
        return whole


class ShardedOptimizer:
    """One vstage's update under ZeRO-3: the elementwise optimizer over its units' shards. Quacks like the
    ``torch.optim.Optimizer`` the interpreter's ``OPT_STEP`` calls."""

    def __init__(self, units: list[FullyShardedUnit], optimizer: str, lr: float | None) -> None:
        self.units = units
        self.inner = make_optimizer(optimizer, [unit.shard for unit in units], lr)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The update's state and the units' shards, which are the parameters (a checkpoint's,
        ``executor.checkpoint``)."""
        return {"inner": self.inner.state_dict(),
                "shards": [unit.shard.detach().cpu().clone() for unit in self.units]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put :meth:`state_dict`'s values back; the next forward gathers the restored shards."""
        with torch.no_grad():
            for unit, saved in zip(self.units, state["shards"], strict=True):
                unit.shard.copy_(saved)
        self.inner.load_state_dict(state["inner"])


class FullyShardedStages:
    """The process's vstages under ZeRO-3: one :class:`FullyShardedUnit` per layer, one optimizer per vstage.

    Args:
        stages: vstage → :class:`executor.nn.stages.Stage` (its ``layers`` are the units).
        group, size, rank: the data-parallel group, D and this process's index in it.
        reshard_after_forward: FSDP's ``reshard_after_forward``.
        optimizer, lr: the update rule (``executor.nn.optim.make_optimizer``).
        per_step: gathered and reduce-scattered once per step by the plan's GATHER_PARAMS and REDUCE_GRAD ops
            (module docstring); the interpreter calls :meth:`gather` and :meth:`reduce` for them.
    """

    def __init__(self, stages: Mapping[int, nn.Module], group: Any, size: int, rank: int, *,
                 reshard_after_forward: bool, optimizer: str, lr: float | None, per_step: bool = False) -> None:
        self.units = {v: [FullyShardedUnit(layer, group, size, rank, reshard_after_forward=reshard_after_forward,
                                           per_step=per_step)
                          for layer in stage.layers.values()] for v, stage in stages.items()}
        self.optimizers = {v: ShardedOptimizer(units, optimizer, lr) for v, units in self.units.items()}

    def gather(self, v: int) -> tuple[Any, Any]:
        """GATHER_PARAMS of vstage v: issue every unit's all-gather; their work handle and what fills the parameters
        once they have completed (the interpreter's data-parallel op protocol, as ``executor.data_parallel``)."""
        issued = [unit.issue_gather() for unit in self.units[v]]
        return _Works([work for work, _ in issued]), _in_turn([fill for _, fill in issued])

    def reduce(self, v: int) -> tuple[Any, Any]:
        """REDUCE_GRAD of vstage v: issue every unit's reduce-scatter of the step's whole gradients; their work handle
        and what takes the slices into the shards' gradients and frees the gathered parameters."""
        issued = [unit.issue_reduce() for unit in self.units[v]]
        return _Works([work for work, _ in issued]), _in_turn([take for _, take in issued])

    def start_at(self, iteration: int) -> None:
        """A resumed run (``executor.rank_process``): nothing here depends on the iteration."""

    def state_dict(self, v: int, stage: nn.Module) -> dict[str, Tensor]:
        """Vstage v's state as ``stage.state_dict()`` would give it unsharded: its buffers and its whole parameters
        (a collective over the group)."""
        prefix = {id(layer): f"layers.{name}." for name, layer in stage.layers.items()}
        state: dict[str, Tensor] = {name: buffer for name, buffer in stage.named_buffers()}
        for unit in self.units[v]:
            state.update({prefix[id(unit.module)] + name: value for name, value in unit.full().items()})
        return state
