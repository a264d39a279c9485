"""The screen (``--strategy screen``): every candidate of the space bounded from below, then the engine on the best
bounds until the pick is proven.

1. **Screen.** Each candidate's per-stage costs come from the cost views its plan would have (the same functions
   ``build_plan`` uses: :func:`sim.plan.build.inputs_costs` and its partition, so the one cost oracle), without
   building, lowering or simulating the plan; :mod:`sim.search.bound` turns them into a proven lower bound on the
   iteration time and on each rank's peak memory. A candidate whose memory bound exceeds a device's
   capacity cannot fit (pruned, with the reason); one that breaks a rule of the model, schedule or batch is
   infeasible as :func:`sim.search.evaluate.evaluate` would say. What candidates share is computed once: the model
   shard per sharding, the cost views per layout, microbatch size, partition and placement (the one-stage-per-rank
   schedules differ in their programs, not their views).
2. **Prove.** The candidates that may fit are simulated by the engine (:func:`sim.search.evaluate.evaluate`, the one
   prediction path) in order of their bound, best first, in rounds, until the best simulated time is within
   ``gap`` (1 %) of the lowest bound among those not simulated: no plan left can beat the pick by more than that.
   Every number the search reports is the engine's; the bounds only decide what to simulate and prove the rest.

The result says how much each stage covered and the proven gap (0 when every candidate that could win was
simulated); a time budget stops either stage early, and the gap is then what was proven by then (infinite when the
screen itself did not finish).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sim.core.collector import collector_paused
from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.ledger import program_order_peaks
from sim.cost.oracle import CostOracle
from sim.cost.profile import MeasuredProfile, load_profile
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.ir.plan import Placement, Plan
from sim.plan.build import inputs_costs, partition_layers
from sim.plan.layout import plan_layout, plan_microbatches
from sim.plan.lower import add_recompute, lower
from sim.plan.lower_collectives import add_collectives, check_data_parallel
from sim.schedules import SCHEDULES
from sim.search.bound import memory_lower_bound, stage_times, time_lower_bound
from sim.search.driver import EvaluationPool, evaluate_all, evaluation_pool, map_tasks
from sim.search.evaluate import Evaluation, memory_verdict
from sim.search.space import Candidate, SearchProblem
from sim.search.stopping import expired, interrupted

__all__ = ["Bound", "ScreenSummary", "Screener", "ScheduledPrograms", "screen_all", "screen_in_parallel", "prove",
           "summary", "DEFAULT_GAP", "MIN_SIMULATED"]

#: The proof's target: stop simulating once no candidate left can be more than this much faster than the pick.
DEFAULT_GAP = 0.01
#: Candidates the proof simulates at least (when that many may fit), so that the ranked table shows alternatives.
MIN_SIMULATED = 10


@dataclass(frozen=True)
class Bound:
    """What the screen proved of one candidate.

    Attributes:
        time_s: lower bound on its iteration time, s (``inf`` when it is infeasible: not computed for a candidate
            that breaks a rule or whose memory bound already rules it out).
        fits: False when it is infeasible: it breaks a rule, or its memory bound exceeds a device's capacity.
        reason: why it is infeasible ("" when it may be feasible).
        breaks_rule: it breaks a rule of the model, schedule or batch (its plan cannot be built).
        peak_bytes: lower bound on the peak memory of its fullest device, bytes (0 where the screen did not size it:
            a rule broken, or the average training state over every device).
    """

    time_s: float
    fits: bool
    reason: str = ""
    breaks_rule: bool = False
    peak_bytes: int = 0


@dataclass(frozen=True)
class ScreenSummary:
    """How far the screen and the proof got.

    Attributes:
        screened: candidates the screen bounded (all of them unless the time budget ended it).
        infeasible: of those, the ones that break a rule of the model, schedule or batch.
        over_memory: the candidates that cannot fit: the screen's memory bound, or (for those the proof reached)
            their exact peaks, exceeds a device.
        simulated: candidates the engine costed.
        lowest_unsimulated_s: the lowest time bound among the screened candidates that may fit and were not
            simulated, s (``inf`` when none is left).
        gap: how much faster than the pick (the best simulated feasible plan) a candidate not simulated could
            possibly be, as a fraction of the pick's time: ``max(0, 1 - lowest_unsimulated_s / best)`` (``inf`` when
            the screen did not finish or nothing feasible was simulated).
        screen_s: wall-clock time of the screen (and the refinement), s.
        refined: plans outside the listed space that the refinement bounded and added to the proof's candidates
            (:mod:`sim.search.refine`: other partitions and placements of the best layouts).
    """

    screened: int
    infeasible: int
    over_memory: int
    simulated: int
    lowest_unsimulated_s: float
    gap: float
    screen_s: float
    refined: int = 0


class ScheduledPrograms:
    """The lowered programs of each schedule structure a search meets, without costs: what the memory ledger replays
    for a candidate's exact peaks (:func:`sim.cost.ledger.program_order_peaks`, the engine's peak for plans without
    host copies) without building the candidate's plan. Shared by the candidates of the same schedule, ranks,
    microbatches, chunks, recomputation and layout."""

    def __init__(self) -> None:
        self.plans: dict[tuple, Plan] = {}

    def plan(self, candidate: Candidate, microbatches: int, placement: Placement, layout: Parallelism) -> Plan:
        """The lowered plan of ``candidate``'s schedule on ``placement``, as ``build_plan`` lowers it, with what
        changes its memory: R ops under full recomputation, the updates (per microbatch under weight stashing), and
        the collectives of ``layout`` (a data-parallel reduction's buffer is held from its issue to its update)."""
        entry = SCHEDULES[candidate.schedule]
        pipeline = max(placement.vstage_to_rank) + 1
        chunks = candidate.chunks if entry.chunked else 1
        key = (candidate.schedule, pipeline, microbatches, chunks, candidate.recompute == "full", layout)
        plan = self.plans.get(key)
        if plan is None:
            plan = Plan(schedule=entry.name, level="L0", model="", topology="", num_microbatches=microbatches,
                        microbatch_size=1, weight_policy=entry.weight_policy, placement=placement,
                        programs=entry.build(pipeline, microbatches, chunks), parallel=layout)
            if candidate.recompute == "full":
                plan = add_recompute(plan)
            plan = self.plans[key] = add_collectives(lower(plan))
        return replace(plan, placement=placement)


class Screener:
    """Bounds the candidates of one problem, keeping what they share (module docstring)."""

    def __init__(self, problem: SearchProblem, topology: Topology) -> None:
        self.problem, self.topology = problem, topology
        self.profile: MeasuredProfile | None = load_profile(problem.profile) if problem.profile else None
        self.views: dict[Candidate, tuple[tuple[CostView, ...], int]] = {}
        self.programs = ScheduledPrograms()
        self.layouts: dict[Parallelism, Parallelism] = {}
        #: The most memory a device of each layout has, bytes (the problem's limit where lower).
        self.largest_capacity: dict[Parallelism, int] = {}

    def bound(self, candidate: Candidate) -> Bound:
        """The candidate's :class:`Bound`; never raises for an infeasible one. The memory bound comes first: a
        candidate it rules out needs no time bound."""
        entry = SCHEDULES[candidate.schedule]
        try:
            views, microbatches = self._views(candidate)
        except _OverMemory as exc:
            return Bound(math.inf, False, str(exc))
        except SpecError as exc:
            return Bound(math.inf, False, str(exc), breaks_rule=True)
        stashing = entry.weight_policy == "stash"
        recompute_full = candidate.recompute == "full"
        peaks, capacities, names = [], [], []
        for view in views:
            peaks.extend(memory_lower_bound(view, candidate.schedule, microbatches, recompute_full=recompute_full,
                                            stashing=stashing))
            for rank in range(view.layout.pp):
                device = self.topology.devices[view.device_index_of(rank)]
                capacities.append(device.memory_bytes)
                names.append(device.name)
        _, reason = memory_verdict(tuple(peaks), capacities, names, views[0].layout.pp, self.problem)
        peak_bytes = int(max(peaks, default=0))
        if reason:
            return Bound(math.inf, False, reason.replace("needs", "needs at least", 1), peak_bytes=peak_bytes)
        updates = microbatches if stashing else 1
        time_s = max(time_lower_bound(candidate.schedule, microbatches, view.placement.vstage_to_rank,
                                      stage_times(view, split_backward=entry.split_backward,
                                                  recompute_full=recompute_full, updates=updates))
                     for view in views)
        return Bound(time_s, True, peak_bytes=peak_bytes)

    def memory_verdict(self, candidate: Candidate) -> str:
        """Why ``candidate`` does not fit in memory, "" when it does: its exact peaks, the memory ledger replayed
        over its lowered programs (the engine's own peaks), against each device's capacity. For a candidate the
        screen bounded (its views are kept)."""
        views, microbatches = self._views(candidate)
        layout = views[0].layout
        plan = self.programs.plan(candidate, microbatches, views[0].placement, layout)
        peaks = program_order_peaks(plan, views)
        devices = [self.topology.devices[view.device_index_of(rank)] for view in views for rank in range(layout.pp)]
        _, reason = memory_verdict(peaks, [d.memory_bytes for d in devices], [d.name for d in devices], layout.pp,
                                   self.problem)
        return reason

    def shape(self, candidate: Candidate) -> tuple[tuple[int, ...], Parallelism]:
        """The layers of each vstage of ``candidate``'s plan and its layout (with its device order).

        Raises:
            SpecError: the candidate breaks a rule, or cannot fit whatever its partition.
        """
        views, _ = self._views(candidate)
        return views[0].placement.layer_counts(), views[0].layout

    def _views(self, candidate: Candidate) -> tuple[tuple[CostView, ...], int]:
        """The cost views of ``candidate``'s plan and its microbatch count, shared by the candidates that differ
        only in a one-stage-per-rank schedule; the rules ``build_plan`` checks are checked first, before anything
        is costed.

        Raises:
            SpecError: the candidate breaks a rule (the message ``build_plan`` would give).
        """
        entry = SCHEDULES[candidate.schedule]
        inputs = candidate.plan_inputs(self.problem)
        # One object per distinct layout: it keeps its device groups for every view built on it.
        layout = plan_layout(inputs, self.topology)
        layout = self.layouts.setdefault(layout, layout)
        microbatches = plan_microbatches(inputs, layout)
        if microbatches is None:
            raise SpecError("the global batch is not a whole number of microbatches per replica")
        # The schedule's sizes and the data-parallel layouts it supports.
        entry.check(layout.pp, microbatches, candidate.chunks if entry.chunked else 1)
        check_data_parallel(layout, entry.name, entry.weight_policy, split_backward=entry.split_backward)
        shared = replace(candidate, schedule="1f1b") if entry.flat else candidate
        found = self.views.get(shared)
        if found is not None:
            return found
        vstage_to_rank = entry.vstage_to_rank(layout.pp, candidate.chunks)
        # Candidates with the same shard, microbatch size, state sharding and precision share one oracle, and so
        # its per-device layer costs and prefix sums (sim.cost.plan_costs keeps it with the topology).
        costs = inputs_costs(inputs, self.profile, self.topology, layout)
        if len(vstage_to_rank) > len(costs.graph):
            raise SpecError(f"{len(vstage_to_rank)} stages for {len(costs.graph)} layers: more stages than layers")
        self._check_average_state(costs.oracle, layout)
        placement = partition_layers(inputs, costs.oracle, layout, vstage_to_rank)
        views = costs.views(placement)
        found = self.views[shared] = (views, microbatches)
        return found


    def _check_average_state(self, oracle: CostOracle, layout: Parallelism) -> None:
        """Before the partition: some pipeline rank holds at least the average training state, all of which is
        resident from the start (:func:`sim.cost.ledger.resident_bytes`; the catalog's costs keep gradients in
        persistent buffers). Where even the average exceeds every device of the layout, the candidate cannot fit
        whatever the partition (a measured profile sizes layers per device: not checked then).

        Raises:
            SpecError: "out of memory", with the average and the largest capacity.
        """
        if self.profile is not None:
            return
        average = oracle.memory.state_bytes(0, len(oracle.graph)) / layout.pp
        largest = self.largest_capacity.get(layout)
        if largest is None:
            capacity = max(self.topology.devices[d].memory_bytes for d in layout.device_ranks)
            usable = self.problem.usable_bytes(capacity)
            largest = self.largest_capacity[layout] = math.inf if usable is None else usable
        if average > largest:
            raise _OverMemory(f"out of memory: the pipeline ranks hold {average / 1e9:.2f} GB of training state each "
                              f"on average, more than the {largest / 1e9:.2f} GB of the largest device")


class _OverMemory(SpecError):
    """A candidate that cannot fit whatever its partition (:meth:`Screener._check_average_state`)."""


def screen_all(screener: Screener, candidates: Sequence[Candidate], *,
               deadline: float | None = None) -> list[Bound | None]:
    """The :class:`Bound` of each candidate, in order; ``None`` for those not reached before ``deadline``
    (``time.time()`` seconds, which every worker process reads alike)."""
    found: list[Bound | None] = []
    # The screen allocates millions of small objects that form no cycles (memo keys, cost tuples), and each batch of
    # them sets off the cyclic collector over every memo kept so far: 12-15 % of the Llama 3.1 70B screen's time
    # (sim.bench.scale; 21-22 s against 18-19 s, the same peak RSS). Reference counting still frees them; the
    # collector runs again as before once the screen ends.
    with collector_paused():
        for candidate in candidates:
            if expired(deadline):
                found.extend([None] * (len(candidates) - len(found)))
                break
            found.append(screener.bound(candidate))
    return found


def _screen_slice(problem: SearchProblem, candidates: Sequence[Candidate],
                  deadline: float | None) -> list[Bound | None]:
    """One worker's share of :func:`screen_in_parallel`: a screener of its own over a contiguous slice."""
    if expired(deadline):  # a slice that starts after a Ctrl-C or the deadline costs no screener's set-up
        return [None] * len(candidates)
    # The objects the screen makes with the collector off (screen_all) all stay in its youngest generation, so the
    # first collection after it, set off by the next allocation, walks millions of them: 0.3 s between a Ctrl-C and
    # the answer (2026-12-07). In a worker nothing else lives here: they leave the collector's view (gc.freeze)
    # before it is back on; reference counting frees them as before, and none forms a cycle.
    with collector_paused():
        bounds = screen_all(Screener(problem, Topology.parse(problem.topology)), candidates, deadline=deadline)
        gc.freeze()
    return bounds


def screen_in_parallel(screener: Screener, candidates: Sequence[Candidate], *, workers: int = 1,
                       deadline: float | None = None, ray_address: str | None = None) -> list[Bound | None]:
    """:func:`screen_all` spread over ``workers`` processes (or a Ray cluster): the list cut into contiguous slices,
    two per worker (neighbours in the space's order share most of their costs), each screened by a screener of its
    own; the same bounds as one process, in order."""
    if workers == 1 and ray_address is None:
        return screen_all(screener, candidates, deadline=deadline)
    pieces = 2 * workers if ray_address is None else 16
    size = -(-len(candidates) // pieces)
    tasks = [(screener.problem, candidates[k:k + size], deadline) for k in range(0, len(candidates), size)]
    return [bound for part in map_tasks(_screen_slice, tasks, workers, ray_address) for bound in part]


def prove(screener: Screener, candidates: Sequence[Candidate], bounds: Sequence[Bound | None], *,
          workers: int = 1, gap: float = DEFAULT_GAP, deadline: float | None = None, seed: int = 0,
          progress: Callable[[Evaluation], None] | None = None,
          ray_address: str | None = None, grace_s: float = 0.0) -> tuple[list[Evaluation], float, bool]:
    """Simulate the candidates that may fit in order of their bound until the best is proven within ``gap`` of every
    candidate left (module docstring), and at least :data:`MIN_SIMULATED` of them. A candidate whose exact peaks
    (:meth:`Screener.memory_verdict`) do not fit is refused without simulating it. Past the deadline, while no
    simulated plan fits, the best bounds are still simulated one at a time for up to ``grace_s`` seconds, so that a
    budget the screen used up still ends with a plan (never after Ctrl-C).

    Returns:
        The evaluations (in the order made), the lowest bound left unsimulated (s; ``inf`` when none), and whether
        the deadline (``time.time()`` seconds) stopped it first.
    """
    # One pool for every round (a worker's start-up paid once); a round, even of one plan, runs there, so that Ctrl-C
    # abandons a simulation in progress instead of waiting for it. Ray keeps its own workers.
    with evaluation_pool(workers if ray_address is None else 1) as pool:
        return _prove_rounds(screener, candidates, bounds, workers=workers, gap=gap, deadline=deadline, seed=seed,
                             progress=progress, ray_address=ray_address, grace_s=grace_s, pool=pool)


def _prove_rounds(screener: Screener, candidates: Sequence[Candidate], bounds: Sequence[Bound | None], *,
                  workers: int, gap: float, deadline: float | None, seed: int,
                  progress: Callable[[Evaluation], None] | None, ray_address: str | None, grace_s: float,
                  pool: EvaluationPool | None) -> tuple[list[Evaluation], float, bool]:
    """:func:`prove`'s rounds, simulating in ``pool`` (``None``: this process, or Ray)."""
    problem = screener.problem
    order = sorted((b.time_s, i) for i, b in enumerate(bounds) if b is not None and b.fits and b.time_s < math.inf)
    done: list[Evaluation] = []
    best = math.inf
    position = simulated = 0
    batch = max(1, workers) * 2
    # Handed out but not costed (a round the deadline cut short): ahead of the rest, their bounds being lower.
    waiting: list[tuple[float, Candidate]] = []
    while waiting or position < len(order):
        lowest = waiting[0][0] if waiting else order[position][0]
        if best <= lowest * (1 + gap) and simulated >= MIN_SIMULATED:
            return done, lowest, False
        left = None if deadline is None else deadline - time.time()
        late = interrupted() or (left is not None and left <= 0)
        if late and (best < math.inf or interrupted() or left <= -grace_s):  # type: ignore[operator]
            return done, lowest, True
        size = 1 if late else batch
        chunk, waiting = waiting[:size], waiting[size:]  # (bound, candidate) to simulate
        # An exact memory verdict takes up to a tenth of a second and the best bounds are often plans that do not
        # fit: a stop is heard between two verdicts, not after a round's worth of them.
        while position < len(order) and len(chunk) < size and not (interrupted() or (not late and expired(deadline))):
            bound, index = order[position]
            position += 1
            reason = screener.memory_verdict(candidates[index])
            if reason:
                done.append(Evaluation(candidates[index], False, reason=reason))
                if progress is not None:
                    progress(done[-1])
            else:
                chunk.append((bound, candidates[index]))
        if not chunk:
            continue
        if late:  # the grace: one plan, whatever the budget says (a Ctrl-C still ends it)
            result = evaluate_all(problem, [chunk[0][1]], seed=seed, progress=progress, in_order=True, pool=pool)
        else:
            result = evaluate_all(problem, [c for _, c in chunk], workers=workers, time_budget_s=left, seed=seed,
                                  progress=progress, in_order=True, ray_address=ray_address, pool=pool)
        done.extend(result.evaluations)
        simulated += len(result.evaluations)
        best = min([best] + [e.iteration_time_s for e in result.evaluations if e.feasible])  # type: ignore[list-item]
        costed = {e.candidate for e in result.evaluations}
        waiting = [(bound, c) for bound, c in chunk if c not in costed] + waiting
    return done, math.inf, False


def summary(bounds: Sequence[Bound | None], evaluations: Sequence[Evaluation], lowest_unsimulated_s: float,
            screen_s: float, *, refined: int = 0) -> ScreenSummary:
    """The :class:`ScreenSummary` of a screened search; ``bounds`` are the listed candidates', ``evaluations``
    :func:`prove`'s (over those and the ``refined`` plans)."""
    reached = [b for b in bounds if b is not None]
    feasible = [e.iteration_time_s for e in evaluations if e.feasible]
    best = min(feasible, default=math.inf)
    complete = len(reached) == len(bounds)
    if not complete or best == math.inf:
        gap = math.inf
    else:
        gap = max(0.0, 1.0 - lowest_unsimulated_s / best) if lowest_unsimulated_s < math.inf else 0.0
    refused_by_ledger = sum(1 for e in evaluations if e.iteration_time_s is None)
    return ScreenSummary(len(reached), sum(1 for b in reached if b.breaks_rule),
                         sum(1 for b in reached if not b.breaks_rule and not b.fits) + refused_by_ledger,
                         len(evaluations) - refused_by_ledger, lowest_unsimulated_s, gap, screen_s, refined)
