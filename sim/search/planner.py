"""The planner's screen (``--strategy planner``): every candidate ranked by PipeDream's pipeline model before the
simulator costs the most promising ones first.

PipeDream's planner (Narayanan et al., SOSP'19 §3.1) chooses a partition by the time of the slowest stage per
microbatch, since that bounds a pipeline's steady state. Here the same objective, extended to a whole iteration,
screens the search space without building any plan:

    estimate = m · (the bottleneck rank's work per microbatch) + fill · (the slowest virtual stage)
               + the slowest stage's data-parallel collectives and optimizer step

where a rank's work per microbatch is the sum over its virtual stages of every op the engine would run for one
microbatch (F, B, the recomputed F under full recomputation, the tensor-parallel collectives, its sends), each costed by
the plan's own cost view (:class:`sim.cost.cost_view.CostView`, so by the one cost oracle), for the partition and
placement
``build_plan`` gives (:func:`sim.plan.build.partition_layers`; the balanced partition is itself PipeDream's dynamic
program, on each stage's own device). ``fill`` is the schedule's warm-up and cool-down in stage times: ``p − 1`` for
gpipe and 1f1b (bubble (p−1)/(m+p−1)), the same in chunk times for interleaved (bubble ÷ v), a third of it for zb1p
(ZB-H1 fills two thirds of 1F1B's bubble with deferred weight gradients, Qi et al. 2024 §3). A memory screen puts the
plans that will not fit behind the others: the schedule's own programs (its L0 ops, with the R ops of full recomputation
and the per-microbatch updates of weight stashing) replayed through the memory ledger
(:func:`sim.cost.ledger.program_order_peaks`), which gives the engine's peak exactly, without sends, receives or times
(a property test holds it to the engine). The time estimate knows no contention: it only orders the candidates; every
number the search reports is the simulator's. The planner costs candidates with the simulator in the estimate's order,
best first, until ``evaluations`` are costed or the time budget ends, so a budget is spent where the plans are good.
Under a time budget the estimates get half of it, in a seeded random order (at 512 GPUs an estimate takes about 0.1 s,
so a minute estimates a few hundred of 18,507 candidates: the screen then only orders a sample).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from sim.core.errors import SpecError
from sim.cost.ledger import program_order_peaks
from sim.cost.profile import load_profile
from sim.hw.topology import Topology
from sim.ir.ops import Action, collective_after
from sim.ir.plan import OpKind
from sim.plan.build import inputs_costs, partition_layers
from sim.plan.layout import plan_layout, plan_microbatches
from sim.schedules import SCHEDULES
from sim.search.screen import ScheduledPrograms
from sim.search.space import Candidate, SearchProblem
from sim.search.stopping import expired

__all__ = ["estimate_all", "FILL", "OVER_MEMORY"]

# The tensor-parallel collective after each compute kind (the op table's ``follows``).
_TP_AFTER = collective_after(Action.TP_COLLECTIVE)

#: Added to the estimate of a plan the memory screen says will not fit, so that it sorts after every one that will, s.
OVER_MEMORY = 1e9
#: Warm-up plus cool-down of each schedule, in (virtual) stage times per pipeline rank beyond the first.
#: DualPipeV: p − 1 units of F = I = W over stages of F + I + W = 3 units (sim.schedules.dualpipev, its test), 1/3.
FILL = {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 1.0, "zb1p": 1.0 / 3.0, "pipedream": 1.0, "dualpipev": 1.0 / 3.0}


class _Screen:
    """The estimates of one problem, keeping what its candidates share: the profile (read once), the costs of each
    layout (kept with the topology, :mod:`sim.cost.plan_costs`), and the per-rank work of each candidate up to its
    schedule when that runs one stage per rank (those schedules differ only in their fill)."""

    def __init__(self, problem: SearchProblem, topology: Topology) -> None:
        self.problem, self.topology = problem, topology
        self.profile = load_profile(problem.profile) if problem.profile else None
        self.works: dict[Candidate, tuple] = {}
        self.programs = ScheduledPrograms()

    def estimate(self, candidate: Candidate) -> float:
        """The estimate of ``candidate`` (module docstring), s.

        Raises:
            SpecError: its costs cannot be built (it breaks a rule of the model, schedule or batch).
        """
        microbatches, pipeline, worst_rank, worst_vstage, tail, (_, _, capacities, _) = self._work_of(candidate)
        fill = FILL.get(candidate.schedule, 1.0) * (pipeline - 1)
        estimate = microbatches * worst_rank + fill * worst_vstage + tail
        # A plan the memory screen says will not fit goes behind every one it says will (not out: a search without
        # feasible plans still shows the closest ones).
        fits = all(peak <= capacity for peak, capacity in zip(self.peaks(candidate), capacities))
        return estimate if fits else OVER_MEMORY + estimate

    def peaks(self, candidate: Candidate) -> tuple[int, ...]:
        """The memory screen's peak of each simulated rank of ``candidate``, bytes: the memory ledger over the
        lowered programs of its schedule, which is the engine's ``peak_memory_bytes``."""
        microbatches, _, _, _, _, (views, placement, _, layout) = self._work_of(candidate)
        return program_order_peaks(self.programs.plan(candidate, microbatches, placement, layout), views)

    def _work_of(self, candidate: Candidate) -> tuple:
        """:meth:`_work`, shared by the candidates that differ only in a one-stage-per-rank schedule (those
        schedules differ in their fill and their memory, which are not part of it)."""
        shared = replace(candidate, schedule="1f1b") if SCHEDULES[candidate.schedule].flat else candidate
        work = self.works.get(shared)
        if work is None:
            work = self.works[shared] = self._work(candidate)
        return work

    def _work(self, candidate: Candidate) -> tuple[int, int, float, float, float, tuple]:
        """``(m, p, the bottleneck rank's work per microbatch, the slowest virtual stage's, the slowest update, what
        the memory screen needs: (the cost views, the placement, each simulated rank's capacity in bytes, the
        parallel layout))``."""
        problem, topology, profile = self.problem, self.topology, self.profile
        inputs = candidate.plan_inputs(problem)
        layout = plan_layout(inputs, topology)
        microbatches = plan_microbatches(inputs, layout)
        if microbatches is None:
            raise SpecError("no microbatch count")
        entry = SCHEDULES[candidate.schedule]
        vstage_to_rank = entry.vstage_to_rank(layout.pp, candidate.chunks)
        costs = inputs_costs(inputs, profile, topology, layout)
        if len(vstage_to_rank) > len(costs.graph):
            raise SpecError("more stages than layers")
        placement = partition_layers(inputs, costs.oracle, layout, vstage_to_rank)
        views = costs.views(placement)
        recompute_full = inputs.recompute_mode == "full"
        worst_rank = worst_vstage = tail = 0.0
        capacities = []
        for view in views:
            for rank in range(layout.pp):
                usable = problem.usable_bytes(topology.devices[view.device_index_of(rank)].memory_bytes)
                capacities.append(math.inf if usable is None else usable)
            per_rank = [0.0] * layout.pp
            for vstage, rank in enumerate(vstage_to_rank):
                work = view.compute_time(OpKind.F, vstage) + view.compute_time(OpKind.B, vstage)
                if recompute_full:
                    work += view.compute_time(OpKind.R, vstage)
                if layout.tp > 1:
                    work += (view.collective_op(_TP_AFTER[OpKind.F], vstage).seconds
                             + view.collective_op(_TP_AFTER[OpKind.B], vstage).seconds) + (
                        view.collective_op(_TP_AFTER[OpKind.R], vstage).seconds if recompute_full else 0.0)
                if vstage + 1 < len(vstage_to_rank) and vstage_to_rank[vstage + 1] != rank:
                    work += view.message(OpKind.SEND_F, vstage, rank, vstage_to_rank[vstage + 1]).seconds
                if vstage > 0 and vstage_to_rank[vstage - 1] != rank:
                    work += view.message(OpKind.SEND_B, vstage, rank, vstage_to_rank[vstage - 1]).seconds
                per_rank[rank] += work
                worst_vstage = max(worst_vstage, work)
                update = view.compute_time(OpKind.OPT_STEP, vstage)
                # The step waits for the (last) gradient reduction and, under ZeRO-1 and 2, is followed by the
                # parameters' all-gather; ZeRO-3 does both inside the forward and backward (sim.cost.fsdp).
                if layout.data_ranks > 1 and layout.zero < 3:
                    update += view.collective_op(OpKind.REDUCE_GRAD, vstage).seconds
                    if layout.zero:
                        update += view.collective_op(OpKind.GATHER_PARAMS, vstage).seconds
                tail = max(tail, update)
            worst_rank = max(worst_rank, max(per_rank))
        return (microbatches, layout.pp, worst_rank, worst_vstage, tail,
                (tuple(views), placement, tuple(capacities), layout))


def estimate_all(problem: SearchProblem, topology: Topology, candidates: Sequence[Candidate], *,
                 deadline: float | None = None, seed: int = 0) -> list[float | None]:
    """The estimate (s) of each candidate, ``inf`` where its costs cannot be built (it breaks a rule: the simulator
    will say which when it costs it). With a wall-clock ``deadline`` (``time.time()`` seconds) the candidates are
    estimated in a seeded random order until it passes, and the ones not reached are ``None``."""
    screen = _Screen(problem, topology)
    found: list[float | None] = [None] * len(candidates)
    order = list(range(len(candidates)))
    if deadline is not None:
        random.Random(seed).shuffle(order)
    for index in order:
        if expired(deadline):
            break
        try:
            found[index] = screen.estimate(candidates[index])
        except SpecError:
            found[index] = float("inf")
    return found
