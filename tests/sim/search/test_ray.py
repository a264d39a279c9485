"""Evaluating on Ray (``--ray``): a local Ray instance gives the same search as the local pool, its helpers return
results in order, and a missing Ray is one clear error. One local Ray instance (~8 s to start and stop) serves the
module's tests: a session opened inside an open one joins it, as a search's stages do."""

import sys
from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.search.driver import _evaluate_chunk
from sim.search.ray_pool import ray_chunks, ray_map, ray_session
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace

PROBLEM = SearchProblem("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000", "4xA100", 8,
                        space=SearchSpace(schedules=("1f1b", "gpipe"), recompute=("none",), zero=(0,)))


@pytest.fixture(scope="module")
def ray():
    with ray_session("local") as module:
        yield module


def test_a_search_on_ray_equals_the_local_one(ray):
    local = run_search(PROBLEM, seed=3)
    screened = run_search(PROBLEM, strategy="screen")
    on_ray = run_search(PROBLEM, seed=3, ray_address="local")  # each joins the module's session
    screened_on_ray = run_search(PROBLEM, strategy="screen", ray_address="local")
    assert on_ray.evaluations == local.evaluations and on_ray.best == local.best
    assert screened_on_ray.evaluations == screened.evaluations
    assert replace(screened_on_ray.screen, screen_s=0) == replace(screened.screen, screen_s=0)


def test_the_helpers_keep_the_order_and_a_budget_cancels_the_rest(ray):
    from sim.search.space import enumerate_candidates

    candidates = enumerate_candidates(PROBLEM, 4)
    chunks = [[(i, c)] for i, c in enumerate(candidates[:6])]
    with ray_session("local") as joined:
        assert joined is ray and joined.is_initialized()
        assert ray_map(ray, lambda base, power: base**power, [(2, 3), (3, 2), (5, 0)]) == [8, 9, 1]
        taken: list = []
        assert ray_chunks(ray, _evaluate_chunk, PROBLEM, chunks, taken.extend, lambda: False) is False
        assert sorted(index for index, _ in taken) == list(range(6))
        stopped: list = []
        assert ray_chunks(ray, _evaluate_chunk, PROBLEM, chunks * 20, stopped.extend, lambda: True) is True
        assert len(stopped) < 120  # the budget ended it before every chunk was costed


def test_without_ray_installed_the_flag_is_one_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray now fails as if it were not installed
    with pytest.raises(SpecError, match=r"ray needs Ray, an optional extra"):
        run_search(PROBLEM, ray_address="local")
