"""The screen's refinement of partition and placement (sim.search.refine) against brute force: on small mixed
clusters with few microbatches, where the balanced partition is not the engine's best, the screened search finds
the best plan over every partition and every placement (each simulated by the engine) within 1 %; what it adds are
plans outside the listed space, each with the screen's own bound."""

from dataclasses import replace

import pytest

from sim.bench.joint_check import brute_force_best
from sim.hw.topology import Topology
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


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.topology)
def test_the_screened_search_is_within_one_per_cent_of_every_partition_and_placement(problem):
    found = run_search(problem, strategy="screen")
    listed_best = run_search(problem).best.iteration_time_s
    best, _ = brute_force_best(problem)
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
    listed = set(candidates)
    for candidate, bound in zip(added, added_bounds):
        assert bound.fits and bound == fresh.bound(candidate)
        assert candidate.partition != "balanced" and candidate.pp > 1
        # Not a listed plan spelled out: the balanced partition's own counts on the same devices are that plan.
        twin = replace(candidate, partition="balanced")
        if twin in listed:
            assert ",".join(map(str, fresh.shape(twin)[0])) != candidate.partition, candidate.label()
    # Deterministic: the same inputs, the same plans in the same order.
    again = refine(Screener(problem, topology), candidates, screen_all(Screener(problem, topology), candidates))
    assert again == (added, added_bounds)


def test_the_brute_force_lists_every_partition_on_every_placement():
    from math import comb

    from sim.bench.joint_check import brute_force_plans
    from sim.models import build_model

    # 8 layers on 1xT4+3xA100: 3 one-stage layouts (TP 1, 2, 4); at PP 2 two layouts (TP 1 x DP 2, TP 2 x DP 1),
    # each with blocks {T4, A100} and {A100, A100}: 2 placements; at PP 4 one layout, the T4 on any of 4 stages.
    problem = PROBLEMS[0]
    layers = len(build_model(problem.model))
    plans = list(brute_force_plans(problem))
    assert len(plans) == len(set(plans))
    by_pp = {pp: sum(1 for p in plans if p.pp == pp) for pp in (1, 2, 4)}
    assert by_pp == {1: 3, 2: 2 * 2 * comb(layers - 1, 1), 4: 4 * comb(layers - 1, 3)}


def test_the_relaxed_strategy_adds_the_relaxations_plan_of_each_best_layout():
    from dataclasses import replace

    from sim.core.errors import SpecError
    from sim.search.refine import MAX_LAYOUTS, REFINE_WINDOW
    from sim.search.relaxed.relaxation import relax

    # A cluster where the relaxation lands outside the listed space (on PROBLEMS' two its plans are listed ones).
    problem = SearchProblem("gpt:layers=6,hidden=1024,heads=8,seq=512,vocab=8000", "2xT4+2xA100", 16, space=SPACE)
    topology = Topology.parse(problem.topology)
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    screener = Screener(problem, topology)
    bounds = screen_all(screener, candidates)
    added, _ = refine(screener, candidates, bounds, method="relaxation")
    # The oracle: the best listed bound of each pipeline layout, the layouts within the window, the relaxation of each.
    best: dict = {}
    for candidate, bound in sorted(zip(candidates, bounds), key=lambda item: (item[1].time_s, item[0])):
        if bound.fits and candidate.pp > 1:
            best.setdefault(replace(candidate, partition="balanced", devices=()), bound.time_s)
    lowest = min(best.values())
    layouts = sorted(best, key=lambda key: (best[key], key))[:MAX_LAYOUTS]
    expected = {relax(problem, key).candidate for key in layouts if best[key] <= lowest * (1 + REFINE_WINDOW)}
    listed = set(candidates)

    def spelled_out(c):  # the relaxation's counts equal to the listed balanced plan's: that plan, already listed
        twin = replace(c, partition="balanced")
        return twin in listed and ",".join(map(str, screener.shape(twin)[0])) == c.partition

    assert added and set(added) == {c for c in expected
                                    if c not in listed and screener.bound(c).fits and not spelled_out(c)}
    relaxed, listed = run_search(problem, strategy="relaxed"), run_search(problem)
    assert relaxed.strategy == "relaxed" and relaxed.screen.refined == len(added)
    assert relaxed.best.iteration_time_s <= listed.best.iteration_time_s * (1 + relaxed.screen.gap)
    with pytest.raises(SpecError, match="method"):
        refine(screener, candidates, bounds, method="anneal")
