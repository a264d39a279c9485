"""Joint partition and placement on mixed clusters, checked against brute force (``python -m sim.bench --search``,
issue #27's item 3): the screened search's pick beside the engine's best over every partition of the layers and
every placement of the device blocks, on a seeded suite of small mixed clusters where that brute force is
affordable. The target: within 1 % on every case.

The brute force costs, with the engine (:func:`sim.search.evaluate.evaluate`, the one prediction path), every
candidate of the listed space with each one-stage-per-rank pipeline replaced by every composition of its layers
into stages on every distinct placement (:func:`sim.search.placement.stage_placements` without its cap). Cases whose
brute force would cost more than :data:`MAX_BRUTE_FORCE` plans are drawn again (counted before any is costed).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from math import comb

from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.models import build_model
from sim.schedules import SCHEDULES
from sim.search.evaluate import evaluate
from sim.search.placement import stage_placements
from sim.search.search import run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace, enumerate_candidates

__all__ = ["JointCheck", "brute_force_plans", "brute_force_best", "joint_suite", "check_joint", "MAX_BRUTE_FORCE",
           "TARGET"]

#: Plans a case's brute force may cost at most.
MAX_BRUTE_FORCE = 1500
#: The screened pick may be this much slower than the brute-force best, as a fraction.
TARGET = 0.01

_TOPOLOGIES = ("1xT4+3xA100", "2xV100+2xA100", "2xT4+2xV100+2xA100", "2x2xV100+1x4xA100", "4xV100+4xA100")


@dataclass(frozen=True)
class JointCheck:
    """One case's figures.

    Attributes:
        problem: the case.
        brute_force_plans: plans the brute force costed.
        brute_force_s: the engine's best iteration time over them, s.
        listed_s: the best over the listed space (balanced partitions, capped placements), s.
        screened: the screened search's pick (its iteration time is the engine's).
    """

    problem: SearchProblem
    brute_force_plans: int
    brute_force_s: float
    listed_s: float
    screened: Candidate
    screened_s: float

    @property
    def gap(self) -> float:
        """How much slower the screened pick is than the brute-force best, as a fraction (negative: faster)."""
        return self.screened_s / self.brute_force_s - 1


def _compositions(layers: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``layers`` into ``parts`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        edges = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def _expandable(candidate: Candidate) -> bool:
    return candidate.pp > 1 and SCHEDULES[candidate.schedule].flat


def brute_force_plans(problem: SearchProblem) -> Iterator[Candidate]:
    """The listed space with every one-stage-per-rank pipeline in every placement and every partition."""
    topology = Topology.parse(problem.topology)
    layers = len(build_model(problem.model))
    seen: set[Candidate] = set()
    for candidate in enumerate_candidates(problem, topology.num_ranks, topology):
        if not _expandable(candidate):
            plans = [candidate]
        else:
            layout = Parallelism(tp=candidate.tp, dp=candidate.dp * candidate.cp, pp=candidate.pp,
                                 order=candidate.rank_order)
            plans = [replace(candidate, devices=order, partition=",".join(map(str, counts)))
                     for order in stage_placements(layout, topology, limit=10**9)
                     for counts in _compositions(layers, candidate.pp)]
        for plan in plans:
            if plan not in seen:
                seen.add(plan)
                yield plan


def _brute_force_size(problem: SearchProblem) -> int:
    """How many plans :func:`brute_force_plans` yields at most, without listing the partitions."""
    topology = Topology.parse(problem.topology)
    layers = len(build_model(problem.model))
    total = 0
    for candidate in enumerate_candidates(problem, topology.num_ranks, topology):
        if _expandable(candidate) and candidate.devices == () and candidate.pp <= layers:
            layout = Parallelism(tp=candidate.tp, dp=candidate.dp * candidate.cp, pp=candidate.pp,
                                 order=candidate.rank_order)
            total += len(stage_placements(layout, topology, limit=10**9)) * comb(layers - 1, candidate.pp - 1)
        elif not _expandable(candidate):
            total += 1
    return total


def brute_force_best(problem: SearchProblem) -> tuple[float, int]:
    """The engine's best iteration time over :func:`brute_force_plans`, s, and how many plans it costed."""
    best, costed = float("inf"), 0
    for plan in brute_force_plans(problem):
        evaluation = evaluate(problem, plan)
        costed += 1
        if evaluation.feasible:
            best = min(best, evaluation.iteration_time_s)  # type: ignore[type-var]
    return best, costed


def joint_suite(count: int = 8, seed: int = 0) -> list[SearchProblem]:
    """``count`` distinct small mixed-cluster problems drawn with ``seed``: GPTs of 4-8 blocks, global batches that
    leave one to eight microbatches per replica (few: where the balanced partition is furthest from the engine's
    best), every brute force within :data:`MAX_BRUTE_FORCE` plans."""
    rng = random.Random(seed)
    space = SearchSpace(schedules=("gpipe", "1f1b"), recompute=("none",), zero=(0,), sequence_parallel=(False,),
                        microbatch_sizes=(2,))
    found: list[SearchProblem] = []
    while len(found) < count:
        model = (f"gpt:layers={rng.choice([4, 6, 8])},hidden={rng.choice([512, 1024, 2048])},heads=8,seq=512,"
                 f"vocab=8000")
        problem = SearchProblem(model, rng.choice(_TOPOLOGIES), rng.choice([8, 16, 32]), space=space)
        if problem not in found and _brute_force_size(problem) <= MAX_BRUTE_FORCE:
            found.append(problem)
    return found


def check_joint(problem: SearchProblem) -> JointCheck:
    """One case: brute force, the listed space's best (exhaustive) and the screened search's pick."""
    brute_s, costed = brute_force_best(problem)
    listed = run_search(problem).best
    screened = run_search(problem, strategy="screen").best
    assert listed is not None and screened is not None and listed.iteration_time_s is not None
    assert screened.iteration_time_s is not None
    return JointCheck(problem, costed, brute_s, listed.iteration_time_s, screened.candidate,
                      screened.iteration_time_s)
