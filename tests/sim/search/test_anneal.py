"""The anneal strategy against brute force (the exhaustive strategy over the same space): within 1 % of its best on
a seeded suite of small problems, homogeneous and mixed, while costing a fraction of the space; deterministic."""

import random
from dataclasses import astuple

import pytest

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.search.anneal import CHOICES, polish
from sim.search.evaluate import evaluate
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates


def suite(count: int, seed: int) -> list[SearchProblem]:
    """Seeded small problems: 4-8 devices (homogeneous, two servers, mixed), 4-12 layers."""
    rng = random.Random(seed)
    topologies = ["4xA100", "8xA100", "2x4xA100", "2xV100+2xA100", "4xV100+4xA100"]
    problems = []
    for _ in range(count):
        layers, hidden = rng.choice([4, 8, 12]), rng.choice([256, 512])
        problems.append(SearchProblem(f"gpt:layers={layers},hidden={hidden},heads=8,seq=256,vocab=4000",
                                      rng.choice(topologies), rng.choice([8, 16]),
                                      space=SearchSpace(schedules=("gpipe", "1f1b", "interleaved"), chunks=(2,),
                                                        recompute=("none", "full"), zero=(0,))))
    return problems


@pytest.mark.parametrize("problem", suite(4, seed=14), ids=lambda p: f"{p.topology}-{p.model.split(',')[0]}")
def test_within_one_percent_of_brute_force_on_a_fraction_of_the_space(problem):
    brute = run_search(problem)
    annealed = run_search(problem, strategy="anneal")
    assert annealed.best.iteration_time_s <= brute.best.iteration_time_s * 1.01
    assert len(annealed.evaluations) < brute.space_size  # it did not cost everything
    by_candidate = {e.candidate: e for e in brute.evaluations}
    # the same costs, by the same path (the dynamic program's plans the chains start from are not in the list)
    assert all(by_candidate[e.candidate] == e for e in annealed.evaluations if e.candidate in by_candidate)


def test_the_same_seed_gives_the_same_search_and_another_seed_may_not():
    problem = suite(1, seed=3)[0]
    first, again = run_search(problem, strategy="anneal", seed=5), run_search(problem, strategy="anneal", seed=5)
    assert first.evaluations == again.evaluations


def test_polish_reaches_a_point_no_single_move_improves():
    problem = suite(1, seed=8)[0]
    candidates = enumerate_candidates(problem, Topology.parse(problem.topology).num_ranks)
    start = next(i for i, c in enumerate(candidates) if evaluate(problem, c).feasible)
    seen = {start: evaluate(problem, candidates[start])}
    polish(problem, candidates, seen)
    best = min((i for i, e in seen.items() if e.feasible), key=lambda i: (seen[i].iteration_time_s, i))
    rows = [astuple(c) for c in candidates]
    checked = 0
    for fields in CHOICES.values():  # the neighbours along each choice, found here from the fields themselves
        for index, row in enumerate(rows):
            if index != best and all(row[k] == rows[best][k] for k in range(len(row)) if k not in fields):
                assert index in seen  # polish costed it
                checked += 1
                if seen[index].feasible:
                    assert seen[index].iteration_time_s >= seen[best].iteration_time_s
    assert checked > 5


@pytest.mark.parametrize("kwargs, message", [({"chains": 0}, "^chains must be an integer >= 1"),
                                             ({"evaluations": 0}, "^evaluations must be an integer >= 1")])
def test_bad_budgets_are_refused(kwargs, message):
    with pytest.raises(SpecError, match=message):
        run_search(suite(1, seed=1)[0], strategy="anneal", **kwargs)
