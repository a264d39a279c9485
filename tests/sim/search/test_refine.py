"""The screen's refinement of partition and placement (sim.search.refine) against brute force: on small mixed
clusters with few microbatches, where the balanced partition is not the engine's best, the screened search finds
the best plan over every partition and every placement (each simulated by the engine) within 1 %; what it adds are
plans outside the listed space, each with the screen's own bound."""

import itertools
from dataclasses import replace

import pytest

from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.models import build_model
from sim.search.evaluate import evaluate
from sim.search.placement import stage_placements
from sim.search.refine import refine
from sim.search.screen import Screener, screen_all
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates

SPACE = SearchSpace(schedules=("1f1b",), recompute=("none",), zero=(0,), sequence_parallel=(False,),
                    microbatch_sizes=(2,))
PROBLEMS = [
    # Two microbatches per replica: the fill, the drain and the update weigh as much as the steady state.
    SearchProblem("gpt:layers=6,hidden=1024,heads=8,seq=512,vocab=8000", "1xT4+3xA100", 16, space=SPACE),
    SearchProblem("gpt:layers=4,hidden=2048,heads=8,seq=512,vocab=8000", "2xV100+2xA100", 16, space=SPACE),
]


def compositions(layers: int, parts: int):
    for cuts in itertools.combinations(range(1, layers), parts - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force_best(problem: SearchProblem) -> float:
    """The engine's best over every listed layout, each pipeline in every placement with every partition."""
    topology = Topology.parse(problem.topology)
    layers = len(build_model(problem.model))
    best = float("inf")
    for candidate in enumerate_candidates(problem, topology.num_ranks, topology):
        if candidate.pp == 1:
            plans = [candidate]
        else:
            layout = Parallelism(tp=candidate.tp, dp=candidate.dp, pp=candidate.pp)
            plans = [replace(candidate, devices=order, partition=",".join(map(str, counts)))
                     for order in stage_placements(layout, topology, limit=10**6)
                     for counts in compositions(layers, candidate.pp)]
        for plan in plans:
            evaluation = evaluate(problem, plan)
            if evaluation.feasible:
                best = min(best, evaluation.iteration_time_s)
    return best


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.topology)
def test_the_screened_search_is_within_one_per_cent_of_every_partition_and_placement(problem):
    found = run_search(problem, strategy="screen")
    listed_best = run_search(problem).best.iteration_time_s
    best = brute_force_best(problem)
    assert found.best.iteration_time_s <= listed_best
    assert found.best.iteration_time_s <= best * 1.01, (found.best.candidate.label(), best)
    assert found.screen.refined > 0


def test_it_adds_only_unlisted_plans_that_may_fit_each_with_its_own_bound():
    problem = PROBLEMS[0]
    topology = Topology.parse(problem.topology)
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    screener = Screener(problem, topology)
    bounds = screen_all(screener, candidates)
    added, added_bounds = refine(screener, candidates, bounds)
    assert added and len(added) == len(added_bounds) == len(set(added))
    assert not set(added) & set(candidates)
    fresh = Screener(problem, topology)
    for candidate, bound in zip(added, added_bounds):
        assert bound.fits and bound == fresh.bound(candidate)
        assert candidate.partition != "balanced" and candidate.pp > 1
    # Deterministic: the same inputs, the same plans in the same order.
    again = refine(Screener(problem, topology), candidates, screen_all(Screener(problem, topology), candidates))
    assert again == (added, added_bounds)
