"""From what the user typed to a validated L1 plan with its cost model: the front half of ``sim.run``.

``build_plan`` reads top-down: check the inputs, derive the layout (``sim.plan.layout``), build the model shard,
take the L0 programs from a schedule file or a generator (their size checked first, ``sim.plan.limits``), place the
layers with the cost oracle's partition, then validate, lower and validate again, so that an invalid plan is
rejected before anything is simulated or executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.oracle import CostOracle
from sim.cost.plan_costs import PlanCosts, check_graph, plan_costs, sharded_graph
from sim.cost.plan_settings import (
    BLOCKS_OPTION,
    EP_DISPATCHER_OPTION,
    LOSS_OPTION,
    OFFLOAD_OPTION,
    RECOMPUTE_MODULES_OPTION,
)
from sim.cost.profile import MeasuredProfile, load_profile
from sim.hw.topology import Topology
from sim.ir.ops import INPUT_GRADIENT_KINDS
from sim.ir.parallel import Parallelism
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.ir.schedule_csv import load_schedule_csv
from sim.ir.weight_versions import VERTICAL_SYNC_OPTION
from sim.models.blocks import BLOCKS
from sim.models.graph import LayerGraph
from sim.models.loss import LOSSES
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, check_recompute_modules
from sim.models.routing import BALANCED, Routing, parse_routing
from sim.models.sharding import DISPATCHERS
from sim.plan.inputs import PlanInputs
from sim.plan.layout import plan_is_pipeline_only, plan_layout, plan_microbatches
from sim.plan.limits import check_plan_size, compute_ops_per_microbatch
from sim.plan.lower import add_recompute, lower
from sim.plan.lower_collectives import EP_OVERLAP_OPTION, add_collectives
from sim.plan.partition import counts_to_ranges, parse_partition
from sim.plan.validate import validate, validate_l0
from sim.schedules import get_schedule

__all__ = ["BuiltPlan", "build_plan", "place_layers", "inputs_graph", "inputs_costs", "partition_layers"]

#: Options of a plan's generator: (name, value) pairs, recorded in the plan's options.
_Options = tuple[tuple[str, int | float | bool], ...]


@dataclass(frozen=True, repr=False)
class BuiltPlan:
    """A validated L1 plan, everything needed to simulate it, and the inputs it was built from (what a memory
    remedy changes: :mod:`sim.plan.memory_fit`)."""

    plan: Plan
    graph: LayerGraph
    topology: Topology
    costs: CostView
    profile: MeasuredProfile | None
    inputs: PlanInputs

    def __repr__(self) -> str:
        """Two lines: the plan's own repr and the model one device holds (the default repr printed every op, layer
        and link)."""
        profile = ", costed from a measured profile" if self.profile is not None else ""
        return f"BuiltPlan({self.plan!r}\n  model on one device: {self.graph.summary()}{profile})"

    def views(self, *, simulate_all: bool = False) -> tuple[CostView, ...]:
        """The cost views the engine simulates for this plan: one when its replicas are identical, else one per
        replica (``simulate_all``: one per replica in any case; :meth:`sim.cost.plan_costs.PlanCosts.views`)."""
        return PlanCosts(self.graph, self.costs.oracle, self.plan.layout).views(self.plan.placement,
                                                                                  simulate_all=simulate_all)


@dataclass(frozen=True)
class _Programs:
    """The L0 programs of a plan and what comes with them: from a schedule file or from a generator.

    Attributes:
        programs: one compute-only program per pipeline rank.
        vstage_to_rank: the pipeline rank of each virtual stage.
        num_microbatches: microbatches per iteration.
        schedule: the schedule's name (``"file"`` for a schedule file).
        weight_policy: ``flush``, ``stash`` or ``stream``.
        options: the generator's options, recorded in the plan.
        layout: the layout, its ``pp`` now the programs' rank count.
    """

    programs: tuple[tuple[Op, ...], ...]
    vstage_to_rank: tuple[int, ...]
    num_microbatches: int
    schedule: str
    weight_policy: str
    options: _Options
    layout: Parallelism


def build_plan(inputs: PlanInputs, topology: Topology | None = None) -> BuiltPlan:
    """Parse, generate, partition, validate and lower.

    Args:
        inputs: what to build.
        topology: ``inputs.topology`` already parsed, its devices possibly changed (a what-if, or fitting a device's
            unpublished figures: ``experiments.torchtitan``); its spec must be ``inputs.topology``. A plan records
            the spec only, so it is predicted again with the catalog's devices.

    Raises:
        SpecError: any bad input (unknown model/topology/schedule, sizes, a malformed or invalid schedule file, a
            partition that does not fit); the message names the offending value.
        ValueError: ``topology`` is not ``inputs.topology``'s.
    """
    _check_inputs(inputs)
    if topology is None:
        topology = Topology.parse(inputs.topology)
    elif topology.spec != inputs.topology:
        raise ValueError(f"topology {topology.spec!r} is not the inputs' {inputs.topology!r}")
    layout = plan_layout(inputs, topology)
    microbatches = plan_microbatches(inputs, layout)
    profile = load_profile(inputs.profile) if inputs.profile else None
    if profile is not None:
        _check_profile_shards(profile, layout)
    routing = parse_routing(inputs.routing)
    graph = inputs_graph(inputs, layout)
    check_graph(graph, layout, topology, precision=inputs.precision, compiled=inputs.compiled)
    if inputs.schedule_file:
        l0 = _programs_from_file(inputs, graph, topology, layout, microbatches)
    else:
        l0 = _generated_programs(inputs, graph, topology, layout, microbatches)
    if l0.weight_policy == "stream" and inputs.recompute_mode != "none":
        raise SpecError(f"{{recompute}} {inputs.recompute_mode} does not apply to {{schedule}} stream: a stage keeps "
                        f"one frame's activations, and recomputes only when the stream has ended (the drain)",
                        "recompute", "schedule")
    costs, placement = place_layers(inputs, profile, topology, l0.layout, l0.vstage_to_rank)
    plan = add_collectives(lower(_l0_plan(inputs, graph, topology, l0, placement, routing)))
    validate(plan)
    return BuiltPlan(plan, graph, topology, costs.first_view(placement), profile, inputs)


def _check_inputs(inputs: PlanInputs) -> None:
    """The checks of ``inputs`` that need nothing parsed: sizes, the recompute mode, what a schedule file excludes."""
    if inputs.microbatch_size < 1:
        raise SpecError(f"{{microbatch_size}} must be >= 1, got {inputs.microbatch_size}", "microbatch_size")
    if inputs.microbatches is not None and inputs.microbatches < 1:
        raise SpecError(f"{{microbatches}} must be >= 1, got {inputs.microbatches}", "microbatches")
    if inputs.chunks < 1:
        raise SpecError(f"{{chunks}} must be >= 1, got {inputs.chunks}", "chunks")
    factor = inputs.capacity_factor
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 0:
        raise SpecError(f"{{capacity_factor}} must be a number >= 0 (0: dropless), got {factor!r}", "capacity_factor")
    if inputs.recompute_mode not in ("none", "full", "selective"):
        raise SpecError(f"{{recompute}} takes full or selective, got {inputs.recompute!r}", "recompute")
    try:
        check_recompute_modules(inputs.recompute_modules)
    except ValueError as error:
        # the library's own line, its field named as the caller's flag ("recompute_modules must be ..." first)
        message = str(error).replace("recompute_modules", "{recompute_modules}", 1)
        raise SpecError(message if "{recompute_modules}" in message else f"{{recompute_modules}}: {message}",
                        "recompute_modules") from None
    if inputs.schedule_file and inputs.vertical_sync:
        raise SpecError("{vertical_sync} applies to the pipedream schedule, not to a schedule file", "vertical_sync")
    if inputs.schedule_file and inputs.chunks != 1:
        raise SpecError(f"{{chunks}} {inputs.chunks} applies to generated schedules; a schedule file places its "
                        f"stages where its ops are ({inputs.schedule_file})", "chunks")


def _programs_from_file(inputs: PlanInputs, graph: LayerGraph, topology: Topology, layout: Parallelism,
                        microbatches: int | None) -> _Programs:
    """The programs of ``inputs.schedule_file`` (PyTorch's schedule CSV), its placement inferred from where each
    vstage's ops are, its microbatch count from its ops; the lowered plan's size checked."""
    path = inputs.schedule_file
    assert path is not None  # build_plan's branch
    programs = load_schedule_csv(path)
    vstage_to_rank = _placement_from_programs(programs, path)
    inferred = 1 + max(op.mb for program in programs for op in program if op.mb is not None)
    if microbatches is not None and microbatches != inferred:
        raise SpecError(f"{path} has {inferred} microbatches, {{microbatches}} (or {{global_batch}}) says "
                        f"{microbatches}", "microbatches", "global_batch")
    # The file itself is bounded (sim.core.fileio.INPUT_LIMITS); its lowered plan and sizes are checked here.
    compute = sum(len(program) for program in programs)
    if inputs.recompute_mode == "full":
        compute += sum(op.kind in INPUT_GRADIENT_KINDS for program in programs for op in program)
    # Under tensor parallelism each compute op is followed by its collective: at most twice the ops.
    check_plan_size(graph, inferred, inputs.microbatch_size, vstage_to_rank,
                    compute * (2 if layout.tp > 1 else 1) / (len(vstage_to_rank) * inferred), False)
    if len(programs) * layout.tp * layout.data_ranks > topology.num_ranks:
        raise SpecError(f"{path} has {len(programs)} ranks, × TP {layout.tp} × DP·CP {layout.data_ranks} devices, "
                        f"topology {topology} has {topology.num_ranks} devices")
    if inputs.pp is not None and inputs.pp != len(programs):
        raise SpecError(f"{path} has {len(programs)} ranks, {{pp}} says {inputs.pp}", "pp")
    return _Programs(programs, vstage_to_rank, inferred, "file", "flush", (), replace(layout, pp=len(programs)))


def _generated_programs(inputs: PlanInputs, graph: LayerGraph, topology: Topology, layout: Parallelism,
                        microbatches: int | None) -> _Programs:
    """The programs of ``inputs.schedule``'s generator on ``layout.pp`` ranks, sizes checked before generating, with
    the generator's options (chunks, a stream's fps and CUDA graphs, vertical sync)."""
    entry = get_schedule(inputs.schedule)
    num_microbatches = microbatches if microbatches is not None else 8
    num_ranks = layout.pp
    # Sizes first, so that a too-small model is named before the generator's own constraints, and counted before
    # the placement is built (--chunks 1000000000 would otherwise make a tuple of billions first).
    per_rank_count = entry.chunks_per_rank(inputs.chunks)
    num_vstages = num_ranks * per_rank_count
    if num_vstages > len(graph):
        per_rank = "one per device" if per_rank_count == 1 else f"{per_rank_count} per device"
        where = (str(topology) if plan_is_pipeline_only(layout, topology) else
                 f"{num_ranks} pipeline ranks ({layout.describe()})")
        raise SpecError(f"more stages ({num_vstages}, {per_rank} of {where}) than layers ({len(graph)}) in "
                        f"{graph.spec}")
    vstage_to_rank = entry.vstage_to_rank(num_ranks, inputs.chunks)
    # Bounded work: what the plan will hold is known from its sizes, so it is checked before generating it.
    check_plan_size(graph, num_microbatches, inputs.microbatch_size, vstage_to_rank,
                    (compute_ops_per_microbatch(entry) + int(inputs.recompute_mode == "full"))
                    * (2 if layout.tp > 1 else 1), entry.weight_policy in ("stash", "stream"))
    programs = entry.build(num_ranks, num_microbatches, inputs.chunks)
    options: _Options = (("chunks", inputs.chunks),) if entry.chunked else ()
    options += _generator_options(inputs, entry.name, entry.weight_policy, topology, layout)
    return _Programs(programs, vstage_to_rank, num_microbatches, entry.name, entry.weight_policy, options, layout)


def _generator_options(inputs: PlanInputs, schedule: str, weight_policy: str, topology: Topology,
                       layout: Parallelism) -> _Options:
    """The options only some schedules take (``--fps`` and ``--cuda-graphs`` a stream, ``--vertical-sync`` weight
    stashing), each refused by name elsewhere."""
    options: _Options = ()
    if inputs.fps is not None:
        if weight_policy != "stream":
            raise SpecError(f"{{fps}} {inputs.fps:g} is the frame rate of a live source, for {{schedule}} stream, "
                            f"not {schedule}", "fps", "schedule")
        if not (isinstance(inputs.fps, (int, float)) and math.isfinite(inputs.fps) and inputs.fps > 0):
            raise SpecError(f"{{fps}} must be a finite number of frames per second > 0, got {inputs.fps!r}", "fps")
        options += (("fps", float(inputs.fps)),)
    if inputs.cuda_graphs:
        _check_cuda_graphs(inputs, schedule, topology, layout)
        options += (("cuda_graphs", True),)
    if inputs.vertical_sync:
        if weight_policy != "stash":
            raise SpecError(f"{{vertical_sync}} applies to weight stashing (pipedream), not {schedule}",
                            "vertical_sync")
        options += ((VERTICAL_SYNC_OPTION, True),)
    return options


def _l0_plan(inputs: PlanInputs, graph: LayerGraph, topology: Topology, l0: _Programs, placement: Placement,
             routing: Routing) -> Plan:
    """The validated L0 plan: the programs placed, with their options (``routing``: the inputs' routing, parsed)
    and recomputation (R ops added under full recomputation, an option under selective)."""
    programs = l0.programs
    plan = Plan(
        schedule=l0.schedule,
        level="L0",
        model=graph.spec,
        topology=str(topology),
        num_microbatches=l0.num_microbatches,
        microbatch_size=inputs.microbatch_size,
        weight_policy=l0.weight_policy,
        placement=placement,
        programs=programs,
        parallel=l0.layout,
        # The profile is recorded so that executor.run predicts with the costs this plan was made with.
        options=tuple(sorted((("partition", inputs.partition),) + l0.options
                             + ((("profile", inputs.profile),) if inputs.profile else ())
                             + ((("precision", inputs.precision),) if inputs.precision else ())
                             + ((("compile", True),) if inputs.compiled else ())
                             + ((("routing", routing.spec()),) if routing != BALANCED else ())
                             + ((("capacity_factor", float(inputs.capacity_factor)),)
                                if inputs.capacity_factor else ())
                             + (((EP_OVERLAP_OPTION, True),) if _ep_overlap(inputs, l0.layout) else ())
                             + (((EP_DISPATCHER_OPTION, inputs.ep_dispatcher),)
                                if inputs.ep_dispatcher != DISPATCHERS[0] else ())
                             + (((LOSS_OPTION, inputs.loss),) if inputs.loss != LOSSES[0] else ())
                             + (((BLOCKS_OPTION, inputs.blocks),) if inputs.blocks != BLOCKS[0] else ())
                             + (((OFFLOAD_OPTION, inputs.offload_activations),)
                                if inputs.offload_activations else ()))),
    )
    if inputs.recompute_mode == "selective":
        if any(op.kind is OpKind.R for program in programs for op in program):
            raise SpecError(f"{{recompute}} selective recomputes inside the backward; {inputs.schedule_file} has R ops "
                            f"(full recomputation)", "recompute")
        modules = ({RECOMPUTE_MODULES_OPTION: ",".join(inputs.recompute_modules)}
                   if inputs.recompute_modules != DEFAULT_RECOMPUTE_MODULES else {})
        plan = replace(plan, options=tuple(sorted({**dict(plan.options), "recompute": "selective",
                                                   **modules}.items())))
    elif inputs.recompute_mode == "full" or (l0.weight_policy != "stream" and any(
            op.kind is OpKind.R for program in programs for op in program)):
        plan = add_recompute(plan)  # also records ("recompute", True) in the options
    validate_l0(plan)
    return plan


def _check_profile_shards(profile: MeasuredProfile, layout: Parallelism) -> None:
    """Refuse a measured profile whose layers are not what one device of ``layout`` runs: a profile measures whole
    layers, or with ``profiles.measure --tp T`` one tensor-parallel shard of each (without sequence parallelism, which
    the executor does not run); it applies at that degree only."""
    measured = profile.tensor_parallel
    if measured != layout.tp:
        what = "whole layers" if measured == 1 else f"the shards of --tp {measured}"
        raise SpecError(f"{{profile}} {profile.source} measured {what}; {{tp}} {layout.tp} runs "
                        f"{'whole layers' if layout.tp == 1 else 'shards of ' + str(layout.tp)} (measure them with "
                        f"python -m profiles.measure --tp {layout.tp})", "profile", "tp")
    if layout.sequence_parallel:
        raise SpecError(f"{{profile}} {profile.source} measured shards without sequence parallelism; drop "
                        f"{{sequence_parallel}} or the profile", "profile", "sequence_parallel")


def _check_float8_gather(inputs: PlanInputs) -> None:
    """Refuse ``--fsdp-float8-all-gather`` without tensorwise FP8 linears (torchao gathers Float8Linear weights in FP8
    for its tensorwise recipe: the scale of a tensor is known before it is gathered)."""
    if inputs.fsdp_float8_gather and inputs.precision != "fp8":
        raise SpecError(f"{{fsdp_float8_gather}} gathers Float8Linear weights in FP8; it needs --precision fp8 "
                        f"(tensorwise), got {inputs.precision or 'the model precision'}", "fsdp_float8_gather")


def _check_dispatcher(inputs: PlanInputs, layout: Parallelism) -> None:
    """Refuse an unknown ``--ep-dispatcher``, one without expert parallelism, the deduplicated one under a skewed or
    capped routing, and the all-gather one beside tensor parallelism (Megatron-Core's gathers over the TP×EP group,
    which is the expert-parallel group only where TP and ETP are 1)."""
    if inputs.ep_dispatcher not in DISPATCHERS:
        raise SpecError(f"{{ep_dispatcher}} must be one of {', '.join(DISPATCHERS)}, got {inputs.ep_dispatcher!r}",
                        "ep_dispatcher")
    if inputs.ep_dispatcher != DISPATCHERS[0] and layout.ep == 1:
        raise SpecError(f"{{ep_dispatcher}} {inputs.ep_dispatcher} is how expert-parallel ranks exchange tokens; it "
                        f"needs --ep > 1, got {layout.describe()}", "ep_dispatcher")
    if inputs.ep_dispatcher == "deduplicated" and (parse_routing(inputs.routing) != BALANCED
                                                   or inputs.capacity_factor):
        raise SpecError("{ep_dispatcher} deduplicated is modelled for balanced dropless routing; use --routing "
                        "balanced without --capacity-factor", "ep_dispatcher")
    if inputs.ep_dispatcher == "all-gather" and (layout.tp > 1 or layout.etp > 1):
        raise SpecError(f"{{ep_dispatcher}} all-gather gathers over Megatron-Core's TP×EP group, modelled where that "
                        f"is the expert-parallel group alone: it needs --tp 1 and --etp 1, got {layout.describe()}",
                        "ep_dispatcher")


def _ep_overlap(inputs: PlanInputs, layout: Parallelism) -> bool:
    """Whether the plan overlaps its expert all-to-alls (``--ep-overlap``), refused where there are none."""
    if not inputs.ep_overlap:
        return False
    if layout.ep * layout.etp == 1:
        raise SpecError("{ep_overlap} overlaps the expert all-to-alls of expert parallelism; it needs --ep > 1 "
                        f"(or --etp > 1), got {layout.describe()}", "ep_overlap")
    return True


def _placement_from_programs(programs: tuple[tuple[Op, ...], ...], source: str) -> tuple[int, ...]:
    """Infer ``vstage_to_rank`` from where each vstage's ops appear, as PyTorch's ``_validate_schedule`` does."""
    rank_of: dict[int, int] = {}
    for rank, program in enumerate(programs):
        for op in program:
            if rank_of.setdefault(op.vstage, rank) != rank:
                raise SpecError(f"{source}: vstage {op.vstage} has ops on rank {rank_of[op.vstage]} and rank {rank}")
    missing = sorted(set(range(max(rank_of) + 1)) - set(rank_of))
    if missing:
        raise SpecError(f"{source}: vstage(s) {missing} have no ops")
    return tuple(rank_of[v] for v in range(len(rank_of)))


def _check_cuda_graphs(inputs: PlanInputs, schedule: str, topology: Topology, layout: Parallelism) -> None:
    """``--cuda-graphs`` models a captured step (PARTIME's stream step, Megatron-Core's full-iteration graphs): on
    GPUs, costed by the catalog and the kernel model (a measured profile's times include the eager overheads a graph
    removes, in a share no profile records), of a schedule fixed before the step starts (CSP decides online)."""
    if schedule == "csp":
        raise SpecError("{cuda_graphs} needs a program fixed before the step; csp decides each subnet's stages "
                        "online (NASPipe), so there is no step to capture", "cuda_graphs", "schedule")
    if inputs.profile:
        raise SpecError(f"{{cuda_graphs}} cannot apply to a measured profile ({inputs.profile}): its times include "
                        f"the per-op overheads a graph removes, in a share it does not record", "cuda_graphs")
    cpus = sorted({topology.devices[d].name for d in layout.device_ranks if not topology.devices[d].is_gpu})
    if cpus:
        raise SpecError(f"{{cuda_graphs}} needs GPUs; topology {topology} runs the plan on {', '.join(cpus)}",
                        "cuda_graphs")


def place_layers(inputs: PlanInputs, profile: MeasuredProfile | None, topology: Topology, layout: Parallelism,
                 vstage_to_rank: tuple[int, ...]) -> tuple[PlanCosts, Placement]:
    """The costs of a plan (:func:`inputs_costs`) and where its layers go: the partition rule resolved on the first
    replica's devices (tensor shard 0 of each group stands for it). ``build_plan`` calls it, and so do the search's
    strategies for the plans they cost without building them.

    Raises:
        SpecError: the partition does not fit (see :func:`sim.plan.partition.parse_partition`).
    """
    costs = inputs_costs(inputs, profile, topology, layout)
    return costs, partition_layers(inputs, costs.oracle, layout, vstage_to_rank)


def inputs_graph(inputs: PlanInputs, layout: Parallelism) -> LayerGraph:
    """The model as one device of ``layout`` holds it under these inputs: their recomputation, routing, capacity
    factor, token dispatcher, loss, blocks and offloaded activations (:func:`sim.cost.plan_costs.sharded_graph`)."""
    _check_dispatcher(inputs, layout)
    _check_float8_gather(inputs)
    if inputs.loss not in LOSSES:
        raise SpecError(f"{{loss}} must be one of {', '.join(LOSSES)}, got {inputs.loss!r}", "loss")
    return sharded_graph(inputs.model, layout, inputs.recompute_mode, parse_routing(inputs.routing),
                         inputs.capacity_factor, inputs.ep_dispatcher, loss=inputs.loss, blocks=inputs.blocks,
                         precision=inputs.precision, offloaded_blocks=inputs.offload_activations,
                         recompute_modules=inputs.recompute_modules)


def inputs_costs(inputs: PlanInputs, profile: MeasuredProfile | None, topology: Topology,
                 layout: Parallelism) -> PlanCosts:
    """The costs of a plan of ``layout`` with these inputs (:func:`sim.cost.plan_costs.plan_costs` with the model
    shard of :func:`inputs_graph` and the inputs' microbatch size, CUDA graphs, kernel model, precision and
    compilation), kept with the topology; ``profile`` is ``inputs.profile`` loaded."""
    return plan_costs(inputs_graph(inputs, layout), topology, layout, inputs.microbatch_size, profile,
                      precision=inputs.precision, cuda_graphs=inputs.cuda_graphs, kernel_model=inputs.kernel_model,
                      compiled=inputs.compiled)


def partition_layers(inputs: PlanInputs, oracle: CostOracle, layout: Parallelism,
                     vstage_to_rank: tuple[int, ...]) -> Placement:
    """Where the layers go: the inputs' partition rule resolved with ``oracle`` on the first replica's devices.

    Raises:
        SpecError: the partition does not fit (see :func:`sim.plan.partition.parse_partition`).
    """
    counts = parse_partition(inputs.partition, oracle, len(vstage_to_rank),
                             tuple(layout.device(rank, 0, 0) for rank in vstage_to_rank))
    return Placement(counts_to_ranges(counts), vstage_to_rank)
