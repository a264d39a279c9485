"""The shipped calibration (profiles/calibration/residuals.csv) is the current model's: torchtitan's 32 runs, predicted
now, leave the residuals it stores. A change to the models that moves a prediction fails here until
``python -m experiments.run coverage --write`` stores the residuals again."""

import math

import pytest

from experiments import coverage
from sim.report.interval import RESIDUALS, load_residuals


def test_the_shipped_torchtitan_residuals_are_the_current_predictions():
    shipped = {r.run: r for r in load_residuals(RESIDUALS) if r.dataset == "torchtitan"}
    current = coverage.gather(("torchtitan",))
    assert len(current) == len(shipped) == 32
    for residual in current:
        stored = shipped[residual.run]
        assert stored.regime == residual.regime, residual.run
        assert stored.log_ratio == pytest.approx(residual.log_ratio, abs=1e-12), (
            f"{residual.run}: the calibration is stale; run python -m experiments.run coverage --write")


def test_every_shipped_data_set_is_there_with_finite_residuals():
    counts: dict[str, int] = {}
    for residual in load_residuals(RESIDUALS):
        counts[residual.dataset] = counts.get(residual.dataset, 0) + 1
        assert math.isfinite(residual.log_ratio)
    assert counts == {"vtrain": 1549, "torchtitan": 32, "megatron_bridge": 154}
