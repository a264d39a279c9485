"""sim.search.driver: the evaluations do not depend on the number of workers and come in the list's order; a time
budget stops early on a seeded sample, whole in the list's order; bad workers or budget are refused. Pool tests are
few: each starts spawned processes (about a second)."""

import math

import pytest

import sim.search.driver as driver
from sim.core.errors import SpecError
from sim.search.driver import CHUNK, evaluate_all
from sim.search.evaluate import evaluate
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates

PROBLEM = SearchProblem(model="gpt:layers=4,hidden=64,heads=2,seq=32,vocab=100", topology="4xA100", global_batch=8,
                        space=SearchSpace(schedules=("1f1b", "interleaved"), recompute=("none",), zero=(0,),
                                          sequence_parallel=(False,), chunks=(2,)))


@pytest.fixture(scope="module")
def listed():
    """The space's candidates and each one's evaluation in this process, the oracle of every test here."""
    candidates = enumerate_candidates(PROBLEM, 4)
    assert 20 <= len(candidates) <= 60, len(candidates)  # several chunks, a fraction of a second to cost
    return candidates, tuple(evaluate(PROBLEM, c) for c in candidates)


def test_one_worker_costs_every_candidate_in_the_lists_order(listed):
    candidates, oracle = listed
    seen = []
    done = evaluate_all(PROBLEM, candidates, workers=1, progress=seen.append)
    assert done.evaluations == oracle
    assert done.listed == len(candidates) and not done.stopped_by_budget and done.elapsed_s > 0
    # The progress callback saw each evaluation once, in the seeded order rather than the list's.
    assert sorted(seen, key=lambda e: e.candidate) == list(oracle)
    assert [e.candidate for e in seen] != candidates
    # Infeasible ones are kept, not dropped.
    assert any(not e.feasible for e in done.evaluations)


def test_two_workers_give_the_same_evaluations_as_one(listed):
    candidates, oracle = listed
    seen = []
    done = evaluate_all(PROBLEM, candidates, workers=2, seed=3, progress=seen.append)
    assert done.evaluations == oracle
    assert not done.stopped_by_budget and len(seen) == len(candidates)


