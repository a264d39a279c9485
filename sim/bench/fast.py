"""Costing candidates fast: each plan structure built and compiled once, each candidate's costs through the same
functions ``build_plan`` uses, its time by the longest path (:mod:`sim.bench.critical_path`).

Candidates that differ only in sizes (tensor and data degrees, microbatch size, partition, rank order, sequence
parallelism) share a plan structure: the same ops, in the same order, with the same waits. A
:class:`FastEvaluator` builds the first candidate of each structure with :func:`sim.plan.build.build_plan` (so every
rule of the model, schedule and batch is checked by the code that checks it for ``sim.run``) and compiles it; for
the others it builds only the model shard, the cost oracle and the partition (:func:`sim.plan.build.place_layers`)
and evaluates the compiled structure with their costs.

What it returns is exact (``method="critical path"``: bit-identical to the engine, as the tests check over random
plans) unless two ops would have held one link at once; then the time is a lower bound (``method="critical path,
lower bound"``), which a caller must re-cost with the engine (:func:`sim.search.evaluate.evaluate`) whenever it could
beat the best time found. Peak memory is exact either way.

Who uses it: ``python -m sim.bench --search`` (:mod:`sim.bench.rate`, which times it and checks every result against
the engine's) and the brute force of ``experiments.run relaxed_search``, over up to ``--brute-limit`` partitions and
placements per problem. :func:`sim.search.search.run_search` does not: each of its strategies costs candidates by the
one prediction path (:func:`sim.search.evaluate.evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.bench.critical_path import CompiledPlan, NotCompilable, compile_plan
from sim.core.errors import SpecError
from sim.cost.profile import MeasuredProfile, load_profile
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.plan.build import build_plan, place_layers
from sim.plan.layout import plan_layout, plan_microbatches
from sim.search.evaluate import Evaluation, evaluate, memory_verdict
from sim.search.space import Candidate, SearchProblem

__all__ = ["FastEvaluator", "EXACT", "LOWER_BOUND", "ENGINE"]

ENGINE = "engine"
EXACT = "critical path"
LOWER_BOUND = "critical path, lower bound"


@dataclass(frozen=True)
class _Structure:
    """A compiled plan structure and the placement of its virtual stages (``None``: not compilable, use the
    engine)."""

    compiled: CompiledPlan | None
    vstage_to_rank: tuple[int, ...]


class FastEvaluator:
    """Costs the candidates of one problem (see the module docstring); keeps each structure it has compiled."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.topology = Topology.parse(problem.topology)
        self.profile: MeasuredProfile | None = load_profile(problem.profile) if problem.profile else None
        self.structures: dict[tuple, _Structure] = {}

    def _key(self, candidate: Candidate, microbatches: int | None) -> tuple:
        """What fixes a plan's ops: the schedule and its sizes, whether each kind of collective exists, and
        whether forwards are recomputed as ops of their own."""
        c = candidate
        return (c.schedule, c.pp, microbatches, c.chunks, c.recompute == "full", c.tp > 1, c.dp * c.cp > 1, c.zero,
                c.sequence_parallel, c.dp_replicate > 1, c.ep * c.etp > 1)

    def evaluate(self, candidate: Candidate) -> Evaluation:
        """The candidate's evaluation; infeasible ones say why (as :func:`sim.search.evaluate.evaluate`)."""
        problem = self.problem
        inputs = candidate.plan_inputs(problem)
        try:
            layout = plan_layout(inputs, self.topology)
            microbatches = plan_microbatches(inputs, layout)
            key = self._key(candidate, microbatches)
            structure = self.structures.get(key)
            if structure is None:
                built = build_plan(inputs)
                views = built.views()
                structure = self.structures[key] = _compile(built.plan, len(views))
                if structure.compiled is None:
                    return evaluate(problem, candidate)
            elif structure.compiled is None:
                return evaluate(problem, candidate)
            else:
                costs, placement = place_layers(inputs, self.profile, self.topology, layout, structure.vstage_to_rank)
                views = costs.views(placement)
            compiled = structure.compiled
            if len(views) != compiled.num_views:  # replicas alike or not depends on the candidate's layout
                return evaluate(problem, candidate)
            starts, ends = compiled.times(compiled.slot_values(views))
            makespan = float(compiled.span(starts, ends))
            contended = compiled.contended(views, starts, ends)
            peaks = compiled.peak_memory(views)
        except SpecError as exc:
            return Evaluation(candidate, False, reason=str(exc))
        pipeline = compiled.plan.num_ranks
        devices = [view.device_index_of(p) for view in views for p in range(pipeline)]
        names = [self.topology.devices[d].name for d in devices]
        capacities = [self.topology.devices[d].memory_bytes for d in devices]
        capacity, reason = memory_verdict(peaks, capacities, names, pipeline, problem)
        samples = compiled.plan.num_microbatches * inputs.microbatch_size * layout.dp
        return Evaluation(candidate, not reason, reason, makespan, samples / makespan if makespan > 0 else None,
                          compiled.plan.num_microbatches, tuple(views[0].placement.layer_counts()), peaks, capacity,
                          method=LOWER_BOUND if contended else EXACT)


def _compile(plan: Plan, num_views: int) -> _Structure:
    try:
        return _Structure(compile_plan(plan, num_views), plan.placement.vstage_to_rank)
    except NotCompilable:
        return _Structure(None, plan.placement.vstage_to_rank)
