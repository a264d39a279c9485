"""A plan's view of the cost oracle: per virtual stage durations (s) and sizes (bytes), what the engines read.

:class:`CostModel` answers in the engine's terms (an op kind of a vstage, a SEND of a vstage, a stage's memory) and
asks :class:`sim.cost.oracle.CostOracle` for every number, so a simulated plan, a partition and a prediction can
never cost the same thing two ways. The zero-bubble split charges half a backward to I and half to W (for matmul
layers the input-gradient and weight-gradient products each cost one forward; Qi et al., arXiv 2401.10241 §2), and
a recompute R costs one forward.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.cost.profile import MeasuredProfile
from sim.hw.topology import Topology
from sim.ir.plan import OpKind, Placement
from sim.models.graph import LayerGraph

__all__ = ["CostModel"]


class CostModel:
    """Durations and sizes of the ops of one plan: a model partitioned onto a topology.

    Args:
        graph: the model.
        topology: the hardware; vstage v runs on ``topology.devices[placement.vstage_to_rank[v]]``.
        placement: layers of each vstage and rank of each vstage.
        microbatch_size: samples per microbatch.
        profile: optional measured profile (used on ranks whose device it was measured on).
        oracle: the oracle to ask, when the caller already has one for this graph, size, profile and topology.

    Raises:
        SpecError: the placement does not cover the model or uses ranks the topology lacks.
    """

    def __init__(self, graph: LayerGraph, topology: Topology, placement: Placement, microbatch_size: int,
                 profile: MeasuredProfile | None = None, *, oracle: CostOracle | None = None) -> None:
        if placement.num_layers != len(graph):
            raise SpecError(f"placement covers {placement.num_layers} layers but the model has {len(graph)}")
        if max(placement.vstage_to_rank) >= topology.num_ranks:
            raise SpecError(f"placement uses rank {max(placement.vstage_to_rank)} but the topology has "
                            f"{topology.num_ranks} devices")
        self.oracle = oracle or CostOracle(graph, microbatch_size, profile, topology)
        self.graph, self.topology, self.placement = graph, topology, placement
        self.microbatch_size, self.profile = microbatch_size, profile
        self._times: list[dict[OpKind, float]] = []
        # Memory per vstage, asked once: the engine reads these for every op.
        oracle = self.oracle
        ranges = placement.vstage_layers
        self._params = [oracle.param_bytes(a, b) for a, b in ranges]
        self._state = [oracle.state_bytes(a, b) for a, b in ranges]
        self._activation = [oracle.activation_bytes(a, b) for a, b in ranges]
        self._checkpoint = [oracle.checkpoint_bytes(a) for a, _ in ranges]
        self._workspace = [oracle.workspace_bytes(a, b) for a, b in ranges]
        for v, (start, end) in enumerate(placement.vstage_layers):
            costs = self.oracle.layer_costs(topology.devices[placement.vstage_to_rank[v]])
            f, b = sum(costs.fwd[start:end]), sum(costs.bwd[start:end])
            self._times.append({OpKind.F: f, OpKind.B: b, OpKind.I: b / 2, OpKind.W: b / 2, OpKind.R: f,
                                OpKind.OPT_STEP: sum(costs.opt[start:end])})

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
        return self.oracle.boundary_bytes(cut)

    def transfer_time(self, nbytes: int, src_rank: int, dst_rank: int) -> float:
        """Uncontended time in s of a message (:meth:`sim.cost.oracle.CostOracle.transfer_time`)."""
        return self.oracle.transfer_time(nbytes, src_rank, dst_rank)

    def profiled_ranks(self, num_ranks: int | None = None) -> tuple[int, ...]:
        """Ranks whose measured times replace the roofline (:meth:`sim.cost.oracle.CostOracle.profiled_ranks`)."""
        return self.oracle.profiled_ranks(num_ranks)

    def uses_measured_p2p(self, num_ranks: int | None = None) -> bool:
        """Whether transfers take the profile's p2p fit (:meth:`sim.cost.oracle.CostOracle.uses_measured_p2p`)."""
        return self.oracle.uses_measured_p2p(num_ranks)

    def param_bytes(self, vstage: int) -> int:
        """Weight bytes of ``vstage`` (what a PREFETCH or EVICT of the stage moves)."""
        return self._params[vstage]

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
