"""From what the user typed to a validated L1 plan with its cost model: the front half of ``sim.run``.

``build_plan`` parses the model and topology specs, generates (or loads) the L0 schedule, partitions the layers,
validates, lowers and validates again, so that an invalid plan is rejected before anything is simulated or executed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.cost.model import CostModel
from sim.cost.oracle import CostOracle
from sim.cost.profile import MeasuredProfile, load_profile
from sim.hw.topology import Topology
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.ir.schedule_csv import load_schedule_csv
from sim.ir.weight_versions import VERTICAL_SYNC_OPTION
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.plan.lower import add_recompute, lower
from sim.plan.partition import counts_to_ranges, parse_partition
from sim.plan.validate import validate, validate_l0
from sim.schedules import get_schedule

__all__ = ["PlanInputs", "BuiltPlan", "build_plan"]


@dataclass(frozen=True)
class PlanInputs:
    """The user's choices, as given on the command line.

    Attributes:
        model: model spec, e.g. ``"gpt:layers=48,hidden=2048"``.
        topology: topology spec, e.g. ``"16xV100"``.
        schedule: schedule name (ignored when ``schedule_file`` is set).
        microbatches: microbatches per iteration (``None``: 8, or inferred from ``schedule_file``).
        microbatch_size: samples per microbatch.
        partition: ``uniform``, ``balanced`` or comma-separated layer counts per stage.
        profile: path of a measured profile JSON, or ``None`` for roofline costs.
        schedule_file: path of a compute-only schedule CSV to use instead of a generator.
        chunks: model chunks (virtual stages) per rank, for schedules that interleave them (``--chunks``).
        recompute: recompute activations before each backward instead of keeping them (``--recompute``).
        vertical_sync: every stage uses stage 0's weight version per microbatch (``--vertical-sync``, stash only).
    """

    model: str
    topology: str
    schedule: str = "1f1b"
    microbatches: int | None = None
    microbatch_size: int = 1
    partition: str = "balanced"
    profile: str | None = None
    schedule_file: str | None = None
    chunks: int = 1
    recompute: bool = False
    vertical_sync: bool = False


@dataclass(frozen=True)
class BuiltPlan:
    """A validated L1 plan and everything needed to simulate it."""

    plan: Plan
    graph: LayerGraph
    topology: Topology
    costs: CostModel
    profile: MeasuredProfile | None


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


def build_plan(inputs: PlanInputs) -> BuiltPlan:
    """Parse, generate, partition, validate and lower.

    Raises:
        SpecError: any bad input (unknown model/topology/schedule, sizes, a malformed or invalid schedule file, a
            partition that does not fit); the message names the offending value.
    """
    if inputs.microbatch_size < 1:
        raise SpecError(f"--microbatch-size must be >= 1, got {inputs.microbatch_size}")
    if inputs.microbatches is not None and inputs.microbatches < 1:
        raise SpecError(f"--microbatches must be >= 1, got {inputs.microbatches}")
    if inputs.chunks < 1:
        raise SpecError(f"--chunks must be >= 1, got {inputs.chunks}")
    if inputs.schedule_file and inputs.vertical_sync:
        raise SpecError("--vertical-sync applies to the pipedream schedule, not to a schedule file")
    if inputs.schedule_file and inputs.chunks != 1:
        raise SpecError(f"--chunks {inputs.chunks} applies to generated schedules; a schedule file places its "
                        f"stages where its ops are ({inputs.schedule_file})")
    graph = build_model(inputs.model)
    topology = Topology.parse(inputs.topology)
    profile = load_profile(inputs.profile) if inputs.profile else None
    if inputs.schedule_file:
        programs = load_schedule_csv(inputs.schedule_file)
        vstage_to_rank = _placement_from_programs(programs, inputs.schedule_file)
        inferred = 1 + max(op.mb for program in programs for op in program if op.mb is not None)
        if inputs.microbatches is not None and inputs.microbatches != inferred:
            raise SpecError(f"{inputs.schedule_file} has {inferred} microbatches, --microbatches says "
                            f"{inputs.microbatches}")
        num_microbatches, schedule_name, weight_policy = inferred, "file", "flush"
        generator_options: tuple[tuple[str, int | bool], ...] = ()
        if len(programs) > topology.num_ranks:
            raise SpecError(f"{inputs.schedule_file} has {len(programs)} ranks, topology {topology} has "
                            f"{topology.num_ranks} devices")
    else:
        entry = get_schedule(inputs.schedule)
        num_microbatches = inputs.microbatches if inputs.microbatches is not None else 8
        num_ranks = topology.num_ranks
        # Sizes first, so that a too-small model is named before the generator's own constraints.
        vstage_to_rank = entry.vstage_to_rank(num_ranks, inputs.chunks) if entry.chunked else tuple(range(num_ranks))
        if len(vstage_to_rank) > len(graph):
            per_rank = f"{inputs.chunks} per device" if entry.chunked else "one per device"
            raise SpecError(f"more stages ({len(vstage_to_rank)}, {per_rank} of {topology}) than layers "
                            f"({len(graph)}) in {graph.spec}")
        programs = entry.build(num_ranks, num_microbatches, inputs.chunks)
        schedule_name, weight_policy = entry.name, entry.weight_policy
        generator_options = (("chunks", inputs.chunks),) if entry.chunked else ()
        if inputs.vertical_sync:
            if weight_policy != "stash":
                raise SpecError(f"--vertical-sync applies to weight stashing (pipedream), not {entry.name}")
            generator_options += ((VERTICAL_SYNC_OPTION, True),)
    num_vstages = len(vstage_to_rank)
    oracle = CostOracle(graph, inputs.microbatch_size, profile, topology)
    counts = parse_partition(inputs.partition, oracle, num_vstages, vstage_to_rank)
    placement = Placement(counts_to_ranges(counts), vstage_to_rank)
    l0 = Plan(
        schedule=schedule_name,
        level="L0",
        model=graph.spec,
        topology=str(topology),
        num_microbatches=num_microbatches,
        microbatch_size=inputs.microbatch_size,
        weight_policy=weight_policy,
        placement=placement,
        programs=programs,
        # The profile is recorded so that executor.run predicts with the costs this plan was made with.
        options=tuple(sorted((("partition", inputs.partition),) + generator_options
                             + ((("profile", inputs.profile),) if inputs.profile else ()))),
    )
    if inputs.recompute or any(op.kind is OpKind.R for program in programs for op in program):
        l0 = add_recompute(l0)  # also records ("recompute", True) in the options
    validate_l0(l0)
    plan = lower(l0)
    validate(plan)
    costs = CostModel(graph, topology, placement, inputs.microbatch_size, profile, oracle=oracle)
    return BuiltPlan(plan, graph, topology, costs, profile)
