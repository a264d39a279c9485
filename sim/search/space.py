"""What a plan search ranges over: the problem (model, cluster, global batch), its space, and one candidate.

A :class:`Candidate` is one point of the space: tensor × context × data × pipeline degrees over every device of the
topology, microbatch size (the microbatch count follows from the global batch), schedule and its chunks,
recomputation, sequence parallelism, ZeRO stage and HSDP replication, how ranks nest over the devices (placement), the
partition rule, the context-parallel exchange, the precision and torch.compile. It turns into
the same :class:`~sim.plan.inputs.PlanInputs` that ``sim.run`` builds from its flags, so a candidate is costed by the
one prediction path and its plan runs in ``executor.run`` as is.

:func:`enumerate_candidates` lists the space in a fixed order. Points that differ only in a choice with no effect
are listed once (sequence parallelism without tensor parallelism, ZeRO without data parallelism, HSDP without FSDP,
a context-parallel exchange without context parallelism, chunks of a schedule that takes none, rank orders that nest
the same degrees > 1 alike), and on a single pipeline rank only one
synchronous schedule is listed (1f1b if searched: with no bubble, gpipe, 1f1b and zb1p take the same time, gpipe
holding more activations) and no interleaving. Points that break a rule of the model,
schedule or batch (heads not divisible by TP, a global batch not a whole number of microbatches, more stages than
layers) are listed: evaluating them reports why they are infeasible instead of silently dropping them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from sim.core.errors import SpecError
from sim.cost.allocator import FRAGMENTATION
from sim.cost.gpu_time import KernelModel
from sim.cost.precision import PRECISIONS
from sim.engine.perturbation import NONE, Perturbation
from sim.hw.topology import Topology
from sim.ir.parallel import CP_COMMS, DEFAULT_RANK_ORDER, RANK_ORDERS, ZERO_STAGES, Parallelism
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES
from sim.plan.inputs import PlanInputs
from sim.schedules import SCHEDULES
from sim.search.placement import stage_placements

__all__ = ["SearchSpace", "SearchProblem", "Candidate", "enumerate_candidates", "RECOMPUTE_MODES",
           "DEFAULT_SCHEDULES", "MAX_CANDIDATES", "check_space", "MODEL_PRECISION"]

#: Schedules searched by default: the synchronous ones (same weights as data-parallel SGD), so their times compare.
#: ``pipedream`` (asynchronous, stale weights) is searched only when named.
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p")
RECOMPUTE_MODES = ("none", "selective", "full")
#: The precision of a candidate that keeps the model's own (no ``--precision``).
MODEL_PRECISION = "model"
#: The most points a search may list: the space is listed before anything is evaluated, and at about a kilobyte a
#: candidate with its result this is 2 GB at most; narrow the flags beyond it.
MAX_CANDIDATES = 2_000_000


@dataclass(frozen=True)
class SearchSpace:
    """The choices a search may combine (each a tuple of allowed values).

    Attributes:
        schedules: schedule names (:data:`sim.schedules.SCHEDULES`).
        chunks: model chunks per rank tried for schedules that interleave them.
        recompute: ``none``, ``selective`` and/or ``full``.
        microbatch_sizes: samples per microbatch; ``()``: every power of two up to the global batch per replica.
        sequence_parallel: ``False`` and/or ``True`` (applies where TP > 1).
        zero: ZeRO stages (1 to 3 apply where DP > 1; 3 is FSDP).
        rank_orders: nestings of the ranks over the devices, innermost first (``tp-dp-pp`` is Megatron's).
        partitions: partition rules (``balanced``: the exact DP on the oracle's costs; ``uniform``).
        settings: when not empty, the only (tp, dp, pp, microbatch size) settings searched (``--candidates``,
            :mod:`sim.search.settings`); ``microbatch_sizes`` is then unused.
        placements: on a mixed cluster, also try the distinct assignments of device blocks to pipeline stages
            (:mod:`sim.search.placement`); else only each rank order's own.
        cp: context-parallel degrees (``--cp``; above 1 for the llama family on GPUs).
        cp_comms: how context-parallel ranks exchange keys and values (applies where CP > 1).
        dp_replicate: HSDP replicate degrees (apply under ZeRO-3, dividing DP).
        precisions: training precisions (``--precision``), :data:`MODEL_PRECISION` for the model's own.
        compile: ``False`` and/or ``True`` (``--compile``: the llama and moe families on GPUs).
        ep: expert-parallel degrees (``--ep``; above 1 for the moe family), those that divide a layout's
            TP × CP × DP devices with the ETP degree.
        etp: expert-tensor-parallel degrees (``--etp``).
    """

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    chunks: tuple[int, ...] = (2, 4)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    microbatch_sizes: tuple[int, ...] = ()
    sequence_parallel: tuple[bool, ...] = (False, True)
    zero: tuple[int, ...] = (0, 1)
    rank_orders: tuple[str, ...] = (DEFAULT_RANK_ORDER,)
    partitions: tuple[str, ...] = ("balanced",)
    settings: tuple[tuple[int, int, int, int], ...] = ()
    placements: bool = True
    cp: tuple[int, ...] = (1,)
    cp_comms: tuple[str, ...] = ("ring",)
    dp_replicate: tuple[int, ...] = (1,)
    precisions: tuple[str, ...] = (MODEL_PRECISION,)
    compile: tuple[bool, ...] = (False,)
    ep: tuple[int, ...] = (1,)
    etp: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class SearchProblem:
    """What the user asks: train ``model`` on ``topology`` at ``global_batch`` samples per iteration.

    Attributes:
        model: model spec (``gpt:layers=24,hidden=2048``).
        topology: topology spec (``8xA100``, ``4xV100+4xA100``, a YAML file).
        global_batch: samples per iteration over all replicas.
        memory_limit_bytes: cap on each device's memory, bytes (``None``: the device's own capacity).
        memory_headroom: the fraction of a device's memory (or of ``memory_limit_bytes``) a pick leaves free beyond
            its allocated peak (``--memory-headroom``): a candidate fits when its peak times ``1 + memory_headroom``
            does. The default is the caching allocator's fragmentation (:data:`sim.cost.allocator.FRAGMENTATION`),
            so that what a GPU would reserve for the pick fits without the allocator squeezing its cache.
        space: the choices searched.
        profile: a measured profile's path, or ``None`` for the catalog's costs.
        kernel_model: the GPU kernel model's constants (``None``: the built-in ones).
        perturbation: stragglers, slow links and jitter every candidate is simulated under (``sim.search
            --straggler``; :mod:`sim.engine.perturbation`): which plan hides them best.
        routing: how a mixture's tokens spread over its experts in every candidate (``balanced``, ``skew:S[:SEED]``,
            ``trace:FILE``; :mod:`sim.models.routing`).
        capacity_factor: tokens an expert computes at most, as a multiple of its balanced share (0: dropless).
        loss: how the framework computes the loss in every candidate (``--loss``, :data:`sim.models.loss.LOSSES`).
        blocks: the modules every candidate's blocks are built from (``--blocks``, :data:`sim.models.blocks.BLOCKS`).
        deallocate_pipeline_outputs: every candidate with pipeline stages frees each stage's output once sent
            (``--deallocate-pipeline-outputs``, Megatron-Core's; :class:`sim.ir.parallel.Parallelism`).
        recompute_modules: what a candidate's selective recomputation drops in a mixture's blocks
            (``--recompute-modules``, :mod:`sim.models.recompute_modules`).
    """

    model: str
    topology: str
    global_batch: int
    memory_limit_bytes: int | None = None
    memory_headroom: float = FRAGMENTATION
    space: SearchSpace = field(default_factory=SearchSpace)
    profile: str | None = None
    kernel_model: KernelModel | None = None
    perturbation: Perturbation = NONE
    routing: str = "balanced"
    capacity_factor: float = 0.0
    loss: str = "fused"
    blocks: str = "eager"
    deallocate_pipeline_outputs: bool = False
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES

    def capacity_bytes(self, capacity: float | None) -> int | None:
        """What a device of ``capacity`` bytes (``None`` or ``inf``: no limit of its own) may use: the smaller of it
        and ``memory_limit_bytes``; ``None`` when neither limits it."""
        own = None if capacity is None or capacity == float("inf") else int(capacity)
        limit = self.memory_limit_bytes
        return limit if own is None else own if limit is None else min(own, limit)

    def usable_bytes(self, capacity: float | None) -> int | None:
        """What a candidate's allocated peak may reach on a device of ``capacity`` bytes: its
        :meth:`capacity_bytes` less the headroom (rounded down); ``None`` when nothing limits it."""
        bound = self.capacity_bytes(capacity)
        return None if bound is None else int(bound / (1 + self.memory_headroom))


@dataclass(frozen=True, order=True)
class Candidate:
    """One plan of the space (field order is the listing and tie-break order)."""

    tp: int
    dp: int
    pp: int
    microbatch_size: int
    schedule: str
    chunks: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    rank_order: str = DEFAULT_RANK_ORDER
    partition: str = "balanced"
    devices: tuple[int, ...] = ()
    cp: int = 1
    cp_comm: str = "ring"
    dp_replicate: int = 1
    precision: str = MODEL_PRECISION
    compiled: bool = False
    ep: int = 1
    etp: int = 1

    def microbatches(self, global_batch: int) -> float:
        """Microbatches per iteration per replica (fractional when the batch does not divide: infeasible)."""
        return global_batch / (self.microbatch_size * self.dp)

    def plan_inputs(self, problem: SearchProblem) -> PlanInputs:
        """The ``sim.run`` inputs of this candidate."""
        return PlanInputs(
            model=problem.model, topology=problem.topology, schedule=self.schedule,
            microbatch_size=self.microbatch_size, partition=self.partition, profile=problem.profile,
            chunks=self.chunks, recompute=self.recompute, tp=self.tp, dp=self.dp, pp=self.pp,
            global_batch=problem.global_batch, rank_order=self.rank_order,
            sequence_parallel=self.sequence_parallel, zero=self.zero, kernel_model=problem.kernel_model,
            devices=self.devices, cp=self.cp, cp_comm=self.cp_comm, dp_replicate=self.dp_replicate,
            precision=None if self.precision == MODEL_PRECISION else self.precision, compiled=self.compiled,
            ep=self.ep, etp=self.etp, routing=problem.routing, capacity_factor=problem.capacity_factor,
            loss=problem.loss, blocks=problem.blocks,
            deallocate_pipeline_outputs=problem.deallocate_pipeline_outputs and self.pp > 1,
            recompute_modules=problem.recompute_modules if self.recompute == "selective" else DEFAULT_RECOMPUTE_MODULES)

    def label(self) -> str:
        """A short name: ``tp2 dp2 pp2 b4 interleaved(v=2) full sp zero1 [dp-tp-pp]``."""
        parts = [f"tp{self.tp}", *([f"cp{self.cp}"] if self.cp > 1 else []), f"dp{self.dp}", f"pp{self.pp}",
                 f"b{self.microbatch_size}", self.schedule + (f"(v={self.chunks})" if self.chunks > 1 else ""),
                 self.recompute]
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.dp_replicate > 1:
            parts.append(f"hsdp{self.dp_replicate}")
        if self.cp > 1 and self.cp_comm != "ring":
            parts.append(f"cp-{self.cp_comm}")
        if self.precision != MODEL_PRECISION:
            parts.append(self.precision)
        if self.compiled:
            parts.append("compile")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.rank_order != DEFAULT_RANK_ORDER:
            parts.append(f"[{self.rank_order}]")
        if self.partition != "balanced":
            parts.append(f"partition={self.partition}")
        if self.devices:
            parts.append(f"devices={','.join(map(str, self.devices))}")
        return " ".join(parts)

    def run_flags(self, problem: SearchProblem) -> list[str]:
        """The ``python -m sim.run`` flags that build this candidate's plan."""
        flags = ["--topology", problem.topology, "--model", problem.model, "--schedule", self.schedule,
                 "--tp", str(self.tp), "--dp", str(self.dp), "--pp", str(self.pp),
                 "--global-batch", str(problem.global_batch), "--microbatch-size", str(self.microbatch_size)]
        if self.chunks > 1:
            flags += ["--chunks", str(self.chunks)]
        if self.recompute != "none":
            flags += ["--recompute", self.recompute]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.zero:
            flags += ["--zero", str(self.zero)]
        if self.dp_replicate > 1:
            flags += ["--dp-replicate", str(self.dp_replicate)]
        if self.cp > 1:
            flags += ["--cp", str(self.cp), "--cp-comm", self.cp_comm]
        if self.precision != MODEL_PRECISION:
            flags += ["--precision", self.precision]
        if self.compiled:
            flags.append("--compile")
        if self.ep > 1:
            flags += ["--ep", str(self.ep)]
        if self.etp > 1:
            flags += ["--etp", str(self.etp)]
        if problem.routing != "balanced":
            flags += ["--routing", problem.routing]
        if problem.capacity_factor:
            flags += ["--capacity-factor", f"{problem.capacity_factor:g}"]
        if problem.loss != "fused":
            flags += ["--loss", problem.loss]
        if problem.blocks != "eager":
            flags += ["--blocks", problem.blocks]
        if problem.deallocate_pipeline_outputs and self.pp > 1:
            flags.append("--deallocate-pipeline-outputs")
        if self.recompute == "selective" and problem.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
            flags += ["--recompute-modules", ",".join(problem.recompute_modules)]
        if self.rank_order != DEFAULT_RANK_ORDER:
            flags += ["--rank-order", self.rank_order]
        if self.partition != "balanced":
            flags += ["--partition", self.partition]
        if self.devices:
            flags += ["--devices", ",".join(map(str, self.devices))]
        if problem.profile:
            flags += ["--profile", problem.profile]
        return flags


def _placements(problem: SearchProblem, topology: Topology | None, tp: int, dp: int, pp: int,
                order: str) -> list[tuple[int, ...]]:
    if topology is None or not problem.space.placements:
        return [()]
    return stage_placements(Parallelism(tp=tp, dp=dp, pp=pp, order=order), topology)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _orders_for(degrees: dict[str, int], orders: tuple[str, ...]) -> list[str]:
    """The rank orders that nest the degrees > 1 differently (the first of each class, in the given order)."""
    seen: dict[tuple[str, ...], str] = {}
    for order in orders:
        effective = tuple(name for name in order.split("-") if degrees[name] > 1)
        seen.setdefault(effective, order)
    return list(seen.values())


def check_space(space: SearchSpace) -> None:
    """Reject a space with an unknown or empty choice (one line naming the value)."""
    if "stream" in space.schedules:
        raise SpecError("the search space cannot include schedule 'stream': PARTIME learns from a stream one frame at "
                        "a time, with no global batch to split; simulate it with sim.run --schedule stream")
    checks = (("schedules", space.schedules, lambda v: v in SCHEDULES),
              ("chunks", space.chunks, lambda v: isinstance(v, int) and v >= 2),
              ("recompute", space.recompute, lambda v: v in RECOMPUTE_MODES),
              ("microbatch sizes", space.microbatch_sizes, lambda v: isinstance(v, int) and v >= 1),
              ("sequence parallel", space.sequence_parallel, lambda v: isinstance(v, bool)),
              ("zero", space.zero, lambda v: v in ZERO_STAGES),
              ("rank orders", space.rank_orders, lambda v: v in RANK_ORDERS),
              ("partitions", space.partitions, lambda v: isinstance(v, str) and v != ""),
              ("context-parallel degrees", space.cp, lambda v: isinstance(v, int) and v >= 1),
              ("context-parallel exchanges", space.cp_comms, lambda v: v in CP_COMMS),
              ("HSDP replicate degrees", space.dp_replicate, lambda v: isinstance(v, int) and v >= 1),
              ("precisions", space.precisions, lambda v: v in (MODEL_PRECISION, *PRECISIONS)),
              ("compile choices", space.compile, lambda v: isinstance(v, bool)),
              ("expert-parallel degrees", space.ep, lambda v: isinstance(v, int) and v >= 1),
              ("expert-tensor-parallel degrees", space.etp, lambda v: isinstance(v, int) and v >= 1))
    for name, values, ok in checks:
        if not values and name != "microbatch sizes":
            raise SpecError(f"the search space has no {name} to choose from")
        for value in values:
            if not ok(value):
                raise SpecError(f"the search space's {name} cannot include {value!r}")


def enumerate_candidates(problem: SearchProblem, num_devices: int, topology: Topology | None = None) -> list[Candidate]:
    """Every candidate of ``problem``'s space on ``num_devices`` devices, in a fixed order (sorted); with the
    ``topology`` (and ``space.placements``), each layout also in the placements of :mod:`sim.search.placement`.

    Raises:
        SpecError: an invalid space, a global batch < 1, or more than :data:`MAX_CANDIDATES` candidates (counted
            exactly from each shape's choices before the list is made).
    """
    space = problem.space
    check_space(space)
    if problem.global_batch < 1:
        raise SpecError(f"{{global_batch}} must be >= 1, got {problem.global_batch}", "global_batch")
    for tp, dp, pp, _ in space.settings:
        if tp * dp * pp != num_devices:
            raise SpecError(f"the setting tp {tp} × dp {dp} × pp {pp} uses {tp * dp * pp} devices, the topology has "
                            f"{num_devices}")
    if space.settings:
        shapes = sorted({(tp, 1, dp, pp) for tp, dp, pp, _ in space.settings})
    else:
        shapes = [(tp, cp, dp, num_devices // (tp * cp * dp)) for tp in _divisors(num_devices)
                  for cp in sorted(set(space.cp)) if (num_devices // tp) % cp == 0
                  for dp in _divisors(num_devices // (tp * cp))]

    def schedule_choices(pp: int) -> list[tuple[str, int]]:
        if pp == 1:
            # One pipeline rank has no bubble to fill: gpipe, 1f1b and zb1p run the same ops in the same time, and
            # gpipe only holds more activations at once. Interleaving needs >= 2 pipeline ranks (Megatron). So one
            # plan: 1f1b if searched, else the first synchronous schedule searched (pipedream keeps its own semantics).
            flat = [name for name in space.schedules if SCHEDULES[name].flat and name != "pipedream"]
            single = ["1f1b"] if "1f1b" in flat else flat[:1]
            return [(name, 1) for name in single + (["pipedream"] if "pipedream" in space.schedules else [])]
        return [(name, chunks) for name in space.schedules
                for chunks in (space.chunks if SCHEDULES[name].chunked else (1,))]

    def sizes(tp: int, dp: int, pp: int) -> tuple[int, ...]:  # (the data-parallel degree sets the batch's split)
        if space.settings:
            return tuple(sorted({b for t, d, p, b in space.settings if (t, d, p) == (tp, dp, pp)}))
        if space.microbatch_sizes:
            return tuple(b for b in space.microbatch_sizes if b * dp <= problem.global_batch)
        return tuple(1 << k for k in range(problem.global_batch.bit_length()) if (1 << k) * dp <= problem.global_batch)

    # Every choice of each shape, worked out once: their product is the exact count of the points listed below,
    # checked against the limit before any is made.
    choices = []
    for tp, cp, dp, pp in shapes:
        orders = _orders_for({"tp": tp, "dp": dp * cp, "pp": pp}, space.rank_orders)
        zero_choices = sorted(set(space.zero)) if dp * cp > 1 else [0]
        replicate_counts = [len(sorted({r for r in space.dp_replicate if dp % r == 0}) or [1]) if zero == 3 else 1
                            for zero in zero_choices]
        placed = {order: _placements(problem, topology, tp, dp * cp, pp, order) for order in orders}
        # expert parallelism folds onto the stage's TP × CP × DP devices: the degrees that divide them
        experts = [(e, t) for e in sorted(set(space.ep)) for t in sorted(set(space.etp))
                   if (tp * cp * dp) % (e * t) == 0]
        shape = {"orders": orders, "zero": zero_choices, "placed": placed, "experts": experts,
                 "sp": sorted(set(space.sequence_parallel)) if tp > 1 else [False],
                 "comm": sorted(set(space.cp_comms)) if cp > 1 else ["ring"]}
        count = (len(sizes(tp, dp, pp)) * len(schedule_choices(pp)) * len(space.recompute) * len(shape["sp"])
                 * sum(replicate_counts) * sum(len(placed[order]) for order in orders) * len(space.partitions)
                 * len(shape["comm"]) * len(set(space.precisions)) * len(set(space.compile)) * len(experts))
        choices.append((tp, cp, dp, pp, shape, count))
    bound = sum(count for *_, count in choices)
    if bound > MAX_CANDIDATES:
        raise SpecError(f"the search space has {bound:,} candidates, more than {MAX_CANDIDATES:,}; narrow it "
                        f"(--schedules, --microbatch-sizes, --recompute, --chunks, --rank-orders)")
    found: list[Candidate] = []
    for tp, cp, dp, pp, shape, _ in choices:
        placed = shape["placed"]
        for b, (name, chunks), recompute, sp, zero, order, partition, comm, precision, compiled in product(
                sizes(tp, dp, pp), schedule_choices(pp), space.recompute, shape["sp"], shape["zero"],
                shape["orders"], space.partitions, shape["comm"], sorted(set(space.precisions)),
                sorted(set(space.compile))):
            replicate_choices = sorted({r for r in space.dp_replicate if dp % r == 0}) if zero == 3 else [1]
            for replicate, devices, (ep, etp) in product(replicate_choices or [1], placed[order], shape["experts"]):
                found.append(Candidate(tp, dp, pp, b, name, chunks, recompute, sp, zero, order, partition, devices,
                                       cp, comm, replicate, precision, compiled, ep, etp))
    return sorted(set(found))
