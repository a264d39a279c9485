"""``experiments.relaxed_search``: brute force against the simulator one plan at a time, the ``--quick`` outcomes and
files and their relations (brute force is never beaten where it ran), and bad input."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import replace

import pytest

from experiments import relaxed_search
from experiments.relaxed_search import METHODS, Problem, brute_force, suite
from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.search.evaluate import evaluate
from sim.search.space import Candidate


def test_brute_force_is_the_fastest_of_every_partition_and_placement_by_the_engine():
    # 2 V100 + 2 A100, DP 2 x PP 2, an 8-layer GPT: 7 partitions x 2 placements of the two servers, each simulated
    problem = Problem("tiny", "2xV100+2xA100", "gpt:layers=6,hidden=1024,heads=16,seq=1024", 8, 8,
                      Candidate(tp=1, dp=2, pp=2, microbatch_size=2, schedule="1f1b"))
    outcome = brute_force(problem, 14)
    assert outcome.simulations == 14
    every = [evaluate(problem.search_problem(), replace(problem.layout, partition=f"{c},{8 - c}", devices=devices))
             for c in range(1, 8) for devices in ((), (2, 3, 0, 1))]
    assert outcome.evaluation == min(every, key=lambda e: (e.iteration_time_s, e.candidate))
    skipped = brute_force(problem, 13)
    assert skipped.evaluation is None and skipped.simulations == 14  # counted, not listed


def test_the_suite_is_seeded_and_keeps_to_its_ranges():
    problems = suite(16, 0)
    assert problems == suite(16, 0) and problems != suite(16, 1)
    for i, p in enumerate(problems):
        devices = Topology.parse(p.topology).num_ranks
        kinds = {d.name for d in Topology.parse(p.topology).devices}
        assert len(kinds) == 1 + i % 2  # alternately one device model and two
        assert 4 <= devices <= 16 and 8 <= p.layers <= 48
        k = p.layout
        assert k.tp * k.dp * k.pp == devices and 2 <= k.pp <= p.layers
        assert p.global_batch % (k.microbatch_size * k.dp) == 0


@pytest.fixture(scope="module")
def quick() -> relaxed_search.Result:
    return relaxed_search.run(quick=True)


def test_quick_brute_force_is_never_beaten_and_the_file_holds_every_outcome(quick, tmp_path):
    assert [p.name for p, _ in quick.done] == [p.name for p in suite(2, 0, quick=True)]
    for _, outcomes in quick.done:
        assert [o.method for o in outcomes] == list(METHODS)
        times = {o.method: o.evaluation.iteration_time_s for o in outcomes}
        # brute force lists every partition in every placement, so it holds every other method's plan
        assert times["brute force"] == min(times.values())
    files = relaxed_search.write(quick, tmp_path)
    assert files == [tmp_path / "relaxed_search.csv", tmp_path / "relaxed_search.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(files[0].open()))
    by_problem = defaultdict(dict)
    for row in rows:
        by_problem[row["problem"]][row["method"]] = row
    for problem, outcomes in quick.done:
        methods = by_problem[problem.name]
        assert list(methods) == list(METHODS)
        best = min(o.evaluation.iteration_time_s for o in outcomes)
        for o in outcomes:
            r = methods[o.method]
            assert float(r["relative_to_best"]) == pytest.approx(o.evaluation.iteration_time_s / best, rel=1e-12)
            assert sum(map(int, r["layer_counts"].split(","))) == int(r["layers"]) == problem.layers


@pytest.mark.parametrize(("options", "message"), [
    ({"problems": 0}, "--problems must be from 1 to 100, got 0"),
    ({"seed": -1}, "--seed must be >= 0, got -1"),
    ({"brute_limit": -5}, "--brute-limit must be >= 0, got -5"),
])
def test_bad_input_is_refused_naming_the_flag(options, message):
    with pytest.raises(SpecError, match=message):
        relaxed_search.run(**options)
