"""``experiments.run relaxed_search``: brute force against the simulator one plan at a time, the ``--quick`` files
and their relations (brute force is never beaten where it ran), and bad input."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import replace

import pytest

from experiments.relaxed_search import METHODS, Problem, brute_force, suite
from experiments.run import main as run_main
from sim.hw.topology import Topology
from sim.search.evaluate import evaluate
from sim.search.space import Candidate
from tests.experiments.refusal import refused


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
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick") / "out"
    return run_main(["relaxed_search", "--quick", "--out", str(out)]), out


def test_quick_writes_its_files_and_brute_force_is_never_beaten(quick):
    status, out = quick
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == ["relaxed_search.csv", "relaxed_search.png"]
    assert (out / "relaxed_search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((out / "relaxed_search.csv").open()))
    by_problem = defaultdict(dict)
    for row in rows:
        by_problem[row["problem"]][row["method"]] = row
    assert list(by_problem) == [p.name for p in suite(2, 0, quick=True)]
    for methods in by_problem.values():
        assert list(methods) == list(METHODS)
        times = {m: float(r["iteration_time_s"]) for m, r in methods.items()}
        best = min(times.values())
        for m, r in methods.items():
            assert float(r["relative_to_best"]) == pytest.approx(times[m] / best, rel=1e-12)
            assert sum(map(int, r["layer_counts"].split(","))) == int(r["layers"])
        # brute force lists every partition in every placement, so it holds every other method's plan
        assert times["brute force"] == best


@pytest.mark.parametrize(("argv", "message"), [
    (["--problems", "0"], "error: --problems must be from 1 to 100, got 0\n"),
    (["--seed", "-1"], "error: --seed must be >= 0, got -1\n"),
    (["--brute-limit", "-5"], "error: --brute-limit must be >= 0, got -5\n"),
    (["--problems", "two"], "invalid int value: 'two'"),
    (["--quick", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_error_line_and_status_2(tmp_path, capsys, argv, message):
    assert message in refused(capsys, ["relaxed_search", "--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()
