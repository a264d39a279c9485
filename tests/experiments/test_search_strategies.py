"""``experiments.search_strategies``: the quick run agrees with the search it reports (each best is the simulator's
time of a plan, brute force costs its whole list, a strategy confined to the list never beats brute force), its file
holds every row, and bad input is refused."""

from __future__ import annotations

import csv

import pytest

from experiments import search_strategies
from experiments.search_strategies import STRATEGIES, suite
from sim.core.errors import SpecError
from sim.search.search import run_search


@pytest.fixture(scope="module")
def quick() -> search_strategies.Result:
    return search_strategies.run(quick=True, workers=1)


def test_every_problem_has_every_strategy_and_brute_force_costs_its_whole_list(quick):
    problems = suite(2, 0, quick=True)
    assert len(quick.problems) == len(problems)
    for problem, rows in zip(problems, quick.problems):
        assert [row.strategy for row in rows] == list(STRATEGIES)
        assert all(row.problem == problem for row in rows)
        brute = rows[0]
        assert brute.costed == brute.space
        best = {row.strategy: row.best_s for row in rows}
        # The planner and alpa cost plans of brute force's list: they cannot beat it. dp and anneal may (they cost
        # the program's placements and partitions too) but their times are simulated ones, checked below.
        assert best["planner"] >= best["exhaustive"] and best["alpa"] >= best["exhaustive"]
        # screen and relaxed prove their pick within their stated gap (1 %) of every listed plan.
        assert best["screen"] <= best["exhaustive"] * 1.01 and best["relaxed"] <= best["exhaustive"] * 1.01


def test_the_reported_best_is_the_search_s_own(quick):
    problem = suite(2, 0, quick=True)[1]
    (row,) = [r for r in quick.problems[1] if r.strategy == "dp"]
    assert row.problem == problem and row.best_s == run_search(problem, strategy="dp").best.iteration_time_s


def test_the_file_holds_every_row_relative_to_brute_force(quick, tmp_path):
    assert search_strategies.write(quick, tmp_path) == [tmp_path / "search_strategies.csv"]
    with open(tmp_path / "search_strategies.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    rows = [row for problem in quick.problems for row in problem]
    assert [(r["topology"], r["strategy"], float(r["best_s"])) for r in written] == [
        (row.problem.topology, row.strategy, row.best_s) for row in rows]
    assert {float(r["relative_to_exhaustive"]) for r in written if r["strategy"] == "exhaustive"} == {0.0}


@pytest.mark.parametrize("options, needle", [({"problems": 0}, "--problems"), ({"seed": -1}, "--seed"),
                                             ({"workers": 0}, "--workers")])
def test_bad_input_is_refused_naming_the_flag(options, needle):
    with pytest.raises(SpecError, match=needle):
        search_strategies.run(**options)
