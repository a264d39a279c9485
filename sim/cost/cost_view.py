"""A plan's view of the cost oracle: per virtual stage durations (s) and sizes (bytes), what the engines read.

:class:`CostView` answers in the engine's terms (an op kind of a vstage, a SEND of a vstage, a stage's memory) and
asks :class:`sim.cost.oracle.CostOracle` for every number, so a simulated plan, a partition and a prediction can
never cost the same thing two ways. The zero-bubble split charges I and W each its share of a backward, the op
table's ``backward_share`` (half each: for matmul layers the input-gradient and weight-gradient products each cost
one forward; Qi et al., ICLR 2024, arXiv 2401.10241 §2), and a recompute R costs one forward.

Under tensor and data parallelism a cost view belongs to one replica of the pipeline (its devices are
``layout.device(p, replica, 0)``), and its messages and collectives are costed with every symmetric instance that
runs at the same moment: the ``tp`` shards of each stage, and the replicas in ``concurrent`` (those the engine does
not simulate separately because they are identical to this one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sim.core.errors import SpecError
from sim.cost import fsdp
from sim.cost.comm_cost import CommCost, sequential_cost
from sim.cost.expert_exchange import expert_exchange_cost
from sim.cost.gradient_buckets import bucket_bytes, bucketed, exposed_gather_s
from sim.cost.ledger import IN_PLACE, ReductionMemory
from sim.cost.oracle import CostOracle
from sim.cost.profile import MeasuredProfile
from sim.cost.tensor_parallel_op import tensor_parallel_op_cost
from sim.hw.catalog import DeviceSpec
from sim.hw.topology import Topology
from sim.ir.ops import OP_SEMANTICS, SPLIT_BACKWARD_KINDS
from sim.ir.parallel import Parallelism
from sim.ir.plan import DP_KINDS, EP_KINDS, OpKind, Placement
from sim.models.graph import LayerGraph

__all__ = ["CostView", "replica_views"]


#: Bytes per parameter of an FSDP gradient accumulated unsharded over a step's microbatches: fp32, the reduce dtype
#: torchtitan gives FSDP2 (:meth:`CostView.held_gradient_bytes`).
REDUCE_DTYPE_BYTES = 4

#: A memo's marker for a quantity not asked yet (a size may be ``None``: :meth:`CostView.deferred_bytes`).
_MISSING = object()

class CostView:
    """Durations and sizes of the ops of one plan: a model partitioned onto a topology.

    Args:
        graph: the model.
        topology: the hardware; vstage v runs on ``topology.devices[placement.vstage_to_rank[v]]``.
        placement: layers of each vstage and rank of each vstage.
        microbatch_size: samples per microbatch.
        profile: optional measured profile (used on ranks whose device it was measured on).
        oracle: the oracle to ask, when the caller already has one for this graph, size, profile and topology.
        layout: the plan's tensor × data × pipeline layout (default: a pure pipeline, pipeline rank p on device p).
        replica: the data-parallel replica this view costs.
        concurrent: the replicas whose identical messages and collectives run at the same moment as this one's
            (default: this replica alone).

    Raises:
        SpecError: the placement does not cover the model or uses devices the topology lacks.
    """

    def __init__(self, graph: LayerGraph, topology: Topology, placement: Placement, microbatch_size: int,
                 profile: MeasuredProfile | None = None, *, oracle: CostOracle | None = None,
                 layout: Parallelism | None = None, replica: int = 0,
                 concurrent: tuple[int, ...] | None = None) -> None:
        if placement.num_layers != len(graph):
            raise SpecError(f"placement covers {placement.num_layers} layers but the model has {len(graph)}")
        layout = layout if layout is not None else Parallelism(pp=max(placement.vstage_to_rank) + 1)
        if layout.world_size > topology.num_ranks or max(placement.vstage_to_rank) >= layout.pp:
            raise SpecError(f"placement uses pipeline rank {max(placement.vstage_to_rank)} of {layout.describe()} "
                            f"but the topology has {topology.num_ranks} devices")
        self.oracle = oracle or CostOracle(graph, microbatch_size, profile, topology)
        self.graph, self.topology, self.placement = graph, topology, placement
        self.microbatch_size, self.profile = microbatch_size, profile
        self.layout, self.replica = layout, replica
        self.concurrent = concurrent if concurrent is not None else (replica,)
        #: The device of each pipeline rank in this replica (tensor shard 0 stands for its group).
        self.devices = tuple(layout.device(p, replica, 0) for p in range(layout.pp))
        self._messages: dict[tuple[OpKind, int, int, int], CommCost] = {}
        self._collective_costs: dict[tuple[OpKind, int], CommCost] = {}
        self._times: list[dict[OpKind, float]] = []
        # Each vstage's sizes on its own device: a measured profile's memory applies where its device does.
        self._sized = [(a, b, topology.devices[self.devices[rank]])
                       for (a, b), rank in zip(placement.vstage_layers, placement.vstage_to_rank)]
        # Memory per vstage, each quantity asked of the oracle on first use and kept: the engine reads them for every
        # op, while a search's bound reads a few of them for thousands of views (sim.search.bound).
        self._sizes: dict[tuple[str, int], object] = {}
        stepped: set[int] = set()
        for v, (start, end) in enumerate(placement.vstage_layers):
            rank = placement.vstage_to_rank[v]
            device = topology.devices[self.devices[rank]]
            costs = self.oracle.layer_costs(device)
            f, b = sum(costs.fwd[start:end]), sum(costs.bwd[start:end])
            # A rank pays the framework's per-step overhead once, with its first chunk's update, and its
            # per-microbatch overhead with its first chunk's forward (not with a recomputation of it).
            first = rank not in stepped
            step = sum(costs.opt[start:end]) + (self.oracle.step_overhead_s(device) if first else 0.0)
            if layout.zero == 3:  # each layer gathered and scattered inside the forward and backward
                gather = self._fsdp_collectives("all_gather", rank, start, end, device)
                scatter = self._fsdp_collectives("reduce_scatter", rank, start, end, device)
                if layout.dp_replicate > 1:  # HSDP: each gradient shard then all-reduced across the shard groups
                    across = self._fsdp_collectives("all_reduce", rank, start, end, device)
                    scatter = [a + b for a, b in zip(scatter, across)]
                if layout.fsdp_gathers_per_step:  # gathered and scattered once per step, by ops of their own
                    gather = scatter = [0.0] * (end - start)
                f_total = fsdp.forward_seconds(costs.fwd[start:end], gather)
                b = fsdp.backward_seconds(costs.bwd[start:end], gather if layout.reshard_after_forward else None,
                                          scatter)
            else:
                f_total = f
            forward = f_total + (self.oracle.microbatch_overhead_s(device) if first else 0.0)
            stepped.add(rank)
            # A recomputation re-runs the forward inside the backward, with the parameters the backward gathers.
            split = {part: b * share for part, share in SPLIT_BACKWARD_KINDS.items()}  # I and W: module docstring
            self._times.append({OpKind.F: forward, OpKind.B: b, **split, OpKind.R: f, OpKind.OPT_STEP: step})

    def _fsdp_collectives(self, name: str, pipeline_rank: int, start: int, end: int,
                          device: DeviceSpec) -> list[float]:
        """Under ZeRO-3, the seconds of each layer's all-gather of its parameters or reduce-scatter of its gradients
        (``name``) over the shard groups of ``pipeline_rank`` (the data-parallel groups without HSDP), every tensor
        shard's and every HSDP group's at once; or (``all_reduce``, HSDP) of the all-reduce of each layer's gradient
        shard across the replicate groups."""
        layout = self.layout
        if name == "all_reduce":
            groups = tuple(layout.replicate_group(pipeline_rank, t, i) for t in range(layout.tp)
                           for i in range(layout.dp_shard))
        else:
            groups = tuple(layout.shard_group(pipeline_rank, t, g) for t in range(layout.tp)
                           for g in range(layout.dp_replicate))
        if len(groups[0]) == 1:
            return [0.0] * (end - start)  # a group of one has nothing to exchange
        memory = self.oracle.memory
        sizes = (self.gather_bytes(i, device) if name == "all_gather" else
                 memory.gradient_bytes(i, i + 1, device) // (layout.dp_shard if name == "all_reduce" else 1)
                 for i in range(start, end))
        return [self.oracle.collective(name, groups, nbytes).seconds if nbytes else 0.0 for nbytes in sizes]

    def compute_time(self, kind: OpKind, vstage: int) -> float:
        """Duration in s of a compute-stream op (F, B, I, W, R, OPT_STEP) of ``vstage``; 0 for bookkeeping ops."""
        return self._times[vstage].get(kind, 0.0)

    def message_bytes(self, kind: OpKind, vstage: int) -> int:
        """Bytes of one SEND/RECV: the activation leaving ``vstage`` forward, or the gradient leaving it backward."""
        start, end = self.placement.vstage_layers[vstage]
        if OpKind.F in OP_SEMANTICS[kind].follows:  # SEND_F, RECV_F: the forward's activation
            cut = end if kind is OpKind.SEND_F else start
        else:
            cut = start if kind is OpKind.SEND_B else end
        return self.oracle.boundary_bytes(cut)

    def device_index_of(self, pipeline_rank: int) -> int:
        """The index in ``topology.devices`` (the topology rank) of the device that pipeline rank ``pipeline_rank`` of
        this replica runs on; :meth:`sim.cost.oracle.CostOracle.device_spec` gives a topology rank's device."""
        return self.devices[pipeline_rank]

    def message(self, kind: OpKind, vstage: int, src: int, dst: int) -> CommCost:
        """The cost of a SEND of ``vstage`` from pipeline rank ``src`` to ``dst``.

        Every tensor shard of this replica (and of each concurrent replica) sends its own copy at once, so they share
        links, which ``seconds`` accounts for; ``held_links`` are the simulated instance's own path (what the engine
        occupies), ``bytes_per_link`` what all instances together put on each link."""
        key = (kind, vstage, src, dst)
        cost = self._messages.get(key)
        if cost is None:
            nbytes = self.message_bytes(kind, vstage)
            pairs = self.layout.pipeline_pairs(src, dst, self.concurrent)
            seconds, link_bytes = self.oracle.concurrent_transfer(pairs, nbytes)
            own = self.topology.link_keys(self.devices[src], self.devices[dst])
            cost = self._messages[key] = CommCost(nbytes, seconds, own, ((link_bytes, 1),))
        return cost

    def collective_op(self, kind: OpKind, vstage: int) -> CommCost:
        """The cost of a collective op of ``vstage`` (TP_F, TP_B, TP_R, REDUCE_GRAD, GATHER_PARAMS), with every
        concurrent group of it running at once (as :meth:`message`; a TP op holds its own group's links, a
        data-parallel collective, which is one op of every replica, all of its groups').

        A TP op runs each of the stage's layers' tensor-parallel collectives in turn (all-reduces, or reduce-scatter
        plus all-gather under sequence parallelism); ``nbytes`` is their buffers summed. REDUCE_GRAD all-reduces the
        stage's gradients (reduce-scatters them under ZeRO-1), GATHER_PARAMS all-gathers its parameters.
        """
        key = (kind, vstage)
        cost = self._collective_costs.get(key)
        if cost is None:
            cost = self._collective_costs[key] = self._collective_cost(kind, vstage)
        return cost

    def host_copy(self, kind: OpKind, vstage: int, pipeline_rank: int) -> CommCost:
        """The cost of a PREFETCH (host → device) or EVICT (device → host) of ``vstage``'s weights on pipeline rank
        ``pipeline_rank``: the oracle's copy time (:meth:`sim.cost.oracle.CostOracle.host_to_device_s`, a measured
        profile's bandwidth where it applies), holding the rank's PCIe path in that direction (its copy engine)."""
        device, nbytes = self.devices[pipeline_rank], self.param_bytes(vstage)
        if kind is OpKind.PREFETCH:
            path, seconds = self.topology.host_to_device_path(device), self.oracle.host_to_device_s(device, nbytes)
        else:
            path, seconds = self.topology.device_to_host_path(device), self.oracle.device_to_host_s(device, nbytes)
        keys = tuple(sorted((link.src, link.dst) for link in path))
        return CommCost(nbytes, seconds, keys, ((tuple((key, nbytes) for key in keys), 1),))

    def gradient_buckets(self, vstage: int) -> tuple[int, float]:
        """``(K, s)``: the buckets ``vstage``'s gradients are reduced in when the reduction overlaps the backward, and
        one bucket's time with every concurrent group (:func:`sim.cost.gradient_buckets.bucketed`)."""
        return bucketed(self._data_parallel(OpKind.REDUCE_GRAD, vstage), self.gradient_bucket_bytes(), self.oracle)

    def gradient_bucket_bytes(self) -> int:
        """Bytes of one bucket of an overlapped reduction or gather (:func:`sim.cost.gradient_buckets.bucket_bytes`)."""
        return bucket_bytes(self.layout, self.graph.dtype_bytes)

    def overlapped_gather_s(self, vstage: int) -> float:
        """Under ``param_gather_overlap``, the seconds of ``vstage``'s parameter all-gather that its first forward
        cannot hide, s (:func:`sim.cost.gradient_buckets.exposed_gather_s`, in the buckets its gradients are reduced
        in)."""
        count, each = bucketed(self._data_parallel(OpKind.GATHER_PARAMS, vstage), self.gradient_bucket_bytes(),
                               self.oracle)
        return exposed_gather_s(count, each, self.compute_time(OpKind.F, vstage))

    def _data_parallel(self, kind: OpKind, vstage: int) -> list[tuple[str, tuple[tuple[int, ...], ...], int]]:
        """``(collective, groups, bytes)`` parts of a REDUCE_GRAD or GATHER_PARAMS of ``vstage``: every tensor shard's
        data-parallel group at once, over the stage's parameter (gradient) bytes but the routed experts'; and every
        expert-data-parallel group at once over the experts' (:mod:`sim.ir.parallel`), where there are experts."""
        layout = self.layout
        start, end = self.placement.vstage_layers[vstage]
        rank = self.placement.vstage_to_rank[vstage]
        groups = layout.dp_groups(rank)
        name = ("all_gather" if kind is OpKind.GATHER_PARAMS else
                "reduce_scatter" if layout.zero else "all_reduce")
        experts = sum(layer.expert_param_bytes for layer in self.graph.layers[start:end])
        parts = [(name, groups, self.oracle.memory.param_bytes(start, end) - experts)]
        if experts:
            expert_groups = tuple(layout.expert_dp_group(rank, e, t) for e in range(layout.ep)
                                  for t in range(layout.etp))
            parts.append((name, expert_groups, experts))
        return parts

    def _fsdp_per_step(self, kind: OpKind, vstage: int) -> list[tuple[str, tuple[tuple[int, ...], ...], int]]:
        """``(collective, groups, bytes)`` parts of a GATHER_PARAMS or REDUCE_GRAD of ``vstage`` under ZeRO-3 with the
        parameters kept for the step (``Parallelism.fsdp_gathers_per_step``): each layer (one FSDP unit) in turn, its
        parameters all-gathered, or its gradients reduce-scattered over the shard groups (and under HSDP the shard
        all-reduced over the replicate groups), every tensor shard's group at once; the same groups and bytes as
        :meth:`_fsdp_collectives` costs inside a forward and backward, once per step instead of per microbatch."""
        layout = self.layout
        start, end, device = self._sized[vstage]
        rank = self.placement.vstage_to_rank[vstage]
        shard = tuple(layout.shard_group(rank, t, g) for t in range(layout.tp) for g in range(layout.dp_replicate))
        replicate = tuple(layout.replicate_group(rank, t, i) for t in range(layout.tp)
                          for i in range(layout.dp_shard))
        memory, parts = self.oracle.memory, []
        for i in range(start, end):
            if kind is OpKind.GATHER_PARAMS:
                parts.append(("all_gather", shard, self.gather_bytes(i, device)))
                continue
            gradients = memory.gradient_bytes(i, i + 1, device)
            parts.append(("reduce_scatter", shard, gradients))
            if layout.dp_replicate > 1:
                parts.append(("all_reduce", replicate, gradients // layout.dp_shard))
        return [part for part in parts if part[2] and len(part[1][0]) > 1]

    def _collective_cost(self, kind: OpKind, vstage: int) -> CommCost:
        layout, oracle = self.layout, self.oracle
        if kind in EP_KINDS:  # forward, backward and recompute exchange the same tokens (gradients backward)
            start, end = self.placement.vstage_layers[vstage]
            return expert_exchange_cost(self.graph.layers[start:end], self.layout,
                                        self.placement.vstage_to_rank[vstage], self.oracle, self.microbatch_size,
                                        self.graph.dtype_bytes)
        if kind in DP_KINDS:
            # What follows depends on the topology and the collectives' groups and buffers alone: kept in the
            # topology's memo, for every view of a search that asks the same op of the same groups.
            memo = self.topology.cost_memo
            collectives = tuple(self._fsdp_per_step(kind, vstage) if layout.zero == 3 else
                                self._data_parallel(kind, vstage))
            found = memo.get(("data-parallel op", collectives))
            if found is None:
                parts, held = [], set()
                for name, groups, nbytes in collectives:
                    cost = oracle.collective(name, groups, nbytes)
                    parts.append((cost, 1, nbytes))
                    held.update(cost.link_keys)
                found = memo[("data-parallel op", collectives)] = sequential_cost(parts, tuple(sorted(held)))
            if kind is OpKind.GATHER_PARAMS and layout.param_gather_overlap:  # the bytes all move; part is exposed
                return replace(found, seconds=self.overlapped_gather_s(vstage))
            return found
        groups = layout.tp_groups(self.placement.vstage_to_rank[vstage], self.concurrent)
        own = groups[self.concurrent.index(self.replica)]
        start, end, device = self._sized[vstage]
        return tensor_parallel_op_cost(self.graph.layers, start, end, layout, groups, own, oracle, device,
                                       self.microbatch_size, kind is OpKind.TP_B)

    def profiled_ranks(self, num_ranks: int | None = None) -> tuple[int, ...]:
        """Ranks whose measured times replace the roofline (:meth:`sim.cost.oracle.CostOracle.profiled_ranks`)."""
        return self.oracle.profiled_ranks(num_ranks)

    def uses_measured_p2p(self, num_ranks: int | None = None) -> bool:
        """Whether transfers take the profile's p2p fit (:meth:`sim.cost.oracle.CostOracle.uses_measured_p2p`)."""
        return self.oracle.uses_measured_p2p(num_ranks)

    def _size(self, quantity: str, vstage: int, **options: bool) -> Any:
        """``vstage``'s ``quantity`` on its own device: the :class:`sim.cost.memory_sizes.MemorySizes` method of
        that name over the stage's layers (with ``options``), asked once and kept."""
        key = (quantity, vstage, *options.values())
        found = self._sizes.get(key, _MISSING)
        if found is _MISSING:
            start, end, device = self._sized[vstage]
            found = self._sizes[key] = getattr(self.oracle.memory, quantity)(start, end, device, **options)
        return found

    def param_bytes(self, vstage: int) -> int:
        """Weight bytes of ``vstage`` (what a PREFETCH or EVICT of the stage moves)."""
        return self._size("param_bytes", vstage)

    def state_bytes(self, vstage: int) -> int:
        """Resident training state of ``vstage`` in bytes: weights, gradients, optimizer state."""
        return self._size("state_bytes", vstage)

    def activation_bytes(self, vstage: int) -> int:
        """Bytes one in-flight microbatch keeps on the device from its forward to its backward (without the output it
        sends where the layout's runtime frees it: ``Parallelism.deallocate_pipeline_outputs``)."""
        return self._size("activation_bytes", vstage, output_freed=self.layout.deallocate_pipeline_outputs)

    def checkpoint_bytes(self, vstage: int) -> int:
        """Bytes one in-flight microbatch keeps from forward to backward when its activations are recomputed: the
        input of every layer of the stage (:meth:`sim.cost.oracle.CostOracle.checkpoint_bytes`)."""
        return self._size("checkpoint_bytes", vstage)

    def rebuilt_bytes(self, vstage: int) -> int:
        """Bytes a recomputed microbatch holds again from its R op to the end of its backward: one layer's saved
        tensors at a time, the largest layer's (:meth:`sim.cost.oracle.CostOracle.rebuilt_bytes`)."""
        return self._size("rebuilt_bytes", vstage)

    def workspace_bytes(self, vstage: int) -> int:
        """Transient bytes while one forward or recompute op of ``vstage`` runs."""
        return self._size("workspace_bytes", vstage)

    def backward_workspace_bytes(self, vstage: int) -> int:
        """Transient bytes while one backward op (B, I, W) of ``vstage`` runs, beyond its weight gradients."""
        return self._size("backward_workspace_bytes", vstage)

    def backward_peak_bytes(self, vstage: int, new_gradients: bool) -> int:
        """How far above its starting level a B of ``vstage`` peaks beyond the gradient buffers it makes (with
        ``new_gradients``), layer by layer (:meth:`sim.cost.oracle.CostOracle.backward_peak_bytes`); may be
        negative."""
        return self._size("backward_peak_bytes", vstage, new_gradients=new_gradients)

    def input_backward_bytes(self, vstage: int) -> int:
        """The most a split backward's I of ``vstage`` holds above its starting level
        (:meth:`sim.cost.oracle.CostOracle.input_backward_bytes`)."""
        return self._size("input_backward_bytes", vstage)

    def weight_backward_bytes(self, vstage: int) -> int:
        """The most a split backward's W of ``vstage`` holds above its starting level
        (:meth:`sim.cost.oracle.CostOracle.weight_backward_bytes`)."""
        return self._size("weight_backward_bytes", vstage)

    def deferred_bytes(self, vstage: int) -> int | None:
        """Bytes an I of ``vstage`` keeps for its W, where measured (else ``None``)."""
        return self._size("deferred_bytes", vstage)

    def gradient_bytes(self, vstage: int) -> int:
        """Weight-gradient bytes of ``vstage`` (part of :meth:`state_bytes`)."""
        return self._size("gradient_bytes", vstage)

    def deferred_gradient_bytes(self, vstage: int) -> int:
        """Of :meth:`gradient_bytes`, those a split backward's W makes (:meth:`sim.cost.oracle.CostOracle.
        deferred_gradient_bytes`)."""
        return self._size("deferred_gradient_bytes", vstage)

    def gathered_bytes(self, vstage: int, backward: bool) -> int:
        """Under ZeRO-3, bytes a forward (``backward`` False) or backward op of ``vstage`` gathers on top of its
        workspace while it runs (:mod:`sim.cost.fsdp`); 0 otherwise."""
        return self._gathered(vstage)[backward]

    def gather_bytes(self, layer: int, device: DeviceSpec) -> int:
        """Bytes of layer ``layer``'s parameters as ZeRO-3 gathers and holds them on ``device``: its parameter bytes,
        or under ``fsdp_float8_gather`` a block's linear weights at one byte a parameter (torchao casts each
        Float8Linear weight shard to FP8 before the all-gather and its GEMMs read the gathered FP8 weight;
        torchtitan's ``float8.enable_fsdp_float8_all_gather``). A block's norm weights stay in the training dtype
        (two of ``hidden`` each; QK-norm's and a latent attention's few are counted at one byte, under 0.1 % of a
        block); the embedding and the head are not Float8Linear (torchtitan's converter leaves the output layer
        out)."""
        full = self.oracle.memory.param_bytes(layer, layer + 1, device)
        part = self.graph.layers[layer].transformer
        if not self.layout.fsdp_float8_gather or part is None or part.part != "block":
            return full
        dtype = self.graph.dtype_bytes
        norms = 2 * part.hidden * dtype
        return norms + (full - norms) // dtype

    def held_gathered_bytes(self, vstage: int) -> int:
        """Under ZeRO-3 without resharding after the forward, the gathered parameter bytes ``vstage`` keeps from a
        forward to the backward of the last microbatch in flight; 0 otherwise."""
        if self.layout.zero != 3 or self.layout.reshard_after_forward:
            return 0
        key = ("held gathered", vstage)
        found = self._sizes.get(key)
        if found is None:  # the engine asks for every op of the stage
            start, end, device = self._sized[vstage]
            found = self._sizes[key] = sum(self.gather_bytes(i, device) for i in range(start, end))
        return found

    def held_gradient_bytes(self, vstage: int) -> int:
        """Under ZeRO-3 gathered for the step (``Parallelism.fsdp_gathers_per_step``), the whole (unsharded) gradient
        bytes ``vstage`` accumulates over the step's microbatches until their one reduce-scatter; 0 otherwise.

        They accumulate in fp32 whatever the model's dtype: FSDP2 upcasts an unsharded gradient to its reduce dtype
        once it accumulates without syncing (``FSDPParam.to_accumulated_grad_if_needed`` in ``torch/distributed/fsdp/
        _fully_shard/_fsdp_param.py``), and torchtitan reduces in fp32 (``MixedPrecisionPolicy(reduce_dtype=...)``
        from ``training.mixed_precision_reduce = "float32"``), so each parameter holds 4 bytes, or what a measured
        profile says when that is more."""
        if not self.layout.fsdp_gathers_per_step:
            return 0
        key = ("held gradients", vstage)
        found = self._sizes.get(key)
        if found is None:
            start, end, device = self._sized[vstage]
            found = self._sizes[key] = sum(max(self.oracle.memory.gradient_bytes(i, i + 1, device),
                                               REDUCE_DTYPE_BYTES * self.graph.param_count(i))
                                           for i in range(start, end))
        return found

    def _gathered(self, vstage: int) -> tuple[int, int]:
        """Under ZeRO-3, what a forward and a backward of ``vstage`` gather on top of their workspace, bytes (the
        forward nothing when the parameters stay gathered after it: :meth:`held_gathered_bytes`); ``(0, 0)``
        otherwise."""
        if self.layout.zero != 3 or self.layout.fsdp_gathers_per_step:  # per step: held all step instead
            return 0, 0
        key = ("gathered", vstage)
        found = self._sizes.get(key)
        if found is None:
            start, end, device = self._sized[vstage]
            memory = self.oracle.memory
            params = [self.gather_bytes(i, device) for i in range(start, end)]
            gradients = [memory.gradient_bytes(i, i + 1, device) for i in range(start, end)]
            kept = not self.layout.reshard_after_forward
            found = self._sizes[key] = (0 if kept else fsdp.forward_gathered_bytes(params),
                                        fsdp.backward_gathered_bytes(params, gradients, gather=not kept))
        return found

    def reduction_memory(self, vstage: int) -> ReductionMemory:
        """What a data-parallel reduction of ``vstage``'s gradients holds, where the cost source says the framework
        reduces a flat copy of them (the executor, ``executor.data_parallel``): under ZeRO-1 and 2 the copy until the
        reduction ends (nothing references it once its reduce-scatter has completed) and the replica's slice of the
        result, 1/D of it, until the update (which takes it as its gradient), ZeRO-2's copy replacing the
        microbatch's gradients (the next backward makes them afresh); otherwise the copy itself until the update
        (plain data parallelism: its all-reduce's result is scattered back into the gradients at the update;
        ZeRO-3's per-step reduction, not measured apart). Nothing where gradients are reduced in place."""
        if not self.oracle.reduction_copies(self._sized[vstage][2]):
            return IN_PLACE
        flat = self.gradient_bytes(vstage)
        if self.layout.zero not in (1, 2):
            return ReductionMemory(until_update=flat)
        return ReductionMemory(until_update=-(-flat // self.layout.data_ranks), until_end=flat,
                               takes_gradients=self.layout.zero == 2)

    def gradients_per_step(self, vstage: int) -> bool:
        """Whether ``vstage``'s weight gradients exist only from its first backward op after an update to the next
        update (PyTorch's ``zero_grad(set_to_none=True)``, as the executor runs; a measured profile says so), rather
        than for the whole run (Megatron's contiguous gradient buffer)."""
        return self.oracle.gradients_per_step(self._sized[vstage][2])


def replica_views(graph: LayerGraph, topology: Topology, placement: Placement, microbatch_size: int,
                  profile: MeasuredProfile | None = None, *, oracle: CostOracle | None = None,
                  layout: Parallelism | None = None, simulate_all: bool = False) -> tuple[CostView, ...]:
    """The cost views the engine needs for a plan: one when its data-parallel replicas are identical, else one per
    replica.

    Replicas are identical when every (pipeline rank, tensor shard) runs on the same device model in each, and the
    links between consecutive pipeline ranks and inside each tensor-parallel group are the same link types; then
    one replica, costed with all of them sending and reducing at the same moment, stands for all by symmetry.

    Args:
        simulate_all: one view per replica even when they are identical (to check the symmetry argument); each is
            still costed with all of them running at once, as they do.

    Raises:
        SpecError: a tensor-parallel group mixes device models (its shards would wait for the slowest; not modelled).
    """
    layout = layout if layout is not None else Parallelism(pp=max(placement.vstage_to_rank) + 1)
    oracle = oracle or CostOracle(graph, microbatch_size, profile, topology)
    key = ("identical replicas", layout)  # a search builds views of one layout for many candidates
    identical = topology.cost_memo.get(key)
    if identical is None:
        _check_tensor_groups(topology, layout)
        first = _replica_signature(topology, layout, 0)
        identical = topology.cost_memo[key] = all(_replica_signature(topology, layout, d) == first
                                                  for d in range(1, layout.data_ranks))
    everyone = tuple(range(layout.data_ranks))
    if identical and not simulate_all:
        return (CostView(graph, topology, placement, microbatch_size, profile, oracle=oracle, layout=layout,
                          replica=0, concurrent=everyone),)
    # Identical replicas simulated one by one still send and reduce at the same moments, so each is costed with all
    # of them (and the engine lets their copies of one op share links); different replicas are costed alone.
    return tuple(CostView(graph, topology, placement, microbatch_size, profile, oracle=oracle, layout=layout,
                           replica=d, concurrent=everyone if identical else (d,)) for d in everyone)


def _check_tensor_groups(topology: Topology, layout: Parallelism) -> None:
    """Refuse a layout whose tensor-parallel group mixes device models (:func:`replica_views`).

    Raises:
        SpecError: naming the group, its devices and models.
    """
    devices = topology.devices
    for p in range(layout.pp):
        for d in range(layout.data_ranks):
            names = {devices[r].name for r in layout.tp_group(p, d)}
            if len(names) > 1:
                raise SpecError(f"the tensor-parallel group of pipeline rank {p}, replica {d} (devices "
                                f"{list(layout.tp_group(p, d))}) mixes {', '.join(sorted(names))}; tensor "
                                f"parallelism needs one device model per group (try another --rank-order)")


def _replica_signature(topology: Topology, layout: Parallelism, replica: int) -> tuple:
    """What must agree between two replicas for one to stand for the other: device models, and the link types on
    every pipeline hop and tensor-parallel ring hop."""
    def hop(a: int, b: int) -> tuple[str, ...]:
        return tuple(link.spec.name for link in topology.path(a, b)) if a != b else ()
    models = tuple(topology.devices[layout.device(p, replica, t)].name
                   for p in range(layout.pp) for t in range(layout.tp))
    pipeline_hops = tuple(hop(layout.device(p, replica, t), layout.device(p + 1, replica, t))
                          for p in range(layout.pp - 1) for t in range(layout.tp))
    ring_hops = tuple(hop(group[t], group[(t + 1) % len(group)])
                      for p in range(layout.pp) for group in (layout.tp_group(p, replica),) for t in range(len(group)))
    return models, pipeline_hops, ring_hops
