"""The one prediction path: the oracle a plan was built with gives the same prediction as a fresh one, and an oracle
for something else is refused rather than used."""

import pytest

from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built


def test_the_build_oracle_gives_the_prediction_a_fresh_oracle_gives():
    built = build_plan(PlanInputs("gpt:layers=4,hidden=256", "4xV100", "1f1b", microbatches=6, microbatch_size=2))
    fresh = predict(built.plan, topology=built.topology)
    reused = predict_built(built)
    assert reused.trace == fresh.trace and reused.metrics == fresh.metrics


def test_an_oracle_for_another_plan_is_refused():
    built = build_plan(PlanInputs("gpt:layers=4,hidden=256", "4xV100", "1f1b", microbatches=6, microbatch_size=2))
    other = build_plan(PlanInputs("gpt:layers=4,hidden=256", "4xV100", "1f1b", microbatches=6, microbatch_size=1))
    with pytest.raises(ValueError, match="not this plan's"):
        predict(built.plan, topology=built.topology, oracle=other.costs.oracle)
