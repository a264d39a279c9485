"""The plan's parallel layout: tensor × data × pipeline parallel ranks and their groups (DESIGN §10.2).

A plan's programs are its pipeline ranks (``Plan.programs[p]``); every one of them runs on ``tp × dp`` devices at
once. The ``tp`` devices of a tensor-parallel group split each layer of the stage (Megatron-LM, Shoeybi et al.,
arXiv 1909.08053 §3) and run the same program in lock step; the ``dp`` data-parallel replicas each run the whole
pipeline on their own share of the global batch and all-reduce their gradients before the optimizer step. So a
program is written once and its ops carry the collectives (``TP_F``, ``REDUCE_GRAD``, ...); which devices take part
in each collective is this layout's business.

Device numbering follows Megatron-LM's ``initialize_model_parallel``: with the default order ``tp-dp-pp`` the
tensor-parallel rank varies fastest (a group is consecutive devices, so it stays inside one server when ``tp``
divides the server's GPU count), then the data-parallel rank, then the pipeline rank::

    device(pp, dp, tp) = tp + T · (dp + D · pp)

Context parallelism (``cp`` = C) splits each sequence over C devices that hold the same samples. They sit on the
data axis, innermost, as in torchtitan's device mesh ``[pp, dp_replicate, dp_shard, cp, tp]``: the data axis has
``D · C`` positions (:attr:`Parallelism.data_ranks`), position ``d · C + c`` being replica d's sequence part c, and
every device of it reduces its gradients with the others and (ZeRO/FSDP) shards the training state with them, as
torchtitan's ``dp_shard_cp`` mesh and Megatron's ``data_parallel_group_with_cp`` do. With C = 1 (the default) the
data axis is the replicas.

Expert parallelism (``ep`` = E, with expert tensor parallelism ``etp``; the moe family) is folded onto the same
devices, as Megatron-Core's MoE parallel folding does (Liu et al. 2025, arXiv 2504.14960 §3): the T · D · C devices of
a pipeline rank, taken in position order (tensor rank fastest, then the data axis), are numbered again for the
experts with the expert-tensor rank fastest, then the expert-parallel rank, then the expert-data-parallel rank::

    i = tp + T · dp   (position within the pipeline rank)
    etp_rank = i mod etp,   ep_rank = (i div etp) mod E,   edp_rank = i div (etp · E)

so an expert-parallel group (:meth:`Parallelism.ep_group`) is every ``etp``-th of ``etp · E`` consecutive positions:
the devices that exchange tokens by all-to-all, each holding E_total / E of each MoE layer's experts; the devices
with the same (etp, ep) ranks hold the same experts and reduce their gradients (:meth:`Parallelism.expert_dp_group`,
``T · D · C / (etp · E)`` of them). ``etp · E`` must divide ``T · D · C``.

Any other nesting of the three can be named (``--rank-order dp-tp-pp`` puts replicas innermost), and ``devices``
(``--devices``) can then place the positions of that numbering on other devices: position i runs on
``devices[i]``, a permutation, so that a heavy stage sits on the fast GPUs of a mixed cluster or a slow link falls
between stages that exchange little (the search's placement choice). A plan with ``tp = dp = 1`` and no device
order is a pure pipeline: pipeline rank p is device p, as before this layout existed, and ``plan.json`` leaves the
``parallel`` object out.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Any

from sim.core.errors import SpecError, did_you_mean

__all__ = ["Parallelism", "PURE_PIPELINE", "RANK_ORDERS", "DEFAULT_RANK_ORDER", "ZERO_STAGES", "CP_COMMS",
           "RESHARD_POLICIES", "resolve_reshard_after_forward"]

#: How context-parallel ranks exchange keys and values (``sim.cost.context_parallel`` costs them).
CP_COMMS = ("ring", "allgather")

#: Megatron-LM's nesting: tensor-parallel ranks innermost, then data-parallel, then pipeline.
DEFAULT_RANK_ORDER = "tp-dp-pp"
#: Every nesting of the three dimensions, innermost first.
RANK_ORDERS = tuple("-".join(order) for order in permutations(("tp", "dp", "pp")))
#: ZeRO stages modelled (Rajbhandari et al., arXiv 1910.02054 §5): 0 (plain data parallelism), 1 (the optimizer
#: state split across the replicas, P_os), 2 (the gradients too, P_os+g) and 3 (the parameters too, P_os+g+p:
#: PyTorch's FSDP).
ZERO_STAGES = (0, 1, 2, 3)
#: torchtitan's ``parallelism.fsdp_reshard_after_forward`` values (``torchtitan/config/configs.py``).
RESHARD_POLICIES = ("default", "always", "never")

_FIELDS = frozenset({"tp", "dp", "pp", "cp", "cp_comm", "order", "sequence_parallel", "zero", "reshard_after_forward",
                     "dp_replicate", "grad_overlap", "devices", "ep", "etp", "fsdp_float8_gather", "async_tp",
                     "deallocate_pipeline_outputs",
                     "param_gather_overlap", "grad_bucket_params"})


@dataclass(frozen=True)
class Parallelism:
    """How a plan's pipeline ranks map onto devices, and how its replicas and shards communicate.

    Attributes:
        tp: tensor-parallel degree T: devices that split every layer of a stage.
        dp: data-parallel degree D: replicas of the whole pipeline, each on ``1/D`` of the global batch.
        pp: pipeline ranks P (``len(plan.programs)``).
        order: nesting of the ranks, innermost first (:data:`RANK_ORDERS`).
        cp: context-parallel degree C: devices that split every sequence of a replica (module docstring), on the
            data axis; the data-parallel collectives and ZeRO's shards span all ``D · C`` of it.
        cp_comm: how a context-parallel attention gets the other ranks' keys and values: ``"ring"`` (passed around
            the group, each hop under one step's attention) or ``"allgather"`` (gathered once, Llama 3's and
            torchtitan's form); :mod:`sim.cost.context_parallel`.
        sequence_parallel: Megatron's sequence parallelism (Korthikanti et al., arXiv 2205.05198 §4.2.2): the
            tensor-parallel all-reduces become reduce-scatter + all-gather and norms and dropout are sharded.
        zero: the ZeRO stage (:data:`ZERO_STAGES`). 1, as Megatron's distributed optimizer: gradients are
            reduce-scattered once per step, each replica updates ``1/D`` of the parameters and the parameters are
            all-gathered after the step. 2: each microbatch's gradients are reduce-scattered after its backward and
            only this replica's ``1/D`` is kept (ZeRO §5.2), then the update and the all-gather as for 1. 3 (FSDP):
            the parameters live split too; each layer's are all-gathered before its forward and again before its
            backward, and its gradients reduce-scattered after it, overlapped with the neighbouring layers' compute
            (``sim.cost.fsdp``).
        reshard_after_forward: under ZeRO-3, free each layer's gathered parameters after its forward (FSDP's
            default) and gather them again for the backward; False keeps them from the forward to the backward
            (``reshard_after_forward=False``, as Llama 3 trained), one gather fewer per microbatch for the memory of
            the stage's whole parameters. Meaningless, and so always True, below ZeRO-3. With a pipeline (``pp`` >
            1) False means what the frameworks run (:attr:`fsdp_gathers_per_step`): each vstage gathered once per
            step and its gradients reduce-scattered once per step, by GATHER_PARAMS and REDUCE_GRAD ops.
        dp_replicate: under ZeRO-3, HSDP (hybrid sharding): the D replicas form ``dp_replicate`` groups of
            ``D / dp_replicate`` (with their C sequence parts each) that each shard the state among themselves (the
            shard groups: consecutive data-axis positions, innermost, as torchtitan's mesh nests them), and the
            groups replicate each other, all-reducing each layer's gradient shard after its reduce-scatter
            (``sim.cost.fsdp``). 1 (the default) is plain FSDP.
        grad_overlap: the data-parallel reduction of a stage's gradients runs in buckets while its last backward
            produces them (PyTorch DDP's bucketed all-reduce, Megatron's ``--overlap-grad-reduce``), instead of after
            the rank's whole backward pass (Megatron's default).
        devices: the device of each position of the nesting, a permutation of ``0..T·D·C·P−1``; ``()`` (the
            default): position i is device i.
        ep: expert-parallel degree E: the devices of a pipeline rank that split each MoE layer's routed experts and
            exchange tokens by all-to-all (module docstring: folded onto the T · D · C devices).
        etp: expert-tensor-parallel degree: the devices that split each expert's width.
        fsdp_float8_gather: under ZeRO-3 with FP8 linears, each block's linear weights are cast to FP8 before their
            all-gather and gathered and held at one byte a parameter (torchao's Float8Linear with
            ``enable_fsdp_float8_all_gather``, torchtitan's ``float8.enable_fsdp_float8_all_gather``;
            :meth:`sim.cost.cost_view.CostView.gather_bytes`).
        async_tp: each tensor-parallel all-gather and reduce-scatter runs decomposed beside the GEMM that consumes or
            produces it, chunk by chunk (PyTorch's async TP, torchtitan's ``parallelism.enable_async_tensor_parallel``;
            Wang et al., ASPLOS'23), under sequence parallelism (:meth:`sim.cost.cost_view.CostView.collective_op`).
        param_gather_overlap: under ZeRO-1, the all-gather of the updated parameters runs ahead of the next step's
            forward bucket by bucket instead of after the optimizer step (Megatron-Core's ``overlap_param_gather``:
            each bucket's gather waited for by the forward that first uses it, which then starts the next;
            :meth:`sim.cost.cost_view.CostView.overlapped_gather_s`).
        grad_bucket_params: parameters per bucket of an overlapped reduction or gather (Megatron's
            ``--ddp-bucket-size``, ``DistributedDataParallelConfig.bucket_size``); 0 (the default): the framework's
            own rule (:func:`sim.cost.gradient_buckets.bucket_bytes`). It sizes what the simulator costs; the
            executor reduces and gathers a vstage's parameters in one piece per group whatever it is.
        deallocate_pipeline_outputs: the pipeline runtime frees each stage's output once it is sent (Megatron-Core's
            ``deallocate_pipeline_outputs``, which Megatron-LM's training and Megatron-Bridge's models set: the next
            stage holds the tensor, and the backward needs only its autograd node, ``deallocate_output_tensor`` in
            ``megatron/core/pipeline_parallel/schedules.py``), so an in-flight microbatch keeps one boundary
            activation fewer (:meth:`sim.cost.memory_sizes.MemorySizes.activation_bytes`); PyTorch's pipelining
            (torchtitan) keeps it. Needs ``pp`` > 1; the executor does not implement it.
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    cp_comm: str = "ring"
    order: str = DEFAULT_RANK_ORDER
    sequence_parallel: bool = False
    zero: int = 0
    reshard_after_forward: bool = True
    dp_replicate: int = 1
    grad_overlap: bool = False
    devices: tuple[int, ...] = ()
    ep: int = 1
    etp: int = 1
    fsdp_float8_gather: bool = False
    async_tp: bool = False
    param_gather_overlap: bool = False
    grad_bucket_params: int = 0
    deallocate_pipeline_outputs: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{{{name}}} must be an integer >= 1, got {value!r}", name)
        if self.cp_comm not in CP_COMMS:
            raise SpecError(f"{{cp_comm}} must be one of {', '.join(CP_COMMS)}, got {self.cp_comm!r}", "cp_comm")
        if self.cp_comm != "ring" and self.cp == 1:
            raise SpecError(f"{{cp_comm}} {self.cp_comm} is how context-parallel ranks exchange keys and values; it "
                            f"needs {{cp}} > 1", "cp_comm", "cp")
        if self.order not in RANK_ORDERS:
            raise SpecError(f"{{order}} must be one of {', '.join(RANK_ORDERS)}, got {self.order!r}"
                            f"{did_you_mean(self.order, RANK_ORDERS)}", "order")
        if self.zero not in ZERO_STAGES:
            raise SpecError(f"{{zero}} must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero!r}", "zero")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("{sequence_parallel} shards activations across tensor-parallel ranks; it needs {tp} > 1",
                            "sequence_parallel", "tp")
        if self.grad_overlap and self.data_ranks == 1:
            raise SpecError("{grad_overlap} overlaps the data-parallel gradient reduction with the backward; it needs "
                            "{dp} > 1 (or {cp} > 1)", "grad_overlap", "dp", "cp")
        if not isinstance(self.reshard_after_forward, bool):
            raise SpecError(f"{{reshard_after_forward}} must be true or false, got {self.reshard_after_forward!r}",
                            "reshard_after_forward")
        if not self.reshard_after_forward and self.zero != 3:
            raise SpecError("{reshard_after_forward} false (never) keeps gathered parameters between forward and "
                            "backward; it needs {zero} 3 (parameters split across replicas)", "reshard_after_forward",
                            "zero")
        if not isinstance(self.fsdp_float8_gather, bool):
            raise SpecError(f"{{fsdp_float8_gather}} must be true or false, got {self.fsdp_float8_gather!r}",
                            "fsdp_float8_gather")
        if not isinstance(self.deallocate_pipeline_outputs, bool):
            raise SpecError(f"{{deallocate_pipeline_outputs}} must be true or false, got "
                            f"{self.deallocate_pipeline_outputs!r}", "deallocate_pipeline_outputs")
        if self.deallocate_pipeline_outputs and self.pp == 1:
            raise SpecError("{deallocate_pipeline_outputs} frees what a pipeline stage sends to the next; it needs "
                            "{pp} > 1", "deallocate_pipeline_outputs", "pp")
        if not isinstance(self.async_tp, bool):
            raise SpecError(f"{{async_tp}} must be true or false, got {self.async_tp!r}", "async_tp")
        if self.async_tp and not self.sequence_parallel:
            raise SpecError("{async_tp} overlaps sequence parallelism's all-gathers and reduce-scatters with their "
                            "GEMMs; it needs {sequence_parallel} (and {tp} > 1)", "async_tp", "sequence_parallel", "tp")
        if not isinstance(self.param_gather_overlap, bool):
            raise SpecError(f"{{param_gather_overlap}} must be true or false, got {self.param_gather_overlap!r}",
                            "param_gather_overlap")
        if self.param_gather_overlap and self.zero != 1:
            raise SpecError(f"{{param_gather_overlap}} overlaps the distributed optimizer's parameter all-gather with "
                            f"the next forward; it needs {{zero}} 1, got {{zero}} {self.zero}", "param_gather_overlap",
                            "zero")
        if isinstance(self.grad_bucket_params, bool) or not isinstance(self.grad_bucket_params, int) \
                or self.grad_bucket_params < 0:
            raise SpecError(f"{{grad_bucket_params}} must be a whole number of parameters >= 1, got "
                            f"{self.grad_bucket_params!r}", "grad_bucket_params")
        if self.grad_bucket_params and not (self.grad_overlap or self.param_gather_overlap):
            raise SpecError("{grad_bucket_params} sizes the buckets of an overlapped gradient reduction or parameter "
                            "gather; it needs {grad_overlap} or {param_gather_overlap}", "grad_bucket_params",
                            "grad_overlap", "param_gather_overlap")
        if self.fsdp_float8_gather and self.zero != 3:
            raise SpecError("{fsdp_float8_gather} gathers FSDP's parameters in FP8; it needs {zero} 3",
                            "fsdp_float8_gather", "zero")
        if isinstance(self.dp_replicate, bool) or not isinstance(self.dp_replicate, int) or self.dp_replicate < 1:
            raise SpecError(f"{{dp_replicate}} must be an integer >= 1, got {self.dp_replicate!r}", "dp_replicate")
        if self.dp_replicate > 1 and (self.zero != 3 or self.dp % self.dp_replicate):
            raise SpecError(f"{{dp_replicate}} {self.dp_replicate} splits the {{dp}} {self.dp} replicas into groups "
                            f"that shard the state (HSDP): it needs {{zero}} 3 and to divide {{dp}}", "dp_replicate",
                            "zero", "dp")
        if self.grad_overlap and self.zero >= 2:
            raise SpecError(f"{{grad_overlap}} buckets one reduction per step; {{zero}} {self.zero} already reduces "
                            f"each microbatch's gradients as its backward makes them", "grad_overlap", "zero")
        if self.zero and self.data_ranks == 1:
            raise SpecError(f"{{zero}} {self.zero} shards optimizer state across data-parallel replicas; it needs "
                            f"{{dp}} > 1 (or {{cp}} > 1)", "zero", "dp", "cp")
        if (self.tp * self.data_ranks) % (self.ep * self.etp):
            raise SpecError(f"expert parallelism folds onto each pipeline rank's TP × CP × DP = {self.tp} × {self.cp} "
                            f"× {self.dp} = {self.tp * self.data_ranks} devices: {{ep}} × {{etp}} = {self.ep} × "
                            f"{self.etp} = {self.ep * self.etp} must divide it", "ep", "etp")
        strides, stride = {}, 1
        for name, size in self._sizes():
            strides[name], stride = stride, stride * size
        object.__setattr__(self, "_strides", (strides["pp"], strides["dp"], strides["tp"]))
        # Groups asked for again and again by every cost view of a search: built once per layout.
        object.__setattr__(self, "_groups", {})
        if self.devices:
            world = self.world_size
            if sorted(self.devices) != list(range(world)) or any(isinstance(d, bool) for d in self.devices):
                raise SpecError(f"{{devices}} must order the devices 0..{world - 1} (T·D·C·P = {world}), each once; "
                                f"got {','.join(map(str, self.devices))}", "devices")
            # The position of each device, so that coords() inverts device() in O(1).
            object.__setattr__(self, "_position", {d: i for i, d in enumerate(self.devices)})
            # torch.distributed numbers a group's members in ascending order of their global ranks, and the executor
            # takes a shard's or a replica's index from that number: an order that reverses a group is refused.
            for kind, groups in self.groups().items():
                bad = next((group for group in groups if kind != "pp" and group != sorted(group)), None)
                if bad is not None:
                    raise SpecError(f"{{devices}} {','.join(map(str, self.devices))} puts the {kind} group "
                                    f"{bad} out of ascending order; keep each tensor- and data-parallel group's "
                                    f"devices ascending (move whole groups, e.g. a pipeline stage's block)",
                                    "devices")

    # --- devices ---------------------------------------------------------------------------------------------------

    @property
    def fsdp_gathers_per_step(self) -> bool:
        """ZeRO-3 under a pipeline without resharding after the forward, as the frameworks run it: each vstage's
        parameters all-gathered once per step before its first forward and kept until its gradients, accumulated
        whole over the step's microbatches, are reduce-scattered once after its last backward (``GATHER_PARAMS`` and
        ``REDUCE_GRAD`` ops, ``sim.plan.lower_collectives``). torchtitan resolves ``fsdp_reshard_after_forward =
        "default"`` to no resharding under PP (``torchtitan/distributed/fsdp.py``,
        ``get_fsdp_reshard_after_forward_policy``), and PyTorch's pipelining turns off FSDP's gradient sync and
        resharding after backward for every backward but the last (``torch/distributed/pipelining/stage.py``,
        ``backward_maybe_with_nosync`` and ``_post_backward``). Without a pipeline nothing changes: ZeRO-3 gathers
        and scatters inside each microbatch's forward and backward (``sim.cost.fsdp``)."""
        return self.zero == 3 and self.pp > 1 and not self.reshard_after_forward and self.data_ranks > 1

    @property
    def world_size(self) -> int:
        """Devices the plan uses: T · D · C · P."""
        return self.tp * self.data_ranks * self.pp

    @property
    def data_ranks(self) -> int:
        """Positions on the data axis: D replicas × C sequence parts (module docstring)."""
        return self.dp * self.cp

    @property
    def is_pure_pipeline(self) -> bool:
        """No tensor or data parallelism, the default order and device order: pipeline rank p is device p."""
        return self == Parallelism(pp=self.pp)

    def _sizes(self) -> tuple[tuple[str, int], ...]:
        sizes = {"tp": self.tp, "dp": self.data_ranks, "pp": self.pp}
        return tuple((name, sizes[name]) for name in self.order.split("-"))

    def device(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        """The device (global rank) of pipeline rank ``pp``, data-axis position ``dp`` (replica ``dp // C``,
        sequence part ``dp % C``), tensor shard ``tp``."""
        if not (0 <= pp < self.pp and 0 <= dp < self.data_ranks and 0 <= tp < self.tp):
            coords = {"pp": pp, "dp": dp, "tp": tp}
            name, size = next((n, size) for n, size in self._sizes() if not 0 <= coords[n] < size)
            raise ValueError(f"{name} rank {coords[name]} outside 0..{size - 1}")
        # Called for every member of every group (hundreds of thousands of times in a large search): the strides of
        # the nesting are worked out once, in __post_init__.
        stride_pp, stride_dp, stride_tp = self._strides  # type: ignore[attr-defined]
        index = pp * stride_pp + dp * stride_dp + tp * stride_tp
        return self.devices[index] if self.devices else index

    def coords(self, device: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` of ``device`` (``dp`` its data-axis position): the inverse of :meth:`device`."""
        if not 0 <= device < self.world_size:
            raise ValueError(f"device {device} outside 0..{self.world_size - 1}")
        if self.devices:
            device = self._position[device]  # type: ignore[attr-defined]
        coords: dict[str, int] = {}
        for name, size in self._sizes():
            coords[name], device = device % size, device // size
        return coords["pp"], coords["dp"], coords["tp"]

    def tp_group(self, pp: int, dp: int) -> tuple[int, ...]:
        """Devices of the tensor-parallel group of pipeline rank ``pp`` in replica ``dp``, in shard order."""
        key = ("tp", pp, dp)
        group = self._groups.get(key)  # type: ignore[attr-defined]
        if group is None:
            group = self._groups[key] = tuple(self.device(pp, dp, t) for t in range(self.tp))  # type: ignore
        return group

    def dp_group(self, pp: int, tp: int) -> tuple[int, ...]:
        """Devices that hold the same shard of pipeline rank ``pp`` in every replica and sequence part (they reduce
        gradients)."""
        key = ("dp", pp, tp)
        group = self._groups.get(key)  # type: ignore[attr-defined]
        if group is None:
            group = self._groups[key] = tuple(self.device(pp, d, tp) for d in range(self.data_ranks))  # type: ignore
        return group

    def tp_groups(self, pp: int, positions: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The tensor-parallel groups of pipeline rank ``pp`` at each of the data-axis ``positions`` (those that run
        a collective at the same moment)."""
        key = ("tp groups", pp, positions)
        groups = self._groups.get(key)  # type: ignore[attr-defined]
        if groups is None:
            groups = self._groups[key] = tuple(self.tp_group(pp, d) for d in positions)  # type: ignore
        return groups

    def dp_groups(self, pp: int) -> tuple[tuple[int, ...], ...]:
        """The data-parallel groups of every tensor shard of pipeline rank ``pp`` (they reduce at the same moment)."""
        key = ("dp groups", pp)
        groups = self._groups.get(key)  # type: ignore[attr-defined]
        if groups is None:
            groups = self._groups[key] = tuple(self.dp_group(pp, t) for t in range(self.tp))  # type: ignore
        return groups

    def pipeline_pairs(self, src: int, dst: int, positions: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``(device of src, device of dst)`` for every tensor shard at each of the data-axis ``positions``: the
        transfers of one pipeline message that run at the same moment."""
        key = ("pairs", src, dst, positions)
        pairs = self._groups.get(key)  # type: ignore[attr-defined]
        if pairs is None:
            pairs = self._groups[key] = tuple((self.device(src, d, t), self.device(dst, d, t))  # type: ignore
                                              for d in positions for t in range(self.tp))
        return pairs

    def cp_group(self, pp: int, replica: int, tp: int) -> tuple[int, ...]:
        """Devices that split replica ``replica``'s sequences for pipeline rank ``pp``, shard ``tp``, in sequence-part
        order (they exchange keys and values)."""
        return tuple(self.device(pp, replica * self.cp + c, tp) for c in range(self.cp))

    @property
    def device_ranks(self) -> tuple[int, ...]:
        """Every device (topology rank) the layout uses, in position order: ``devices``, or ``0 .. T·D·C·P − 1``."""
        return self.devices if self.devices else tuple(range(self.world_size))

    @property
    def dp_shard(self) -> int:
        """Data-axis positions that split the training state among themselves: all ``D · C``, or under HSDP
        ``D · C / dp_replicate``."""
        return self.data_ranks // self.dp_replicate

    def shard_group(self, pp: int, tp: int, group: int) -> tuple[int, ...]:
        """Devices of HSDP shard group ``group`` (``0 <= group < dp_replicate``) of pipeline rank ``pp``, shard ``tp``:
        data-parallel ranks ``group·S .. group·S + S − 1`` (S = :attr:`dp_shard`); the whole data-parallel group
        without HSDP."""
        key = ("shard", pp, tp, group)
        found = self._groups.get(key)  # type: ignore[attr-defined]
        if found is None:  # asked for every data-parallel op of every view of a search: kept like the other groups
            size = self.dp_shard
            found = self._groups[key] = tuple(self.device(pp, d, tp)  # type: ignore[attr-defined]
                                              for d in range(group * size, (group + 1) * size))
        return found

    def replicate_group(self, pp: int, tp: int, index: int) -> tuple[int, ...]:
        """Devices that hold the same state shard ``index`` (``0 <= index < dp_shard``) in every HSDP shard group."""
        return tuple(self.device(pp, d, tp) for d in range(index, self.data_ranks, self.dp_shard))

    def _stage_devices(self, pp: int) -> tuple[int, ...]:
        """The devices of pipeline rank ``pp`` in position order: tensor rank fastest, then the data axis."""
        key = ("stage", pp)
        found = self._groups.get(key)  # type: ignore[attr-defined]
        if found is None:  # every expert-parallel group asks for it (83 % of a 256-GPU mixture's screen uncached)
            found = self._groups[key] = tuple(self.device(pp, d, t)  # type: ignore[attr-defined]
                                              for d in range(self.data_ranks) for t in range(self.tp))
        return found

    @property
    def expert_dp(self) -> int:
        """Devices of a pipeline rank that hold the same experts: ``T · D · C / (etp · ep)``."""
        return self.tp * self.data_ranks // (self.ep * self.etp)

    def ep_group(self, pp: int, expert_dp: int, expert_tp: int = 0) -> tuple[int, ...]:
        """Devices of pipeline rank ``pp`` that split the experts among themselves (module docstring), in
        expert-parallel rank order: expert-data-parallel rank ``expert_dp``, expert-tensor rank ``expert_tp``."""
        stage, block = self._stage_devices(pp), self.etp * self.ep
        return tuple(stage[expert_dp * block + e * self.etp + expert_tp] for e in range(self.ep))

    def etp_group(self, pp: int, expert_dp: int, ep_rank: int) -> tuple[int, ...]:
        """Devices that split the same experts' width (expert tensor parallelism), in expert-tensor rank order."""
        stage, block = self._stage_devices(pp), self.etp * self.ep
        return tuple(stage[expert_dp * block + ep_rank * self.etp + t] for t in range(self.etp))

    def expert_dp_group(self, pp: int, ep_rank: int, expert_tp: int = 0) -> tuple[int, ...]:
        """Devices that hold the same experts (and reduce their gradients), in expert-data-parallel rank order."""
        stage, block = self._stage_devices(pp), self.etp * self.ep
        return tuple(stage[d * block + ep_rank * self.etp + expert_tp] for d in range(self.expert_dp))

    def expert_coords(self, device: int) -> tuple[int, int, int]:
        """``(expert_dp, ep_rank, expert_tp)`` of ``device`` in its pipeline rank's folding (module docstring): the
        arguments that place it in :meth:`ep_group`, :meth:`etp_group` and :meth:`expert_dp_group`."""
        pp, dp, tp = self.coords(device)
        position = dp * self.tp + tp  # its index in _stage_devices(pp)
        return position // (self.etp * self.ep), position // self.etp % self.ep, position % self.etp

    def pp_group(self, dp: int, tp: int) -> tuple[int, ...]:
        """Devices of one pipeline: pipeline ranks 0..P−1 of data-axis position ``dp``, shard ``tp``."""
        return tuple(self.device(p, dp, tp) for p in range(self.pp))

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group by kind, as ``plan.json`` and the summary show them (sorted, deterministic)."""
        groups = {
            "tp": [list(self.tp_group(p, d)) for p in range(self.pp) for d in range(self.data_ranks)],
            "dp": [list(self.dp_group(p, t)) for p in range(self.pp) for t in range(self.tp)],
            "pp": [list(self.pp_group(d, t)) for d in range(self.data_ranks) for t in range(self.tp)],
        }
        if self.cp > 1:
            groups["cp"] = [list(self.cp_group(p, r, t)) for p in range(self.pp) for r in range(self.dp)
                            for t in range(self.tp)]
        if self.ep > 1:
            groups["ep"] = [list(self.ep_group(p, d, t)) for p in range(self.pp) for d in range(self.expert_dp)
                            for t in range(self.etp)]
        if self.etp > 1:
            groups["etp"] = [list(self.etp_group(p, d, e)) for p in range(self.pp) for d in range(self.expert_dp)
                             for e in range(self.ep)]
        return groups

    def describe(self) -> str:
        """One line for the summary, e.g. ``TP 2 × DP 4 × PP 8 = 64 devices (order tp-dp-pp, ZeRO-1)``."""
        extras = [f"order {self.order}"]
        if self.sequence_parallel:
            extras.append("sequence parallel")
        if self.zero:
            extras.append(f"ZeRO-{self.zero}" + ("" if self.reshard_after_forward else ", kept gathered after forward")
                          + (f", HSDP {self.dp_replicate} × {self.dp_shard}" if self.dp_replicate > 1 else ""))
        if self.grad_overlap:
            extras.append("gradient reduction overlapped")
        if self.param_gather_overlap:
            extras.append("parameter gather overlapped")
        if self.grad_bucket_params:
            extras.append(f"buckets of {self.grad_bucket_params:,} parameters")
        if self.deallocate_pipeline_outputs:
            extras.append("stage outputs freed once sent")
        if self.devices:
            extras.append(f"devices {','.join(map(str, self.devices))}")
        cp = f" × CP {self.cp} ({self.cp_comm})" if self.cp > 1 else ""
        experts = (f", experts EP {self.ep}" + (f" × ETP {self.etp}" if self.etp > 1 else "") +
                   f" × EDP {self.expert_dp}") if self.ep * self.etp > 1 else ""
        return (f"TP {self.tp}{cp} × DP {self.dp} × PP {self.pp} = {self.world_size} devices "
                f"({', '.join(extras)}{experts})")

    # --- JSON ------------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The ``parallel`` object of ``plan.json``: the degrees, the options and, for readers, every group."""
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp,
                **({"cp": self.cp, "cp_comm": self.cp_comm} if self.cp > 1 else {}),
                "order": self.order,
                "sequence_parallel": self.sequence_parallel, "zero": self.zero,
                **({} if self.reshard_after_forward else {"reshard_after_forward": False}),
                **({"dp_replicate": self.dp_replicate} if self.dp_replicate > 1 else {}),
                "grad_overlap": self.grad_overlap,
                **({"devices": list(self.devices)} if self.devices else {}),
                **({"ep": self.ep} if self.ep > 1 else {}), **({"etp": self.etp} if self.etp > 1 else {}),
                **({"fsdp_float8_gather": True} if self.fsdp_float8_gather else {}),
                **({"async_tp": True} if self.async_tp else {}),
                **({"param_gather_overlap": True} if self.param_gather_overlap else {}),
                **({"grad_bucket_params": self.grad_bucket_params} if self.grad_bucket_params else {}),
                **({"deallocate_pipeline_outputs": True} if self.deallocate_pipeline_outputs else {}),
                "groups": self.groups()}

    @classmethod
    def from_json(cls, data: Any, pp: int, source: str) -> Parallelism:
        """Inverse of :meth:`to_json`; ``pp`` is the plan's program count, which the object must agree with, and the
        groups, if present, must be the ones the degrees and order give (a hand edit of one is refused)."""
        if not isinstance(data, dict):
            raise SpecError(f"{source}: parallel must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - _FIELDS - {"groups"})
        if unknown:
            raise SpecError(f"{source}: parallel has unknown field(s) {', '.join(map(repr, unknown))}; it has "
                            f"{', '.join(sorted(_FIELDS | {'groups'}))}")
        for key in ("tp", "dp", "pp", "cp", "zero", "dp_replicate", "ep", "etp", "grad_bucket_params"):
            value = data.get(key, 0 if key in ("zero", "grad_bucket_params") else 1)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"{source}: parallel.{key} must be an integer, got {value!r}")
        for key in ("sequence_parallel", "grad_overlap", "reshard_after_forward", "fsdp_float8_gather", "async_tp",
                    "param_gather_overlap", "deallocate_pipeline_outputs"):
            if not isinstance(data.get(key, key == "reshard_after_forward"), bool):
                raise SpecError(f"{source}: parallel.{key} must be true or false, got {data[key]!r}")
        devices = data.get("devices", [])
        if not isinstance(devices, list) or any(isinstance(d, bool) or not isinstance(d, int) for d in devices):
            raise SpecError(f"{source}: parallel.devices must be a list of device numbers, got {devices!r}")
        layout = cls(tp=data.get("tp", 1), dp=data.get("dp", 1), pp=data.get("pp", pp), cp=data.get("cp", 1),
                     cp_comm=str(data.get("cp_comm", "ring")),
                     order=str(data.get("order", DEFAULT_RANK_ORDER)),
                     sequence_parallel=data.get("sequence_parallel", False), zero=data.get("zero", 0),
                     reshard_after_forward=data.get("reshard_after_forward", True),
                     dp_replicate=data.get("dp_replicate", 1),
                     grad_overlap=data.get("grad_overlap", False), devices=tuple(devices),
                     ep=data.get("ep", 1), etp=data.get("etp", 1),
                     fsdp_float8_gather=data.get("fsdp_float8_gather", False), async_tp=data.get("async_tp", False),
                     param_gather_overlap=data.get("param_gather_overlap", False),
                     grad_bucket_params=data.get("grad_bucket_params", 0),
                     deallocate_pipeline_outputs=data.get("deallocate_pipeline_outputs", False))
        if layout.pp != pp:
            raise SpecError(f"{source}: parallel.pp is {layout.pp} but the plan has {pp} rank programs")
        if "groups" in data and data["groups"] != layout.groups():
            raise SpecError(f"{source}: parallel.groups are not the groups of TP {layout.tp} × DP {layout.dp} × "
                            f"PP {layout.pp} in order {layout.order} (edit the degrees, not the groups)")
        return layout


#: The layout of a plan without tensor or data parallelism (``pp`` is filled in by the plan).
PURE_PIPELINE = Parallelism()


def resolve_reshard_after_forward(policy: str, *, zero: int, pp: int) -> bool:
    """:attr:`Parallelism.reshard_after_forward` for a torchtitan-style policy: ``"always"`` True, ``"never"``
    False, ``"default"`` as torchtitan resolves it (``torchtitan/distributed/fsdp.py``,
    ``get_fsdp_reshard_after_forward_policy``: ``not pp_enabled``, "to avoid per-microbatch all-gathers") under
    ZeRO-3, and True (meaningless) below ZeRO-3.

    Raises:
        SpecError: ``policy`` is none of :data:`RESHARD_POLICIES`.
    """
    if policy not in RESHARD_POLICIES:
        raise SpecError(f"{{reshard_after_forward}} must be one of {', '.join(RESHARD_POLICIES)}, got {policy!r}"
                        f"{did_you_mean(policy, RESHARD_POLICIES)}", "reshard_after_forward")
    if policy == "default":
        return zero != 3 or pp == 1
    return policy == "always"
