"""Costs of ops on devices: durations in s, message sizes and memory in bytes (DESIGN §5).

A layer's time on a device is, in order of preference:

1. a device-independent synthetic time (the ``uniform`` model's ``fwd_ms``/``bwd_ms``), scaled by microbatch size;
2. a measured time from a profile whose device matches (``--profile``), scaled linearly from the profile's
   microbatch size;
3. a roofline estimate: ``max(flops / (peak × efficiency), bytes_moved / memory_bandwidth) + launch_overhead``.

The backward split of zero-bubble schedules charges half the backward to I and half to W (for matmul layers the
input-gradient and weight-gradient products each cost one forward; Qi et al., arXiv 2401.10241 §2), and a recompute
R costs one forward. A point-to-point message between two devices that the profile was measured on takes the
profile's fitted ``latency + bytes / bandwidth`` when it has one (measured between two processes of that machine),
else the topology's link model. Memory per stage follows mixed-precision Adam: fp16 weights and gradients plus fp32
master weights, momentum and variance, 16 bytes per parameter (Rajbhandari et al., ZeRO, arXiv 1910.02054 §3.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import SpecError
from sim.graph import LayerGraph
from sim.hardware import DeviceSpec
from sim.ir import OpKind, Placement
from sim.profile import MeasuredProfile
from sim.topology import Topology

__all__ = ["LayerCosts", "layer_costs", "state_bytes_per_param", "CostModel"]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer times on one device for one microbatch, in s (index = layer)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    opt: tuple[float, ...]


def state_bytes_per_param(dtype_bytes: int) -> int:
    """Training-state bytes per parameter: weights + gradients in the training dtype, Adam m and v in fp32, and an
    fp32 master copy when training in lower precision (ZeRO §3.1: 2 + 2 + 12 = 16 for fp16)."""
    master = 4 if dtype_bytes < 4 else 0
    return 2 * dtype_bytes + 8 + master


def _in_bytes(graph: LayerGraph, i: int) -> int:
    """Bytes per sample flowing into layer i (the model input for a source layer)."""
    incoming = [data["bytes"] for _, _, data in graph.graph.in_edges(i, data=True)]
    return sum(incoming) if incoming else graph.input_bytes


def _profile_applies(profile: MeasuredProfile | None, device: DeviceSpec) -> bool:
    """Whether ``profile`` was measured on ``device``: the one rule for where measured times and p2p replace models."""
    return profile is not None and profile.device == device.name


def layer_costs(
    graph: LayerGraph, device: DeviceSpec, microbatch_size: int, profile: MeasuredProfile | None = None
) -> LayerCosts:
    """Forward, backward and optimizer time of every layer for one microbatch on ``device``.

    Raises:
        SpecError: the profile is for another model, or names layers the graph does not have.
    """
    measured = None
    if _profile_applies(profile, device):
        if profile.model != graph.spec:
            raise SpecError(f"profile {profile.source} was measured for {profile.model!r}, not {graph.spec!r}")
        names = tuple(t.name for t in profile.layers)
        if names != tuple(layer.name for layer in graph.layers):
            raise SpecError(f"profile {profile.source} has layers {names[:4]}..., the model has "
                            f"{tuple(layer.name for layer in graph.layers)[:4]}...")
        measured = profile.layers
    throughput = device.peak_flops * device.matmul_efficiency  # FLOP/s
    per_param = state_bytes_per_param(graph.dtype_bytes)
    fwd, bwd, opt = [], [], []
    for i, layer in enumerate(graph.layers):
        if layer.fwd_s is not None and layer.bwd_s is not None:
            fwd.append(layer.fwd_s * microbatch_size)
            bwd.append(layer.bwd_s * microbatch_size)
            opt.append(0.0)  # synthetic layers model pipeline timing only; their update is free
            continue
        if measured is not None:
            scale = microbatch_size / profile.microbatch_size  # type: ignore[union-attr]
            fwd.append(measured[i].fwd_s * scale)
            bwd.append(measured[i].bwd_s * scale)
            opt.append(measured[i].opt_s)
            continue
        act = microbatch_size * (_in_bytes(graph, i) + layer.activation_bytes)
        fwd_bytes = layer.param_bytes + act  # read weights, read input, write output
        bwd_bytes = 2 * layer.param_bytes + 2 * act  # read weights, write weight grads, the same tensors again
        fwd.append(max(layer.flops_fwd * microbatch_size / throughput, fwd_bytes / device.memory_bandwidth)
                   + device.launch_overhead_s)
        bwd.append(max(layer.flops_bwd * microbatch_size / throughput, bwd_bytes / device.memory_bandwidth)
                   + device.launch_overhead_s)
        # Adam is memory bound: it reads and writes the whole training state once per step.
        state = graph.param_count(i) * per_param
        opt.append(2 * state / device.memory_bandwidth + device.launch_overhead_s if state else 0.0)
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(opt))


class CostModel:
    """Durations and sizes of the ops of one plan: a model partitioned onto a topology.

    Args:
        graph: the model.
        topology: the hardware; vstage v runs on ``topology.devices[placement.vstage_to_rank[v]]``.
        placement: layers of each vstage and rank of each vstage.
        microbatch_size: samples per microbatch.
        profile: optional measured profile (used on ranks whose device it was measured on).
    """

    def __init__(self, graph: LayerGraph, topology: Topology, placement: Placement, microbatch_size: int,
                 profile: MeasuredProfile | None = None) -> None:
        if placement.num_layers != len(graph):
            raise SpecError(f"placement covers {placement.num_layers} layers but the model has {len(graph)}")
        if max(placement.vstage_to_rank) >= topology.num_ranks:
            raise SpecError(f"placement uses rank {max(placement.vstage_to_rank)} but the topology has "
                            f"{topology.num_ranks} devices")
        self.graph, self.topology, self.placement = graph, topology, placement
        self.microbatch_size = microbatch_size
        self.profile = profile
        self._p2p = None
        if profile is not None and profile.p2p_latency_s is not None and profile.p2p_bandwidth:
            self._p2p = (profile.p2p_latency_s, profile.p2p_bandwidth)
        by_device: dict[str, LayerCosts] = {}
        for device in topology.devices:
            if device.name not in by_device:
                by_device[device.name] = layer_costs(graph, device, microbatch_size, profile)
        per_param = state_bytes_per_param(graph.dtype_bytes)
        self._times: list[dict[OpKind, float]] = []
        self._state: list[int] = []
        self._activation: list[int] = []
        self._checkpoint: list[int] = []
        self._workspace: list[int] = []
        for v, (start, end) in enumerate(placement.vstage_layers):
            costs = by_device[topology.devices[placement.vstage_to_rank[v]].name]
            f, b = sum(costs.fwd[start:end]), sum(costs.bwd[start:end])
            self._times.append({OpKind.F: f, OpKind.B: b, OpKind.I: b / 2, OpKind.W: b / 2, OpKind.R: f,
                                OpKind.OPT_STEP: sum(costs.opt[start:end])})
            layers = graph.layers[start:end]
            self._state.append(sum(graph.param_count(i) for i in range(start, end)) * per_param)
            # A layer's saved_bytes include its output but not its input, so the stage also keeps what it received.
            received = graph.boundary_bytes(start) if start > 0 else graph.input_bytes
            self._activation.append(microbatch_size * (received + sum(layer.saved_bytes for layer in layers)))
            self._checkpoint.append(microbatch_size * received)
            self._workspace.append(microbatch_size * max(layer.workspace_bytes for layer in layers))

    def compute_time(self, kind: OpKind, vstage: int) -> float:
        """Duration in s of a compute-stream op (F, B, I, W, R, OPT_STEP) of ``vstage``; 0 for bookkeeping ops."""
        return self._times[vstage].get(kind, 0.0)

    def message_bytes(self, kind: OpKind, vstage: int) -> int:
        """Bytes of one SEND/RECV: the activation leaving ``vstage`` forward, or the gradient leaving it backward."""
        start, end = self.placement.vstage_layers[vstage]
        if kind in (OpKind.SEND_F, OpKind.RECV_F):
            cut = end if kind is OpKind.SEND_F else start
        else:
            cut = start if kind is OpKind.SEND_B else end
        return self.microbatch_size * self.graph.boundary_bytes(cut)

    def transfer_time(self, nbytes: int, src_rank: int, dst_rank: int) -> float:
        """Uncontended time in s of a ``nbytes``-byte message from ``src_rank`` to ``dst_rank``.

        The profile's measured ``latency + nbytes / bandwidth`` when both ranks run on the profile's device, else
        :meth:`sim.topology.Topology.transfer_time`; 0 between a rank and itself.
        """
        if self._p2p is not None and src_rank != dst_rank and self._profiled(src_rank) and self._profiled(dst_rank):
            latency, bandwidth = self._p2p
            return latency + nbytes / bandwidth
        return self.topology.transfer_time(nbytes, src_rank, dst_rank)

    def _profiled(self, rank: int) -> bool:
        return _profile_applies(self.profile, self.topology.devices[rank])

    def profiled_ranks(self, num_ranks: int | None = None) -> tuple[int, ...]:
        """Ranks on the profile's device, whose measured times replace the roofline (synthetic layers excepted).

        Args:
            num_ranks: consider ranks ``0..num_ranks-1`` only (a plan's ranks); default every device of the topology.
        """
        count = self.topology.num_ranks if num_ranks is None else min(num_ranks, self.topology.num_ranks)
        return tuple(rank for rank in range(count) if self._profiled(rank))

    def uses_measured_p2p(self, num_ranks: int | None = None) -> bool:
        """Whether some transfer between two of the first ``num_ranks`` ranks takes the profile's measured p2p fit
        (:meth:`transfer_time`): the profile has a fit and at least two of those ranks run on its device."""
        return self._p2p is not None and len(self.profiled_ranks(num_ranks)) >= 2

    def param_bytes(self, vstage: int) -> int:
        """Weight bytes of ``vstage`` (what a PREFETCH or EVICT of the stage moves)."""
        start, end = self.placement.vstage_layers[vstage]
        return sum(layer.param_bytes for layer in self.graph.layers[start:end])

    def state_bytes(self, vstage: int) -> int:
        """Resident training state of ``vstage`` in bytes: weights, gradients, optimizer state."""
        return self._state[vstage]

    def activation_bytes(self, vstage: int) -> int:
        """Bytes one in-flight microbatch keeps on the device from its forward to its backward."""
        return self._activation[vstage]

    def checkpoint_bytes(self, vstage: int) -> int:
        """Bytes one in-flight microbatch keeps from forward to backward when its activations are recomputed.

        The stage's input (what it received, or the model input for the first stage), the checkpoint from which an
        R op rebuilds the other ``activation_bytes(vstage) - checkpoint_bytes(vstage)`` bytes before the backward.
        """
        return self._checkpoint[vstage]

    def workspace_bytes(self, vstage: int) -> int:
        """Transient bytes while one op of ``vstage`` runs."""
        return self._workspace[vstage]
