"""The screen strategy (``sim.search --strategy screen``) against brute force: on a seeded suite of small problems
(a mixed cluster, with and without a memory limit) it picks the brute-force best (or, with the partitions and
placements its refinement adds, a better one), simulates a fraction of the
space, refuses no plan that fits, and the gap it states is true: no plan it did not simulate is faster than the pick
by more than that."""

import json
import math
import random

import pytest

from sim.search.cli import main as search_main
from sim.search.evaluate import evaluate
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace


def suite(count: int, seed: int) -> list[SearchProblem]:
    rng = random.Random(seed)
    topologies = ["4xA100", "8xA100", "2x4xA100", "2xV100+2xA100", "4xV100+4xA100"]
    return [SearchProblem(f"gpt:layers={rng.choice([4, 8, 12])},hidden={rng.choice([256, 1024])},heads=8,seq=256,"
                          f"vocab=4000", rng.choice(topologies), rng.choice([8, 16]),
                          memory_limit_bytes=rng.choice([None, 600_000_000]),
                          space=SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb1p"), chunks=(2,),
                                            recompute=("none", "full"), zero=(0, 1)))
            for _ in range(count)]


@pytest.mark.parametrize("problem", suite(3, seed=29)[1:], ids=lambda p: f"{p.topology}-{p.model.split(',')[0]}")
def test_the_screen_picks_the_brute_force_best_and_its_gap_is_true(problem):
    brute = run_search(problem)
    screened = run_search(problem, strategy="screen")
    truth = {e.candidate: e for e in brute.evaluations}
    summary = screened.screen
    assert summary is not None and summary.screened == brute.space_size
    # Every number it reports is the engine's (for the refined plans outside the listed space, asked of the one
    # prediction path here); what the screen alone refused is infeasible for the engine too.
    for e in screened.evaluations:
        expected = truth[e.candidate] if e.candidate in truth else evaluate(problem, e.candidate)
        if e.iteration_time_s is not None:
            assert expected == e
        else:
            assert not expected.feasible, e
    # The refinement only adds plans: the listed best is found, or beaten by another partition or placement.
    assert screened.best.iteration_time_s <= brute.best.iteration_time_s
    simulated = {e.candidate for e in screened.evaluations if e.iteration_time_s is not None}
    assert len(simulated) == summary.simulated < brute.space_size / 2
    best = screened.best.iteration_time_s
    assert 0 <= summary.gap <= 0.01
    for e in brute.ranked:  # the proof: nothing left unsimulated beats the pick by more than the stated gap
        if e.candidate not in simulated:
            assert e.iteration_time_s >= best * (1 - summary.gap) * (1 - 1e-12), e


def test_a_time_budget_that_ends_the_screen_proves_nothing():
    problem = suite(1, seed=3)[0]
    result = run_search(problem, strategy="screen", time_budget_s=1e-9)
    assert result.stopped_by_budget and result.screen.screened < result.space_size
    assert math.isinf(result.screen.gap)


