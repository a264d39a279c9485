"""sim.search.search: the ranking against a brute-force loop over ``evaluate`` on the same list, determinism by seed,
and the problem's checks."""

import pytest

import sim.search.driver as driver
from sim.core.errors import SpecError
from sim.search.evaluate import evaluate
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates

MODEL = "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1000"
SPACE = SearchSpace(schedules=("gpipe", "1f1b", "interleaved"), recompute=("none", "full"), chunks=(2,),
                    microbatch_sizes=(1, 2), sequence_parallel=(False,))


def problem(**kw) -> SearchProblem:
    return SearchProblem(**{"model": MODEL, "topology": "4xA100", "global_batch": 8, "space": SPACE, **kw})


@pytest.fixture(scope="module")
def brute():
    """Every candidate of the space costed one by one, under a memory limit that leaves some out: the oracle."""
    free = [evaluate(problem(), c) for c in enumerate_candidates(problem(), 4)]
    peaks = sorted(e.max_peak_memory_bytes for e in free if e.iteration_time_s is not None)
    limit = peaks[len(peaks) // 2]  # the median peak: about half the simulated plans fit
    p = problem(memory_limit_bytes=limit)
    candidates = enumerate_candidates(p, 4)
    return p, candidates, [evaluate(p, c) for c in candidates]


def test_the_best_is_the_brute_force_minimum_and_the_ranking_is_sorted(brute):
    p, candidates, evaluations = brute
    result = run_search(p)
    assert result.evaluations == tuple(evaluations)  # every candidate, in the space's order
    assert result.space_size == len(candidates) and result.coverage == 1.0 and not result.stopped_by_budget
    # A plain loop for the minimum (ties to the earlier candidate in the space's order, which is sorted).
    best = None
    for e in evaluations:
        if e.feasible and (best is None or e.iteration_time_s < best.iteration_time_s):
            best = e
    assert best is not None and result.best == best
    feasible = [e for e in evaluations if e.feasible]
    assert 0 < len(feasible) < len(evaluations)  # the limit and the rules leave some out, not all
    assert sorted(result.ranked, key=lambda e: e.candidate) == sorted(feasible, key=lambda e: e.candidate)
    times = [e.iteration_time_s for e in result.ranked]
    assert times == sorted(times)
    assert all(e.feasible for e in result.ranked) and result.ranked[0] == result.best


def test_the_same_seed_gives_the_same_result(monkeypatch, brute):
    p, candidates, evaluations = brute
    # A whole search costs every candidate whatever its seed: the same evaluations as the brute force.
    whole = run_search(p, seed=5)
    assert whole.evaluations == tuple(evaluations) and whole.seed == 5

    class Clock:  # each reading a second later: the budget ends after a fixed number of chunks
        now = 0.0

        def monotonic(self):
            self.now += 1.0
            return self.now

    def budgeted(seed):
        monkeypatch.setattr(driver, "time", Clock())
        return run_search(p, time_budget_s=3.5, seed=seed)

    a, b = budgeted(1), budgeted(1)
    assert a.stopped_by_budget and a.evaluations == b.evaluations and a.best == b.best
    assert a.coverage == len(a.evaluations) / len(candidates) < 1
    assert set(a.evaluations) <= set(evaluations)
    # The best of a partial search is the best of what it costed.
    costed = [e for e in a.evaluations if e.feasible]
    assert a.best == (min(costed, key=lambda e: (e.iteration_time_s, e.candidate)) if costed else None)
    assert {tuple(budgeted(seed).evaluations) for seed in (2, 3)} != {a.evaluations}  # other seeds, others


def test_the_space_size_is_announced_before_anything_is_costed():
    p = problem(space=SearchSpace(schedules=("1f1b",), recompute=("none",), microbatch_sizes=(1, 2)))
    candidates = enumerate_candidates(p, 4)
    calls = []
    run_search(p, on_space=lambda n: calls.append(("space", n)), progress=lambda e: calls.append(("eval", e)))
    assert calls[0] == ("space", len(candidates)) and len(calls) == 1 + len(candidates)
    assert all(kind == "eval" for kind, _ in calls[1:])


def test_no_feasible_plan_gives_no_best():
    result = run_search(problem(memory_limit_bytes=1, space=SearchSpace(schedules=("1f1b",), recompute=("none",))))
    assert result.evaluations and result.ranked == () and result.best is None
    assert all("out of memory" in e.reason or e.iteration_time_s is None for e in result.evaluations)


@pytest.mark.parametrize("change,needle", [
    (dict(global_batch=0), "global_batch must be an integer >= 1, got 0"),
    (dict(global_batch=True), "got True"),
    (dict(memory_limit_bytes=0), "memory_limit_bytes must be > 0 bytes, got 0"),
    (dict(topology="3xNOPE"), "NOPE"),
    (dict(model="gpt:layers=x"), "layers"),
])
def test_a_bad_problem_is_one_error(change, needle):
    with pytest.raises(SpecError) as info:
        run_search(problem(**change))
    assert needle in str(info.value)


def test_an_unknown_strategy_is_refused():
    with pytest.raises(SpecError, match="^strategy must be one of .*, got 'genetic'"):
        run_search(problem(), strategy="genetic")


def test_auto_simulates_a_small_space_whole_and_says_why():
    from sim.search.search import AUTO_OP_S, AUTO_PLAN_S

    p = problem()
    candidates = enumerate_candidates(p, 4)
    # The estimate in closed form: a plan's build plus each compute op of one replica (F and B per stage and
    # microbatch), here far under the threshold.
    ops = sum(2 * c.pp * (c.chunks if c.schedule == "interleaved" else 1) * (8 // (c.dp * c.microbatch_size))
              for c in candidates)
    estimate = AUTO_PLAN_S * len(candidates) + AUTO_OP_S * ops
    result = run_search(p)
    assert result.strategy == "exhaustive" and result.screen is None
    assert result.chosen_by_auto == (f"simulating all {len(candidates):,} plans takes about {estimate:.0f} s, at "
                                     f"most 10 s")
    assert result.evaluations == run_search(p, strategy="exhaustive").evaluations
    assert run_search(p, strategy="exhaustive").chosen_by_auto == ""


def test_auto_screens_a_space_too_large_to_simulate_in_seconds():
    from sim.search.search import auto_strategy

    p = SearchProblem("gpt:layers=24,hidden=2048,heads=16,seq=1024", "8xA100", 64)
    candidates = enumerate_candidates(p, 8)
    name, why = auto_strategy(p, candidates)
    assert name == "screen" and why.startswith(f"simulating all {len(candidates):,} plans would take about")
    # More workers share the estimate: enough of them bring it under the threshold.
    assert auto_strategy(p, candidates, workers=64)[0] == "exhaustive"


def test_a_request_to_stop_ends_the_search_with_what_it_has():
    from sim.search import stopping

    stopping.request_stop()
    try:
        result = run_search(problem(), strategy="screen")
    finally:
        stopping.clear()
    assert result.interrupted and result.stopped_by_budget and result.best is None
    assert not run_search(problem(), strategy="screen").interrupted


def test_a_search_result_prints_in_one_line():
    result = run_search(problem())
    text = repr(result)
    assert len(text) < 400 and "\n" not in text and f"{len(result.evaluations):,} of {result.space_size:,}" in text
    assert result.best.candidate.label() in text
