"""The memory of a model's layer ranges, bytes: what the memory ledger (``sim.cost.ledger``) sizes its rules with.

Every size is the model's (``sim.models``: ``Layer.saved_bytes``, ``workspace_bytes``, the parameter counts), or,
where a measured profile applies to the device asked about and holds memory (``profiles.layer_memory``), the
measured bytes: per-microbatch figures scaled by this microbatch size over the profile's, state figures as measured.
Without a device the model's sizes are given. Training state per parameter follows ZeRO's accounting (Rajbhandari
et al., arXiv 1910.02054 §3.1: weights and gradients in the training dtype, Adam's two moments and, below fp32, a
master copy in fp32; under ZeRO-1 the optimizer state split over the data-parallel replicas, §5.1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.cost.profile import LayerMemory
from sim.hw.catalog import DeviceSpec
from sim.models.graph import LayerGraph

__all__ = ["MemorySizes", "StateShards", "WHOLE_STATE", "state_bytes_per_param", "persistent_bytes_per_param",
           "layer_input_bytes"]


@dataclass(frozen=True)
class StateShards:
    """Over how many data-parallel replicas each part of the training state is split (Rajbhandari et al., ZeRO,
    arXiv 1910.02054 §5: stage 1 P_os splits the optimizer state, stage 2 P_os+g also the gradients, stage 3
    P_os+g+p also the parameters, which PyTorch's FSDP does). 1 is whole on every replica.

    The routed experts of a mixture are held by fewer devices than the rest (expert parallelism splits them), and
    ZeRO splits their state over the devices that hold the same experts, the expert-data-parallel group
    (:mod:`sim.ir.parallel`; Megatron-Core's distributed optimizer shards expert parameters over it): ``experts``.

    Attributes:
        optimizer: replicas the optimizer state (fp32 master weights, Adam's m and v) is split over.
        gradients: replicas the weight gradients are split over.
        params: replicas the parameters are split over.
        experts: the same three for the routed experts' state, or None where they are split as the rest (no
            mixture, or no expert parallelism and no tensor parallelism).
    """

    optimizer: int = 1
    gradients: int = 1
    params: int = 1
    experts: StateShards | None = None

    def __post_init__(self) -> None:
        for name in ("optimizer", "gradients", "params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"state shards: {name} must be an integer >= 1, got {value!r}")
        if self.experts is not None and self.experts.experts is not None:
            raise SpecError("state shards: the experts' shards have no experts of their own")

    @classmethod
    def of_zero(cls, zero: int, dp: int, expert_dp: int | None = None) -> StateShards:
        """The shards of ZeRO stage ``zero`` (0 to 3) over ``dp`` replicas, the routed experts' over ``expert_dp``
        devices (None: as the rest)."""
        experts = None if expert_dp is None or expert_dp == dp else cls.of_zero(zero, expert_dp)
        return cls(optimizer=dp if zero >= 1 else 1, gradients=dp if zero >= 2 else 1, params=dp if zero >= 3 else 1,
                   experts=experts)

    @property
    def of_experts(self) -> StateShards:
        """The shards the routed experts' state is split over."""
        return self.experts if self.experts is not None else self


#: Every part of the state whole on every replica (plain data parallelism).
WHOLE_STATE = StateShards()


def state_bytes_per_param(dtype_bytes: int, shards: StateShards = WHOLE_STATE) -> float:
    """Training-state bytes per parameter: weights + gradients in the training dtype, Adam m and v in fp32, and an
    fp32 master copy when training in lower precision (ZeRO §3.1: 2 + 2 + 12 = 16 for fp16), each part divided by
    the replicas it is split over (ZeRO §5, Figure 1: 2 + 2 + 12/N_d for P_os, 2 + 14/N_d for P_os+g, 16/N_d for
    P_os+g+p)."""
    master = 4 if dtype_bytes < 4 else 0
    optimizer = 8 + master
    return dtype_bytes / shards.params + dtype_bytes / shards.gradients + optimizer / shards.optimizer


def persistent_bytes_per_param(dtype_bytes: int) -> float:
    """Bytes per parameter of the state that outlives a step, whole (what a training checkpoint stores): the weights
    in the training dtype, Adam's m and v in fp32 and an fp32 master copy when training in lower precision
    (:func:`state_bytes_per_param` without the gradients: 2 + 12 = 14 for fp16)."""
    return state_bytes_per_param(dtype_bytes) - dtype_bytes


def layer_input_bytes(graph: LayerGraph, i: int) -> int:
    """Bytes per sample flowing into layer i (the model input for a source layer)."""
    incoming = [data["bytes"] for _, _, data in graph.graph.in_edges(i, data=True)]
    return sum(incoming) if incoming else graph.input_bytes


class MemorySizes:
    """Bytes of layer ranges of one model at one microbatch size (module docstring).

    Args:
        graph: the model.
        microbatch_size: samples per microbatch.
        shards: over how many data-parallel replicas the weights, gradients and optimizer state are split (ZeRO).
        measured: the measured per-layer memory that applies to a device, or ``None`` (the cost oracle's
            :meth:`~sim.cost.oracle.CostOracle.measured_memory`, which checks the profile against the model).
        measured_microbatch_size: the microbatch size the measured figures are for (the profile's).
    """

    def __init__(self, graph: LayerGraph, microbatch_size: int, shards: StateShards,
                 measured: Callable[[DeviceSpec | None], tuple[LayerMemory, ...] | None],
                 measured_microbatch_size: int = 1) -> None:
        self.graph, self.microbatch_size, self.shards = graph, microbatch_size, shards
        self.measured_memory = measured
        self.measured_microbatch_size = measured_microbatch_size

    def _scaled(self, nbytes: int) -> int:
        """Bytes of one microbatch of this oracle's size, from a figure measured at the profile's size (rounded up)."""
        return -(-nbytes * self.microbatch_size // self.measured_microbatch_size)

    def _largest(self, measured: tuple[LayerMemory, ...], figure: str, start: int, end: int) -> int:
        """The largest per-microbatch ``figure`` (a :class:`LayerMemory` field) of layers ``[start, end)``, scaled to
        this microbatch size: what a phase that handles one layer at a time holds at most."""
        return max(self._scaled(getattr(layer, figure)) for layer in measured[start:end])

    def param_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Weight bytes of layers ``[start, end)`` (what a PREFETCH or EVICT of them moves)."""
        measured = self.measured_memory(device)
        if measured is not None:
            return sum(layer.param_bytes for layer in measured[start:end])
        return sum(layer.param_bytes for layer in self.graph.layers[start:end])

    def gradient_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Weight-gradient bytes of layers ``[start, end)`` (in the training dtype, one per parameter)."""
        measured = self.measured_memory(device)
        if measured is not None:
            return sum(layer.gradient_bytes for layer in measured[start:end])
        return self.graph.dtype_bytes * sum(self.graph.param_count(i) for i in range(start, end))

    def deferred_gradient_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Of :meth:`gradient_bytes`, those a split backward's W makes (the weight GEMMs'), measured; 0 where nothing
        was measured (the I then makes them all)."""
        measured = self.measured_memory(device)
        return 0 if measured is None else sum(layer.deferred_gradient_bytes for layer in measured[start:end])

    def state_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Training state of layers ``[start, end)`` in bytes: weights, gradients, optimizer state (under ZeRO this
        replica's share of each part that is split, rounded up)."""
        measured = self.measured_memory(device)
        shards = self.shards
        if measured is not None:
            # The executor's ZeRO-2 makes whole gradients in each microbatch's backward and reduce-scatters a flat
            # copy of them; its slices are held by the reductions (CostView.reduction_memory), so the
            # gradients here are whole (per step) below ZeRO-3.
            gradient_parts = shards.gradients if shards.params > 1 else 1
            total = sum(math.ceil(sum(getattr(layer, field) for layer in measured[start:end]) / parts)
                        for field, parts in (("param_bytes", shards.params), ("gradient_bytes", gradient_parts),
                                             ("optimizer_bytes", shards.optimizer)))
            return total + self._shard_copies(measured[start:end])
        experts = sum(self.graph.expert_param_count(i) for i in range(start, end))
        rest = sum(self.graph.param_count(i) for i in range(start, end)) - experts
        dtype = self.graph.dtype_bytes
        return math.ceil(rest * state_bytes_per_param(dtype, shards)
                         + experts * state_bytes_per_param(dtype, shards.of_experts))

    def _shard_copies(self, measured: Sequence[LayerMemory]) -> int:
        """Under ZeRO-1 and 2 with a measured profile (the executor's training), what the executor's sharded optimizer
        holds besides the measured optimizer state: the replica's slice of the flattened parameters, a copy it steps
        (``executor.data_parallel``: ``_Bucket.shard``, cloned from the parameters), 1/D of the parameters' bytes.
        (That slice's gradient is the reduce-scatter's result, held by the reduction until the update:
        ``CostView.reduction_memory``.) 0 without ZeRO, and under ZeRO-3 (FSDP)."""
        shards = self.shards
        if shards.optimizer == 1 or shards.params > 1:
            return 0
        return math.ceil(sum(layer.param_bytes for layer in measured) / shards.optimizer)

    def input_bytes(self, start: int, device: DeviceSpec | None = None) -> int:
        """Bytes of one microbatch's input to a stage that begins at layer ``start``: what it received, or the model
        input for the first stage."""
        measured = self.measured_memory(device)
        if measured is not None and start > 0:
            return self._scaled(measured[start - 1].output_bytes)
        received = self.graph.boundary_bytes(start) if start > 0 else self.graph.input_bytes
        return self.microbatch_size * received

    def checkpoint_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Bytes one in-flight microbatch of layers ``[start, end)`` keeps from forward to backward under full
        recomputation: every layer's input, as Megatron-LM's ``uniform`` method with one layer per checkpoint and
        torchtitan's per-block ``full`` activation checkpointing keep them (each layer is rebuilt from its own input
        during the backward, one at a time: :meth:`rebuilt_bytes`). A tensor that feeds two layers of the range is
        counted for each (exact for a chain of layers; an overcount where a graph branches)."""
        measured = self.measured_memory(device)
        if measured is not None:
            return self.input_bytes(start, device) + sum(self._scaled(measured[i - 1].output_bytes)
                                                         for i in range(start + 1, end))
        received = self.input_bytes(start)
        within = sum(layer_input_bytes(self.graph, i) for i in range(start + 1, end))
        return received + self.microbatch_size * within

    def rebuilt_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Bytes one recomputed microbatch of layers ``[start, end)`` holds again during its backward: the saved
        tensors of one layer at a time, the largest of them (a layer's are freed by its backward before the next
        layer is rebuilt)."""
        measured = self.measured_memory(device)
        if measured is not None:
            return self._largest(measured, "retained_bytes", start, end)
        return self.microbatch_size * max(layer.saved_bytes for layer in self.graph.layers[start:end])

    def activation_bytes(self, start: int, end: int, device: DeviceSpec | None = None, *,
                         output_freed: bool = False) -> int:
        """Bytes one in-flight microbatch keeps on the device from the forward of layers ``[start, end)`` to their
        backward: the stage's input (a layer's saved bytes include its output, not its input) and every layer's
        whose activations are not offloaded to the host (``Layer.activations_offloaded``); with ``output_freed``
        (``Parallelism.deallocate_pipeline_outputs``) without the output the stage sends to the next, which the
        runtime frees once sent (nothing for the model's last stage, which sends nothing)."""
        measured = self.measured_memory(device)
        kept_layers = [i for i in range(start, end) if not self.graph.layers[i].activations_offloaded]
        sent = output_freed and end < len(self.graph.layers)
        if measured is not None:
            kept = sum(self._scaled(measured[i].retained_bytes) for i in kept_layers)
            freed = self._scaled(measured[end - 1].output_bytes) if sent else 0
            return self.input_bytes(start, device) + kept - freed
        saved = sum(self.graph.layers[i].saved_bytes for i in kept_layers)
        freed = self.graph.boundary_bytes(end) if sent else 0
        return self.input_bytes(start) + self.microbatch_size * (saved - freed)

    def workspace_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Transient bytes while one forward (or recompute) of layers ``[start, end)`` runs: the largest layer's."""
        measured = self.measured_memory(device)
        if measured is not None:
            return self._largest(measured, "forward_transient_bytes", start, end)
        return self.microbatch_size * max(layer.workspace_bytes for layer in self.graph.layers[start:end])

    def backward_workspace_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """Transient bytes while one backward op of layers ``[start, end)`` runs, beyond the weight gradients: the
        largest layer's (the model's backward workspace, where nothing was measured)."""
        measured = self.measured_memory(device)
        if measured is not None:
            return self._largest(measured, "backward_transient_bytes", start, end)
        return self.microbatch_size * max(layer.backward_transient_bytes for layer in self.graph.layers[start:end])

    def backward_peak_bytes(self, start: int, end: int, device: DeviceSpec | None = None, *,
                            new_gradients: bool = False) -> int:
        """How far above its starting level a full backward (B) of layers ``[start, end)`` peaks, bytes, beyond the
        gradient buffers it makes (``new_gradients``: the stage's first backward since its update creates them;
        they stay after it). The backward goes from the last layer to the first: at layer i it holds i's transient
        and the gradients made so far (i's included), and has freed the activations of the layers after i; an
        offloaded layer's activations are back on the device while its backward runs, and leave with it. Negative
        when the peak is below the starting level (the activations freed outweigh what is made)."""
        measured = self.measured_memory(device)
        size = self.microbatch_size
        peak: int | None = None
        made = freed = 0
        for i in reversed(range(start, end)):
            if measured is not None:
                layer_memory = measured[i]
                kept, gradients = self._scaled(layer_memory.retained_bytes), layer_memory.gradient_bytes
                # A first backward makes each gradient from the computed one (measured with it included); a later
                # one adds a temporary into it (measured without the gradient).
                holds = (self._scaled(layer_memory.first_backward_bytes) if new_gradients
                         else self._scaled(layer_memory.backward_transient_bytes))
            else:
                layer = self.graph.layers[i]
                kept, gradients = size * layer.saved_bytes, self.graph.dtype_bytes * self.graph.param_count(i)
                holds = size * layer.backward_transient_bytes + (gradients if new_gradients else 0)
            reloaded = kept if self.graph.layers[i].activations_offloaded else 0  # not in the starting level
            value = holds + reloaded + made - freed  # the gradients of the layers after i are made already
            peak = value if peak is None else max(peak, value)
            made += gradients if new_gradients else 0
            freed += kept - reloaded
        assert peak is not None, "an empty layer range"
        return peak - made

    def input_backward_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """The most a split backward's I of layers ``[start, end)`` holds above its starting level: the largest
        layer's, measured; where nothing was measured, the backward's workspace."""
        measured = self.measured_memory(device)
        if measured is None:
            return self.backward_workspace_bytes(start, end)
        return self._largest(measured, "input_backward_bytes", start, end)

    def weight_backward_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int:
        """The most a split backward's W of layers ``[start, end)`` holds above its starting level: the largest
        layer's, measured; where nothing was measured, the backward's workspace."""
        measured = self.measured_memory(device)
        if measured is None:
            return self.backward_workspace_bytes(start, end)
        return self._largest(measured, "weight_backward_bytes", start, end)

    def deferred_bytes(self, start: int, end: int, device: DeviceSpec | None = None) -> int | None:
        """Bytes a split backward's I of layers ``[start, end)`` keeps for its W (the weight GEMMs' inputs and
        output gradients), measured; ``None`` where nothing was measured (the ledger then keeps the activations)."""
        measured = self.measured_memory(device)
        if measured is None:
            return None
        return sum(self._scaled(layer.deferred_bytes) for layer in measured[start:end])