def test_the_command_states_the_proof_and_writes_it(tmp_path, capsys):
    code = search_main(["--topology", "4xA100", "--model", "gpt:layers=4,hidden=256,heads=8,seq=256,vocab=4000",
                        "--global-batch", "8", "--strategy", "screen", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "screen: " in out and "plans bounded" in out, out
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["strategy"] == "screen" and record["screen"]["screened"] == record["space_size"]
    assert "screen_s" not in record["screen"]  # no wall-clock time in search.json


def test_the_screen_spread_over_workers_gives_the_same_bounds():
    from sim.hw.topology import Topology
    from sim.search.screen import Screener, screen_all, screen_in_parallel
    from sim.search.space import enumerate_candidates

    problem = suite(1, seed=29)[0]
    topology = Topology.parse(problem.topology)
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    alone = screen_all(Screener(problem, topology), candidates)
    assert screen_in_parallel(Screener(problem, topology), candidates, workers=2) == alone


def _screened(problem):
    from sim.hw.topology import Topology
    from sim.search.screen import Screener, screen_all

    topology = Topology.parse(problem.topology)
    from sim.search.space import enumerate_candidates
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    screener = Screener(problem, topology)
    return screener, candidates, screen_all(screener, candidates)


def test_past_its_deadline_the_proof_still_simulates_the_best_bounds_until_one_fits():
    import time

    from sim.search import stopping
    from sim.search.screen import prove

    problem = suite(1, seed=3)[0]
    screener, candidates, bounds = _screened(problem)
    done, _, stopped = prove(screener, candidates, bounds, deadline=time.time() - 0.01, grace_s=60.0)
    simulated = [e for e in done if e.iteration_time_s is not None]
    # One at a time in the order of the bounds, the last the first that fits: a budget the screen used up still
    # answers with a plan.
    assert stopped and simulated and simulated[-1].feasible and not any(e.feasible for e in simulated[:-1])
    lowest = min(b.time_s for b in bounds if b is not None and b.fits)
    first = next(c for c, b in zip(candidates, bounds) if b is not None and b.fits and b.time_s == lowest)
    assert done[0].candidate == first
    # Without the grace, or after Ctrl-C, nothing is simulated past the deadline.
    assert prove(screener, candidates, bounds, deadline=time.time() - 0.01)[0] == []
    stopping.request_stop()
    try:
        assert prove(screener, candidates, bounds, grace_s=60.0)[0] == []
    finally:
        stopping.clear()


def test_the_chart_gets_every_bound_the_engine_did_not_simulate():
    from sim.search.refine import refine

    problem = suite(1, seed=3)[0]
    result = run_search(problem, strategy="screen")
    screener, candidates, bounds = _screened(problem)
    refined, refined_bounds = refine(screener, candidates, bounds)
    reached = {e.candidate for e in result.evaluations}
    expected = sorted((b.peak_bytes, b.time_s) for c, b in zip([*candidates, *refined], [*bounds, *refined_bounds])
                      if b.fits and c not in reached)
    assert sorted(result.bounded) == expected and expected
    assert all(peak > 0 and 0 < time_s < math.inf for peak, time_s in result.bounded)


def test_the_screen_bounds_a_skewed_routing_with_the_costs_its_built_plan_has():
    """A mixture searched under a skewed routing: the screen's bound of each candidate is the bound of the cost views
    of the plan ``build_plan`` makes of it (one assembly, routing included), and is above the balanced routing's
    (the slowest expert-parallel rank receives more tokens). The screen once built every shard balanced."""
    from dataclasses import replace

    from sim.hw.topology import Topology
    from sim.plan.build import build_plan
    from sim.schedules import SCHEDULES
    from sim.search.bound import stage_times, time_lower_bound
    from sim.search.screen import Screener
    from sim.search.space import enumerate_candidates

    model = ("moe:layers=4,experts=8,hidden=512,expert_ffn=512,ffn=1024,heads=8,kv_heads=2,head_dim=64,seq=256,"
             "topk=2,vocab=4000")
    skewed = SearchProblem(model, "4xA100", 8, space=SearchSpace(schedules=("1f1b", "zb1p"), ep=(2,), zero=(0,)),
                           routing="skew:1.5")
    topology = Topology.parse(skewed.topology)
    screener, balanced = Screener(skewed, topology), Screener(replace(skewed, routing="balanced"), topology)
    checked = 0
    for candidate in enumerate_candidates(skewed, topology.num_ranks, topology):
        bound = screener.bound(candidate)
        if not bound.fits:
            continue
        built = build_plan(candidate.plan_inputs(skewed))
        plan, entry = built.plan, SCHEDULES[candidate.schedule]
        expected = max(time_lower_bound(plan.schedule, plan.num_microbatches, plan.placement.vstage_to_rank,
                                        stage_times(view, split_backward=entry.split_backward,
                                                    recompute_full=candidate.recompute == "full"))
                       for view in built.views())
        assert bound.time_s == expected, candidate
        assert bound.time_s > balanced.bound(candidate).time_s, candidate
        checked += 1
    assert checked >= 2


def test_a_stop_is_heard_between_two_memory_verdicts(monkeypatch):
    # The best bounds are often plans whose exact peaks do not fit, each verdict up to a tenth of a second: a Ctrl-C
    # pressed while the proof looks for plans to simulate ends it at the next verdict, not a round later.
    from sim.search import stopping
    from sim.search.screen import Screener, prove

    problem = suite(1, seed=3)[0]
    screener, candidates, bounds = _screened(problem)
    looked: list = []

    def verdict_then_stop(self, candidate):
        looked.append(candidate)
        if len(looked) == 2:
            stopping.request_stop()
        return "out of memory (a stand-in verdict)"

    monkeypatch.setattr(Screener, "memory_verdict", verdict_then_stop)
    try:
        done, _, stopped = prove(screener, candidates, bounds)
    finally:
        stopping.clear()
    assert stopped and len(looked) == 2 and [e.candidate for e in done] == looked
