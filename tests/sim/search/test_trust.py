"""A search row's regime and interval (sim.search.trust) are the ones sim.run's prediction of the same plan carries."""

import pytest

from sim.hw.topology import Topology
from sim.plan.build import build_plan
from sim.predict import predict_built
from sim.report.interval import Regime, Residual
from sim.search.space import Candidate, SearchProblem
from sim.search.trust import Trust

MODEL = "gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000"


@pytest.mark.parametrize("topology, candidate", [
    ("4xA100", Candidate(2, 2, 1, 2, "1f1b", sequence_parallel=True, zero=1)),
    ("4xA100", Candidate(1, 1, 4, 1, "interleaved", 2, "selective", precision="fp16")),
    ("8xH100", Candidate(1, 8, 1, 1, "1f1b", zero=3, precision="bf16")),
])
def test_a_candidates_regime_is_its_plans(topology, candidate):
    problem = SearchProblem(MODEL, topology, 8)
    metrics = predict_built(build_plan(candidate.plan_inputs(problem)), check_memory=False).metrics
    trust = Trust(problem, Topology.parse(topology), residuals=())
    assert trust.regime(candidate) == Regime(**metrics["regime"])


def test_a_candidates_calibration_is_its_regimes_and_is_memoised():
    problem = SearchProblem(MODEL, "4xA100", 8)
    candidate = Candidate(2, 2, 1, 2, "1f1b")
    regime = Trust(problem, Topology.parse("4xA100"), residuals=()).regime(candidate)
    residuals = [Residual("d", f"r{i}", regime, 0.01 * i) for i in range(19)]
    trust = Trust(problem, Topology.parse("4xA100"), residuals=residuals)
    found = trust.calibration(candidate)
    assert found.validated and (found.low, found.high) == (0.0, 0.18)
    assert trust.calibration(candidate) is found
    other = trust.calibration(Candidate(1, 4, 1, 2, "1f1b"))  # dp only: its dims are not validated
    assert not other.validated and "dims" in other.relaxed