class _Clock:
    """A fake monotonic clock: each reading is one second after the last, so the budget decides by how many times
    it was read, not by the machine's speed."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


def _budgeted(monkeypatch, candidates, seed, budget):
    monkeypatch.setattr(driver, "time", _Clock())
    return evaluate_all(PROBLEM, candidates, time_budget_s=budget, seed=seed)


def test_a_time_budget_stops_early_on_a_seeded_sample_in_the_lists_order(monkeypatch, listed):
    candidates, oracle = listed
    # Clock readings: the start at 1, then one before each candidate (2, 3, 4, ...: in one process the clock is
    # read before every evaluation, so a stop is heard within one). A budget of 2.5 s lets the candidates read at 2
    # and 3 run (1 and 2 s elapsed) and stops at the third (3 s): two candidates.
    done = _budgeted(monkeypatch, candidates, 0, 2.5)
    assert done.stopped_by_budget and done.listed == len(candidates)
    assert len(done.evaluations) == 2
    index = {c: i for i, c in enumerate(candidates)}
    positions = [index[e.candidate] for e in done.evaluations]
    assert positions == sorted(positions)  # the list's order
    assert all(e == oracle[i] for e, i in zip(done.evaluations, positions))
    # The same seed costs the same sample; other seeds other samples, not the list's first corner.
    assert _budgeted(monkeypatch, candidates, 0, 2.5).evaluations == done.evaluations
    samples = {tuple(e.candidate for e in _budgeted(monkeypatch, candidates, seed, 2.5).evaluations)
               for seed in range(4)}
    assert len(samples) > 1
    assert any(list(sample) != candidates[:2] for sample in samples)


def test_a_budget_shorter_than_anything_costs_nothing(monkeypatch, listed):
    candidates, _ = listed
    done = _budgeted(monkeypatch, candidates, 0, 0.5)
    assert done.evaluations == () and done.stopped_by_budget


def test_a_budget_long_enough_is_not_reported_as_stopping(monkeypatch, listed):
    candidates, oracle = listed
    done = _budgeted(monkeypatch, candidates, 0, 10_000.0)
    assert done.evaluations == oracle and not done.stopped_by_budget


def test_a_budget_stops_a_pool_early(monkeypatch, listed):
    candidates, oracle = listed
    # On the fake clock the budget is over at the caller's first look (it looks every POLL_S while its workers
    # compute): the rest of the list is never handed out and the tasks still running are abandoned with their
    # workers, not waited for. What did come back is kept, each evaluation the one-process oracle's.
    monkeypatch.setattr(driver, "time", _Clock())
    done = evaluate_all(PROBLEM, candidates * 2, workers=2, time_budget_s=0.5)
    assert done.stopped_by_budget and done.listed == 2 * len(candidates)
    assert len(done.evaluations) <= 4 * CHUNK < 2 * len(candidates)
    assert all(e == oracle[candidates.index(e.candidate)] for e in done.evaluations)


def test_a_pool_is_stopped_by_its_budget_only_when_something_went_uncosted(monkeypatch, listed):
    candidates, oracle = listed
    # Two chunks on two workers and a budget over at the first look: whatever the timing, 'stopped' means that some
    # candidate went uncosted (it once read 'stopped' when the last chunks had all finished).
    monkeypatch.setattr(driver, "time", _Clock())
    done = evaluate_all(PROBLEM, candidates[: 2 * CHUNK], workers=2, time_budget_s=0.5)
    assert done.stopped_by_budget == (len(done.evaluations) < 2 * CHUNK)
    assert set(done.evaluations) <= set(oracle[: 2 * CHUNK])


def test_a_request_to_stop_ends_the_evaluations_like_a_spent_budget(listed):
    candidates, oracle = listed
    from sim.search import stopping

    stopping.request_stop()
    try:
        done = evaluate_all(PROBLEM, candidates, workers=1)
    finally:
        stopping.clear()
    assert done.evaluations == () and done.stopped_by_budget
    assert evaluate_all(PROBLEM, candidates[:CHUNK]).evaluations == oracle[:CHUNK]  # cleared: costs again


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, "2"])
def test_bad_workers_are_refused(workers):
    with pytest.raises(SpecError, match=f"workers must be an integer >= 1, got {workers!r}"):
        evaluate_all(PROBLEM, [], workers=workers)


@pytest.mark.parametrize("budget", [0, -1.0, math.nan])
def test_a_budget_not_above_zero_is_refused(budget):
    with pytest.raises(SpecError) as info:
        evaluate_all(PROBLEM, [], time_budget_s=budget)
    assert str(info.value) == f"time_budget_s must be > 0 seconds, got {budget!r}"


def test_an_empty_list_costs_nothing():
    done = evaluate_all(PROBLEM, [], workers=2)
    assert done.evaluations == () and done.listed == 0 and not done.stopped_by_budget


def test_a_pool_kept_across_calls_costs_each_list_as_one_process_does(listed, monkeypatch):
    candidates, oracle = listed
    from sim.search.driver import evaluation_pool

    # Nothing may be costed in this process (spawned workers import their own, unpatched, evaluate): even one plan
    # goes to the pool, so that a stop abandons it instead of waiting for it.
    monkeypatch.setattr(driver, "evaluate", lambda *args: pytest.fail("costed in the calling process"))
    with evaluation_pool(2) as pool:
        assert pool is not None
        first = evaluate_all(PROBLEM, candidates[:3], in_order=True, pool=pool)
        workers = pool.executor()._processes.copy()  # started by the first call
        single = evaluate_all(PROBLEM, candidates[3:4], in_order=True, pool=pool)  # one plan: still in the pool
        assert pool.executor()._processes == workers  # the same processes served the second call
    assert first.evaluations == oracle[:3] and single.evaluations == oracle[3:4]
    assert _all_ended(workers.values())  # stopped on leaving the block
    with evaluation_pool(1) as none:
        assert none is None  # one worker: this process


def _all_ended(processes, within_s: float = 5.0) -> bool:
    """Whether every process has ended, looking again for up to ``within_s`` seconds: the pool's own manager thread
    joins its workers too, and while it is reaping one the standard library's ``is_alive`` in another thread reads
    "alive" (its ``waitpid`` finds no child to wait for) until that thread has recorded the exit status."""
    import time

    deadline = time.monotonic() + within_s
    while any(process.is_alive() for process in processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
