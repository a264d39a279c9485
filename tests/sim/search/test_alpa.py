"""The Alpa-assumption baseline: which candidates honour it, and that its search is the exhaustive search restricted
to them (so it can never beat the exhaustive best)."""

import pytest

from sim.hw.topology import Topology
from sim.search.alpa import honours_alpa_assumption
from sim.search.search import run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace

TOPOLOGY = Topology.parse("2x4xA100")  # two servers of four


@pytest.mark.parametrize("tp, dp, pp, order, devices, expected", [
    (4, 1, 2, "tp-dp-pp", (), True),     # a stage per server
    (2, 2, 2, "tp-dp-pp", (), True),
    (1, 1, 8, "tp-dp-pp", (), True),     # four stages per server, still each inside one
    (8, 1, 1, "tp-dp-pp", (), False),    # tensor parallelism across the servers
    (1, 8, 1, "tp-dp-pp", (), False),    # data parallelism across the servers
    (2, 2, 2, "pp-dp-tp", (), False),    # the pipeline innermost
    (4, 1, 2, "tp-dp-pp", (4, 5, 6, 7, 0, 1, 2, 3), False),  # a placement of its own
])
def test_which_candidates_honour_the_assumption(tp, dp, pp, order, devices, expected):
    candidate = Candidate(tp, dp, pp, 1, "1f1b", rank_order=order, devices=devices)
    assert honours_alpa_assumption(candidate, TOPOLOGY) is expected


def test_the_alpa_search_is_the_exhaustive_one_restricted_to_its_candidates():
    problem = SearchProblem("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000", "2x4xA100", 8,
                            space=SearchSpace(schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,),
                                              zero=(0,), rank_orders=("tp-dp-pp", "dp-tp-pp")))
    everything = run_search(problem)
    alpa = run_search(problem, strategy="alpa")
    kept = [e for e in everything.evaluations if honours_alpa_assumption(e.candidate, TOPOLOGY)]
    assert 0 < len(kept) < len(everything.evaluations)
    assert alpa.evaluations == tuple(kept)
    assert alpa.best.iteration_time_s >= everything.best.iteration_time_s
