"""``experiments.run search_strategies``: the quick run's file agrees with the search it reports (each best is the
simulator's time of a plan, brute force costs its whole list, a strategy confined to the list never beats brute
force), and bad input is one error line."""

from __future__ import annotations

import csv

import pytest

from experiments.run import main as run_main
from experiments.search_strategies import STRATEGIES, suite
from sim.search.search import run_search
from tests.experiments.refusal import refused


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("search_strategies")
    assert run_main(["search_strategies", "--quick", "--out", str(out), "--workers", "1"]) == 0
    with open(out / "search_strategies.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_every_problem_has_every_strategy_and_brute_force_costs_its_whole_list(quick):
    problems = suite(2, 0, quick=True)
    assert len(quick) == len(problems) * len(STRATEGIES)
    for index, problem in enumerate(problems):
        rows = quick[index * len(STRATEGIES):(index + 1) * len(STRATEGIES)]
        assert [row["strategy"] for row in rows] == list(STRATEGIES)
        assert all(row["topology"] == problem.topology for row in rows)
        brute = rows[0]
        assert int(brute["costed"]) == int(brute["space"])
        best = {row["strategy"]: float(row["best_s"]) for row in rows}
        # The planner and alpa cost plans of brute force's list: they cannot beat it. dp and anneal may (they cost
        # the program's placements and partitions too) but their times are simulated ones, checked below.
        assert best["planner"] >= best["exhaustive"] and best["alpa"] >= best["exhaustive"]
        # screen and relaxed prove their pick within their stated gap (1 %) of every listed plan.
        assert best["screen"] <= best["exhaustive"] * 1.01 and best["relaxed"] <= best["exhaustive"] * 1.01
        assert float(rows[0]["relative_to_exhaustive"]) == 0.0


def test_the_reported_best_is_the_search_s_own(quick):
    problem = suite(2, 0, quick=True)[1]
    (row,) = [r for r in quick if r["topology"] == problem.topology and r["strategy"] == "dp"]
    assert float(row["best_s"]) == run_search(problem, strategy="dp").best.iteration_time_s


@pytest.mark.parametrize("args, needle", [(["--problems", "0"], "--problems"), (["--seed", "-1"], "--seed"),
                                          (["--workers", "0"], "--workers")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["search_strategies", "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o" / "search_strategies.csv").exists()
