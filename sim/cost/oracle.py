"""The one cost oracle: seconds and bytes of layers, stages and messages of one model on one topology (DESIGN §5).

Every consumer asks this object and nothing else: the partitioner (a candidate stage's time), the plan's cost view
that the SimPy engine reads (:class:`sim.cost.cost_view.CostView`), NASPipe's CSP (each subnet's layers on each stage,
host↔device copies), the executor's prediction and its calibration prior. So a profile's measured times and its
measured point-to-point fit apply everywhere they apply, or nowhere.

A layer's time on a device is, in order of preference:

1. a device-independent synthetic time (the ``uniform`` model's ``fwd_ms``/``bwd_ms``), scaled by microbatch size;
2. a measured time from a profile whose device matches (``--profile``), scaled linearly from the profile's
   microbatch size;
3. on a GPU, for a GPT layer (one that carries its ``transformer`` dimensions), the kernel-level model of
   :mod:`sim.cost.gpu_time`: the layer's kernels issued by the host and run in order by the GPU;
4. otherwise a roofline estimate: ``max(flops / (peak × efficiency), bytes_moved / memory_bandwidth) +
   launch_overhead``, where ``peak`` is the fp16/bf16 tensor-core peak, or for an fp32 model (``dtype_bytes`` 4:
   the ``cnn`` and ``vgg16`` zoo models) the FP32 CUDA-core peak (:attr:`DeviceSpec.peak_fp32_flops`; a V100's
   15.7 TFLOP/s, not its 125). It does not model TF32: on A100 and later PyTorch runs fp32 convolutions on the
   tensor cores in TF32 by default (``torch.backends.cudnn.allow_tf32`` is True; matmuls stay full fp32), so there
   the roofline overstates an fp32 convolution's time. A composite layer's memory-bound elementwise ops
   (``Layer.elementwise_bytes``) add ``bytes / memory_bandwidth`` to its forward and twice that to its backward.

Between GPUs every collective and point-to-point message is an NCCL call: its link time becomes the cheapest NCCL
protocol's time (:mod:`sim.cost.nccl`: base and per-step latencies, LL's halved bandwidth). On a GPU each optimizer
step and each microbatch also pay the kernel model's framework overheads (:meth:`CostOracle.step_overhead_s`,
:meth:`CostOracle.microbatch_overhead_s`).

A slowed device (:func:`sim.hw.catalog.slowed_device`, a topology file's ``slowdown:``) takes its catalog device's
time for every layer and overhead, by whichever rule above applies there (its profile included), times its factor.

A point-to-point message between two ranks that both run on the profile's device takes the profile's fitted
``latency + bytes / bandwidth`` when it has one (measured between two processes of that machine), else the
topology's link model; a host↔device copy on the profile's device takes its measured pinned-memory bandwidth
(``profiles.host_copy``) when it has one, else the link model of the PCIe path.

Memory follows mixed-precision Adam: fp16 weights and gradients plus fp32 master weights, momentum and variance, 16
bytes per parameter (Rajbhandari et al., ZeRO, arXiv 1910.02054 §3.1); under ZeRO-1 the 12 bytes of optimizer state
are split across the data-parallel replicas (ZeRO §5.1, P_os: (2 + 2 + 12/N_d) bytes).

Collectives (tensor- and data-parallel) and point-to-point messages that several symmetric instances send at once
(the tensor-parallel shards of a stage each send their part to the next stage) are costed with the flow model of
:mod:`sim.cost.collectives`: a link that ``c`` concurrent flows cross gives each ``1/c`` of its bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from sim.core.errors import SpecError
from sim.cost.collectives import (
    CollectiveCost,
    all_to_all_cost,
    collective_cost,
    concurrent_transfer,
    deduplicated_all_to_all_cost,
)
from sim.cost.context_parallel import KvExchange, exposed_seconds, kv_exchange
from sim.cost.gpu_time import (
    KernelModel,
    async_tp_gemm_seconds,
    default_kernel_model,
    optimizer_seconds,
    transformer_layer_seconds,
)
from sim.cost.kernels.record import Narrow
from sim.cost.memory_sizes import WHOLE_STATE, MemorySizes, StateShards, layer_input_bytes, state_bytes_per_param
from sim.cost.nccl import link_class, nccl_seconds
from sim.cost.profile import LayerMemory, MeasuredProfile
from sim.hw.catalog import DeviceSpec
from sim.hw.topology import Topology, message_time
from sim.models.graph import LayerGraph, TransformerPart

__all__ = ["CostOracle", "LayerCosts"]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer times on one device for one microbatch, in s (index = layer)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    opt: tuple[float, ...]


class CostOracle:
    """Durations (s) and sizes (bytes) of one model's layers, stages and messages at one microbatch size.

    Args:
        graph: the model.
        microbatch_size: samples per microbatch.
        profile: optional measured profile; it applies on devices whose name equals its ``device``.
        topology: the hardware, needed for rank-based questions (transfers, copies, a rank's device); layer costs on
            a given :class:`~sim.hw.catalog.DeviceSpec` need none.
        shards: over how many data-parallel replicas the weights, gradients and optimizer state are split (ZeRO's
            stages; whole by default).
            The graph itself is what one device holds: a tensor-parallel shard (``sim.models.build_model``'s
            ``sharding``).
        kernel_model: the software constants of the GPU kernel model (default: the built-in, fitted ones).
        cuda_graphs: cost a step captured as a CUDA graph (``--cuda-graphs``: PARTIME's cure for per-step overhead,
            Megatron-Core's full-iteration graphs): the roofline's per-op overhead (``launch_overhead_us`` of the
            catalog), the kernel model's host issue per kernel (:attr:`issued_kernel_model`) and its framework
            overheads per microbatch go, and each optimizer step pays one graph launch instead
            (:meth:`step_overhead_s`). What remains is the kernels' own time.
        narrow: the linears of the Llama- and MoE-family blocks run in this low-precision format (``--precision fp8``,
            ``mxfp8`` or ``nvfp4``; :class:`sim.cost.kernels.record.Narrow`), or None.
        compiled: the Llama-family blocks run under ``torch.compile`` (``--compile``;
            :mod:`sim.cost.kernels.pointwise`).
        cp_groups: under context parallelism, the context-parallel groups of the first pipeline stage's first
            replica, one per tensor shard, each in sequence-part order: where the key/value exchange is costed.
        cp_comm: how the exchange travels (:data:`sim.cost.context_parallel.CP_COMMS`).

    Raises:
        SpecError: ``microbatch_size`` < 1.
    """

    def __init__(self, graph: LayerGraph, microbatch_size: int, profile: MeasuredProfile | None = None,
                 topology: Topology | None = None, *, shards: StateShards = WHOLE_STATE,
                 kernel_model: KernelModel | None = None, cuda_graphs: bool = False, narrow: Narrow | None = None,
                 compiled: bool = False, cp_groups: tuple[tuple[int, ...], ...] = (), cp_comm: str = "ring") -> None:
        if microbatch_size < 1:
            raise SpecError(f"microbatch size must be >= 1, got {microbatch_size}")
        self.graph, self.microbatch_size, self.profile, self._topology = graph, microbatch_size, profile, topology
        self.shards = shards
        self._kernel_model = kernel_model
        self._issued_kernel_model: KernelModel | None = None
        self.cuda_graphs = cuda_graphs
        self.narrow = narrow
        self.compiled = compiled
        self.cp_groups, self.cp_comm = cp_groups, cp_comm
        self._transformer: bool | None = None
        # Collective costs depend on the topology alone, so they are kept in its memo and shared by every oracle on
        # it (a search builds one oracle per candidate and asks each the same collectives).
        self._collectives: dict[tuple, Any] = topology.cost_memo if topology is not None else {}
        self._kv_exchanges: dict[TransformerPart, KvExchange] = {}
        self._async_tp: dict[tuple[int, str, bool], tuple[tuple[str, float, float], ...]] = {}
        self._p2p = None
        if profile is not None and profile.p2p_latency_s is not None and profile.p2p_bandwidth:
            self._p2p = (profile.p2p_latency_s, profile.p2p_bandwidth)
        self._by_device: dict[str, LayerCosts] = {}
        self._prefix: dict[str, list[float]] = {}
        #: The bytes of layer ranges (sim.cost.memory_sizes), measured where the profile applies.
        self.memory = MemorySizes(graph, microbatch_size, shards, self.measured_memory,
                                  profile.microbatch_size if profile is not None else 1)

    @property
    def kernel_model(self) -> KernelModel:
        """The GPU kernel model's constants (the built-in ones unless given), read on first use."""
        if self._kernel_model is None:
            self._kernel_model = default_kernel_model()
        return self._kernel_model

    @property
    def issued_kernel_model(self) -> KernelModel:
        """The kernel model as this plan's kernels reach the GPU: issued one by one by the framework's host thread
        (:attr:`kernel_model` as it is), or, under ``cuda_graphs``, replayed from the captured step with no host work
        per kernel or collective (``host_issue_s`` and ``host_collective_s`` 0: a graph launch enqueues the whole
        step; the GPU's own gap between kernels stays). Megatron-Core's ``full_iteration`` graphs capture the whole
        forward, backward and optimizer step this way."""
        if self._issued_kernel_model is None:
            model = self.kernel_model
            self._issued_kernel_model = (replace(model, host_issue_s=0.0, host_collective_s=0.0) if self.cuda_graphs
                                         else model)
        return self._issued_kernel_model

    def step_overhead_s(self, device: DeviceSpec) -> float:
        """Framework time of one optimizer step on ``device`` outside its kernels, s: the kernel model's where it
        applies (:meth:`_framework_overheads`), else 0 (a measured step time includes it). Under CUDA graphs, one
        launch of the captured step instead (the catalog's per-op ``launch_overhead_us``; the step is one graph)."""
        if self.cuda_graphs:
            return device.launch_overhead_s
        if not self._framework_overheads(device):
            return 0.0
        return self.kernel_model.step_overhead_s * device.slowdown

    def microbatch_overhead_s(self, device: DeviceSpec) -> float:
        """Framework time per microbatch on a pipeline rank on ``device`` outside its kernels, s: the kernel model's
        where it applies (:meth:`_framework_overheads`), else 0 (measured times include it); 0 under CUDA graphs."""
        if self.cuda_graphs or not self._framework_overheads(device):
            return 0.0
        return self.kernel_model.microbatch_overhead_s * device.slowdown

    def kernel_model_applies(self, device: DeviceSpec) -> bool:
        """Whether the GPU kernel model costs this model on ``device``: a GPU, and a model with GPT layers (ones that
        carry their ``transformer`` dimensions); a synthetic or CNN model keeps the roofline."""
        if self._transformer is None:
            self._transformer = any(layer.transformer is not None for layer in self.graph.layers)
        return device.is_gpu and self._transformer

    def _framework_overheads(self, device: DeviceSpec) -> bool:
        """Whether the kernel model's framework overheads apply: where the kernel model does and no profile does.
        They were fitted on Megatron-DeepSpeed; a roofline has no framework around it."""
        return self.kernel_model_applies(device) and not self.profile_applies(device)

    def _nccl(self, seconds: float, kind: str, algorithm: str, groups: tuple[tuple[int, ...], ...]) -> float:
        """``seconds`` of link time as an NCCL call by ``groups`` (:mod:`sim.cost.nccl`; a message is a group of its
        two ranks) when their ranks are all GPUs, else unchanged."""
        devices = self.topology.devices
        if not groups or not all(devices[rank].is_gpu for group in groups for rank in group):
            return seconds
        members = max(len(group) for group in groups)
        return nccl_seconds(seconds, kind, algorithm, members, link_class(self.topology, groups))

    @property
    def topology(self) -> Topology:
        """The topology the oracle was given; ``SpecError`` if none (a device-only oracle)."""
        if self._topology is None:
            raise SpecError("this cost oracle was built without a topology; it can cost layers on a device only")
        return self._topology

    # --- layers on a device ---------------------------------------------------------------------------------------

    def profile_applies(self, device: DeviceSpec) -> bool:
        """Whether the profile was measured on ``device`` (on the catalog device a slowed one is a copy of): the one
        rule for where measured figures replace models."""
        return self.profile is not None and self.profile.device == device.hardware.name

    def layer_costs(self, device: DeviceSpec) -> LayerCosts:
        """Forward, backward and optimizer time of every layer for one microbatch on ``device`` (cached per device).

        Raises:
            SpecError: the profile applies to ``device`` but is for another model or names other layers.
        """
        cached = self._by_device.get(device.name)
        if cached is None:
            if device.base is not None:  # a slowed copy: its catalog device's times, each times the factor
                base, factor = self.layer_costs(device.base), device.slowdown
                cached = LayerCosts(*(tuple(t * factor for t in times) for times in (base.fwd, base.bwd, base.opt)))
            else:
                cached = self._compute_layer_costs(device)
            self._by_device[device.name] = cached
        return cached

    def _kv_exchange(self, part: TransformerPart) -> KvExchange | None:
        """The key/value exchange of a context-parallel block for one microbatch (:mod:`sim.cost.context_parallel`):
        each rank's K and V, ``2 · b · (s / C) · (g / t) · d`` values; ``None`` for another layer."""
        if part.cp == 1 or part.part != "block":
            return None
        found = self._kv_exchanges.get(part)
        if found is None:  # a model's blocks are identical: each costs the same exchange
            found = self._kv_exchanges[part] = self._cost_kv_exchange(part)
        return found

    def _cost_kv_exchange(self, part: TransformerPart) -> KvExchange:
        if len(self.cp_groups) == 0 or any(len(group) != part.cp for group in self.cp_groups) or self._topology is None:
            raise ValueError(f"a block split over cp={part.cp} ranks needs the oracle's cp_groups and topology")
        shard = 2 * self.microbatch_size * part.seq // part.cp * part.kv_heads // part.tp * part.head_dim \
            * self.graph.dtype_bytes
        return kv_exchange(self._topology, self.cp_groups, shard, self.cp_comm)

    def _compute_layer_costs(self, device: DeviceSpec) -> LayerCosts:
        graph, size, profile = self.graph, self.microbatch_size, self.profile
        measured = None
        if self.profile_applies(device):
            if profile.model != graph.spec:  # type: ignore[union-attr]
                raise SpecError(f"profile {profile.source} was measured for {profile.model!r}, "  # type: ignore[union-attr]
                                f"not {graph.spec!r}")
            names = tuple(t.name for t in profile.layers)  # type: ignore[union-attr]
            if names != tuple(layer.name for layer in graph.layers):
                raise SpecError(f"profile {profile.source} has layers {names[:4]}..., the model has "  # type: ignore[union-attr]
                                f"{tuple(layer.name for layer in graph.layers)[:4]}...")
            measured = profile.layers  # type: ignore[union-attr]
        # An fp32 layer runs on the CUDA cores, not the fp16 tensor cores (V100: 15.7 against 125 TFLOP/s); costing it
        # at the tensor peak made the cnn and vgg16 models 8x too fast. TF32 (A100 and later, on for cuDNN
        # convolutions by default) is not modelled: there this overstates an fp32 convolution. The efficiency was
        # measured on fp16 GEMMs; it is applied to the fp32 peak too (a V100's fp32 torch.mm reaches 0.92 of 15.7).
        peak = device.peak_fp32_flops if graph.dtype_bytes == 4 else device.peak_flops
        throughput = peak * device.matmul_efficiency  # FLOP/s
        per_param = state_bytes_per_param(graph.dtype_bytes, self.shards)
        per_expert_param = state_bytes_per_param(graph.dtype_bytes, self.shards.of_experts)
        fwd, bwd, opt = [], [], []
        for i, layer in enumerate(graph.layers):
            if layer.fwd_s is not None and layer.bwd_s is not None:
                fwd.append(layer.fwd_s * size)
                bwd.append(layer.bwd_s * size)
                opt.append(0.0)  # synthetic layers model pipeline timing only; their update is free
                continue
            if measured is not None:
                scale = size / profile.microbatch_size  # type: ignore[union-attr]
                fwd.append(measured[i].fwd_s * scale)
                bwd.append(measured[i].bwd_s * scale)
                opt.append(measured[i].opt_s)
                continue
            if device.is_gpu and layer.transformer is not None:
                model = self.issued_kernel_model
                seconds = transformer_layer_seconds(layer.transformer, size, device, model,
                                                    selective_recompute=layer.recompute_flops > 0, narrow=self.narrow,
                                                    compiled=self.compiled,
                                                    kv_exchange=self._kv_exchange(layer.transformer))
                fwd.append(seconds.fwd)
                bwd.append(seconds.bwd)
                experts = graph.expert_param_count(i)
                updated = ((graph.param_count(i) - experts) / self.shards.optimizer
                           + experts / self.shards.of_experts.optimizer)  # this device's share of the update
                opt.append(optimizer_seconds(updated, device, model, graph.dtype_bytes))
                continue
            # A captured graph replays its kernels without the per-op launch and dispatch (PARTIME, the seed talk:
            # "it records PyTorch operations issued by the CPU"); the one launch of the graph is the step's.
            launch = 0.0 if self.cuda_graphs else device.launch_overhead_s
            act = size * (layer_input_bytes(graph, i) + layer.activation_bytes)
            fwd_bytes = layer.param_bytes + act  # read weights, read input, write output
            bwd_bytes = 2 * layer.param_bytes + 2 * act  # read weights, write weight grads, the same tensors again
            # A composite layer's elementwise ops (Layer.elementwise_bytes) are memory bound and run between its
            # matmuls, so their time adds to the roofline's rather than hiding under it.
            elementwise_s = size * layer.elementwise_bytes / device.memory_bandwidth
            fwd.append(max(layer.flops_fwd * size / throughput, fwd_bytes / device.memory_bandwidth) + elementwise_s
                       + launch)
            # Selective recomputation (Korthikanti et al. §5) re-runs the attention core inside the backward.
            bwd.append(max((layer.flops_bwd + layer.recompute_flops) * size / throughput,
                           bwd_bytes / device.memory_bandwidth) + 2 * elementwise_s + launch)
            exchange = self._kv_exchange(layer.transformer) if layer.transformer is not None else None
            if exchange is not None:  # context parallelism on the roofline: the exchange waited for, not hidden
                fwd[-1] += exposed_seconds(exchange, [0.0] * exchange.cp, False)
                bwd[-1] += exposed_seconds(exchange, [0.0] * exchange.cp, True)
            # Adam is memory bound: it reads and writes the whole training state once per step (under ZeRO-1 the
            # replica's share of it).
            experts = graph.expert_param_count(i)
            state = (graph.param_count(i) - experts) * per_param + experts * per_expert_param
            opt.append(2 * state / device.memory_bandwidth + launch if state else 0.0)
        self._wait_for_offload_copies(device, fwd, bwd)
        return LayerCosts(tuple(fwd), tuple(bwd), tuple(opt))

    def _wait_for_offload_copies(self, device: DeviceSpec, fwd: list[float], bwd: list[float]) -> None:
        """Make an offloaded layer's forward last at least the copy of its activations to the host and its backward
        at least the copy back, in place (:mod:`sim.models.offload`): Transformer Engine copies on a stream of its
        own while the next layer computes, and stalls the compute only when the copies fall behind, so over a run of
        layers each takes the longer of its compute and its copy."""
        offloaded = [i for i, layer in enumerate(self.graph.layers) if layer.activations_offloaded]
        if not offloaded:
            return
        # any rank of this device (or of a slowed copy of it): its host link is the device's
        rank = next(r for r, spec in enumerate(self.topology.devices) if device in (spec, spec.base))
        for i in offloaded:
            nbytes = self.microbatch_size * self.graph.layers[i].saved_bytes
            fwd[i] = max(fwd[i], self.device_to_host_s(rank, nbytes))
            bwd[i] = max(bwd[i], self.host_to_device_s(rank, nbytes))

    # --- ranks of the topology ------------------------------------------------------------------------------------

    def device_spec(self, rank: int) -> DeviceSpec:
        """The device (its catalog entry) that topology rank ``rank`` is."""
        return self.topology.devices[rank]

    def stage_compute_s(self, rank: int, start: int, end: int) -> float:
        """Forward plus backward time of layers ``[start, end)`` on ``rank``'s device for one microbatch, s (O(1)
        after the first call per device: prefix sums)."""
        prefix = self.compute_prefix_s(rank)
        return prefix[end] - prefix[start]

    def compute_prefix_s(self, rank: int) -> list[float]:
        """Forward plus backward time of layers ``[0, j)`` on ``rank``'s device for one microbatch, for j = 0 .. n,
        s: the prefix sums :meth:`stage_compute_s` subtracts (computed once per device)."""
        device = self.device_spec(rank)
        prefix = self._prefix.get(device.name)
        if prefix is None:
            costs = self.layer_costs(device)
            prefix = self._prefix[device.name] = [0.0, *accumulate(f + b for f, b in zip(costs.fwd, costs.bwd))]
        return prefix

    def boundary_bytes(self, cut: int) -> int:
        """Bytes of one microbatch's activation crossing between layer ``cut - 1`` and layer ``cut`` (its gradient
        going back has the same size)."""
        return self.microbatch_size * self.graph.boundary_bytes(cut)

    def transfer_time(self, nbytes: float, src_rank: int, dst_rank: int) -> float:
        """Uncontended time in s of an ``nbytes``-byte message from ``src_rank`` to ``dst_rank``.

        The profile's measured ``latency + nbytes / bandwidth`` when both ranks run on the profile's device, else
        :meth:`sim.hw.topology.Topology.transfer_time`; 0 between a rank and itself.
        """
        if (self._p2p is not None and src_rank != dst_rank and self.profile_applies(self.device_spec(src_rank))
                and self.profile_applies(self.device_spec(dst_rank))):
            latency, bandwidth = self._p2p
            return latency + nbytes / bandwidth
        if src_rank == dst_rank:
            return 0.0
        # A function of the topology alone, asked for the same few sizes between the same ranks by every partition
        # table of a search (sim.plan.bottleneck): kept in the topology's memo.
        key = ("nccl p2p", nbytes, src_rank, dst_rank)
        seconds = self._collectives.get(key)
        if seconds is None:
            seconds = self._collectives[key] = self._nccl(self.topology.transfer_time(nbytes, src_rank, dst_rank),
                                                          "p2p", "ring", ((src_rank, dst_rank),))
        return seconds

    def collective(self, name: str, groups: tuple[tuple[int, ...], ...], nbytes: int,
                   algorithm: str = "auto") -> CollectiveCost:
        """Cost of one NCCL collective ``name`` (``all_reduce``, ``all_gather``, ...: ``sim.cost.collectives``) run at
        once by every group of ``groups`` (device ranks), each member contributing ``nbytes``, by ``algorithm``
        (``auto``: the fastest); cached, since a plan asks the same few many times. (A plan's collective op, an
        :class:`~sim.ir.ops.OpKind`, is costed by its cost view's :meth:`~sim.cost.cost_view.CostView.collective_op`,
        which asks this for each of the op's collectives.)"""
        key = ("nccl collective", name, groups, nbytes, algorithm)
        cost = self._collectives.get(key)
        if cost is None:
            cost = self._collectives[key] = self._with_nccl(
                collective_cost(self.topology, name, groups, nbytes, algorithm), name, groups)
        return cost

    def all_to_all(self, groups: tuple[tuple[int, ...], ...], nbytes: int,
                   shares: tuple[float, ...] = ()) -> CollectiveCost:
        """Cost of an all-to-all run at once by every group of ``groups`` (device ranks): each member sends
        ``nbytes · shares[j]`` to member j (:func:`sim.cost.collectives.all_to_all_cost`; ``()``: balanced), as one
        NCCL call of grouped point-to-point sends (one step's latency); cached."""
        key = ("nccl all_to_all", groups, nbytes, shares)
        cost = self._collectives.get(key)
        if cost is None:
            cost = self._collectives[key] = self._with_nccl(
                all_to_all_cost(self.topology, groups, nbytes, shares or None), "p2p", groups)
        return cost

    def _with_nccl(self, cost: CollectiveCost, kind: str, groups: tuple[tuple[int, ...], ...]) -> CollectiveCost:
        """``cost`` with NCCL's protocol latencies of a ``kind`` call over the groups of more than one member
        (:meth:`_nccl`)."""
        seconds = self._nccl(cost.seconds, kind, cost.algorithm, tuple(g for g in groups if len(g) > 1))
        return cost if seconds == cost.seconds else replace(cost, seconds=seconds)

    def async_tp_gemms(self, layer: int, device: DeviceSpec,
                       backward: bool) -> tuple[tuple[str, float, float], ...]:
        """Under async TP, each tensor-parallel collective of layer ``layer``'s forward or ``backward`` on ``device``
        with the seconds of the GEMMs it runs beside (:func:`sim.cost.gpu_time.async_tp_gemm_seconds`); cached.

        Raises:
            SpecError: the layer is not a Llama-family block under sequence parallelism, or ``device`` is not a GPU.
        """
        key = (layer, device.name, backward)  # this oracle's shard, microbatch and precision: not the topology's memo
        found = self._async_tp.get(key)
        if found is None:
            part = self.graph.layers[layer].transformer
            if part is None or not device.is_gpu:
                raise SpecError("async TP is modelled for the llama family's blocks on GPUs")
            found = self._async_tp[key] = async_tp_gemm_seconds(part, self.microbatch_size, device,
                                                                self.issued_kernel_model, self.narrow, self.compiled,
                                                                backward)
        return found

    def deduplicated_all_to_all(self, groups: tuple[tuple[int, ...], ...], token_bytes: int, topk: int,
                                servers_per_token: float) -> CollectiveCost:
        """Cost of a deduplicated token dispatch run at once by every group of ``groups``
        (:func:`sim.cost.collectives.deduplicated_all_to_all_cost`), with NCCL's point-to-point latency model over
        the groups as :meth:`all_to_all`'s; cached."""
        key = ("deduplicated all_to_all", groups, token_bytes, topk, servers_per_token)
        cost = self._collectives.get(key)
        if cost is None:
            cost = self._collectives[key] = self._with_nccl(
                deduplicated_all_to_all_cost(self.topology, groups, token_bytes, topk, servers_per_token), "p2p",
                groups)
        return cost

    def concurrent_transfer(self, pairs: tuple[tuple[int, int], ...],
                            nbytes: int) -> tuple[float, tuple[tuple[tuple[str, str], int], ...]]:
        """Time in s until the slowest of ``pairs`` (device ranks) has sent ``nbytes``, all at once, and the bytes
        each link carries; one pair is :meth:`transfer_time` (a measured p2p fit applies)."""
        if len(pairs) == 1:
            (src, dst), = pairs
            keys = self.topology.link_keys(src, dst)
            return self.transfer_time(nbytes, src, dst), tuple((key, nbytes) for key in keys)
        key = ("nccl transfer", pairs, nbytes)
        found = self._collectives.get(key)
        if found is None:
            seconds, link_bytes = concurrent_transfer(self.topology, pairs, nbytes)
            moving = tuple((src, dst) for src, dst in pairs if src != dst)
            found = self._collectives[key] = (self._nccl(seconds, "p2p", "ring", moving), link_bytes)
        return found

    def host_to_device_s(self, rank: int, nbytes: float) -> float:
        """Time in s to copy ``nbytes`` from the host memory of ``rank``'s server to its device (a PREFETCH): the
        profile's measured pinned-memory bandwidth where the profile applies to the device and has one
        (``nbytes / bandwidth``: it was measured on 64 MiB copies, where the fixed cost per copy is in the median
        time), else the link model of the rank's host → device path."""
        measured = self.profile.h2d_bandwidth if self.profile is not None else None
        if measured and self.profile_applies(self.device_spec(rank)):
            return nbytes / measured
        return message_time(self.topology.host_to_device_path(rank), nbytes)

    def device_to_host_s(self, rank: int, nbytes: float) -> float:
        """Time in s to copy ``nbytes`` from ``rank``'s device to its server's host memory (an EVICT): the profile's
        measured bandwidth where it applies, else the link model (as :meth:`host_to_device_s`)."""
        measured = self.profile.d2h_bandwidth if self.profile is not None else None
        if measured and self.profile_applies(self.device_spec(rank)):
            return nbytes / measured
        return message_time(self.topology.device_to_host_path(rank), nbytes)

    def profiled_ranks(self, num_ranks: int | None = None) -> tuple[int, ...]:
        """Ranks on the profile's device, whose measured times replace the roofline (synthetic layers excepted).

        Args:
            num_ranks: consider ranks ``0..num_ranks-1`` only (a plan's ranks); default every device of the topology.
        """
        total = self.topology.num_ranks
        count = total if num_ranks is None else min(num_ranks, total)
        return tuple(rank for rank in range(count) if self.profile_applies(self.device_spec(rank)))

    def uses_measured_p2p(self, num_ranks: int | None = None) -> bool:
        """Whether some transfer between two of the first ``num_ranks`` ranks takes the profile's measured p2p fit
        (:meth:`transfer_time`): the profile has a fit and at least two of those ranks run on its device."""
        return self._p2p is not None and len(self.profiled_ranks(num_ranks)) >= 2

    # --- memory of a layer range ----------------------------------------------------------------------------------

    def measured_memory(self, device: DeviceSpec | None) -> tuple[LayerMemory, ...] | None:
        """The profile's per-layer memory where it applies to ``device`` (checked against the model like its times,
        :meth:`layer_costs`), else ``None``: what :attr:`memory` reads."""
        if device is None or not self.profile_applies(device) or self.profile.memory is None:  # type: ignore[union-attr]
            return None
        self.layer_costs(device)  # the profile must be for this model and name its layers
        return self.profile.memory  # type: ignore[union-attr]

    def reduction_copies(self, device: DeviceSpec | None) -> bool:
        """Whether a data-parallel gradient reduction holds a flat copy of the gradients (the profile's
        ``reduction``, where it applies), rather than reducing them in place."""
        return (device is not None and self.profile_applies(device)
                and self.profile.reduction == "flat_copy")  # type: ignore[union-attr]

    def gradients_per_step(self, device: DeviceSpec | None) -> bool:
        """Whether weight gradients live only from a stage's first backward after an update to the update (the
        profile's ``gradients``, where it applies), rather than for the whole run."""
        return (device is not None and self.profile_applies(device)
                and self.profile.gradients == "per_step")  # type: ignore[union-attr]
