"""The coverage check (experiments.coverage): the seeded halves per data set, and the count of held-out figures inside
their regimes' intervals against a hand-made case."""

import math

import pytest

from experiments import coverage
from sim.report.interval import Regime, Residual

A = Regime("ampere", "gpt", "16-bit", "tp+dp", "1-8")
B = Regime("hopper", "llama", "fp8", "fsdp", "9-64")


def _set(dataset, regime, values):
    return [Residual(dataset, f"{dataset}{i:03d}", regime, v) for i, v in enumerate(values)]


def test_each_data_set_is_halved_by_the_seed():
    residuals = _set("a", A, [0.0] * 40) + _set("b", B, [0.0] * 9)
    halves = coverage.split(residuals, 0)
    assert halves == coverage.split(residuals, 0) and halves != coverage.split(residuals, 1)
    assert halves[:40].count("calibration") == 20 and halves[40:].count("calibration") == 5


def test_held_out_figures_are_counted_inside_their_regimes_interval():
    # 40 calibration residuals 0.00..0.39 of regime A: the 90 % bounds are the 2nd and 39th smallest (41 * 0.05 =
    # 2.05 -> floor 2; 41 * 0.95 = 38.95 -> ceil 39): 0.01 and 0.38
    calibration = _set("a", A, [0.01 * i for i in range(40)])
    held = [Residual("a", "h1", A, 0.2), Residual("a", "h2", A, 0.385), Residual("a", "h3", A, 0.005),
            Residual("b", "h4", B, 0.1)]  # B has no run of its own: every feature relaxed, A's pool calibrates it
    residuals = calibration + held
    halves = ["calibration"] * 40 + ["held-out"] * 4
    found = {entry.dataset: entry for entry in coverage.check(residuals, halves)}
    assert (found["a"].runs, found["a"].covered, found["a"].validated) == (3, 1, 3)
    assert (found["b"].runs, found["b"].covered, found["b"].validated) == (1, 1, 0)
    assert found["a"].median_width == pytest.approx(math.exp(0.38 - 0.01) - 1)
    assert found["a"].coverage == pytest.approx(1 / 3)


def test_unknown_data_sets_are_refused_before_anything_runs():
    from sim.core.errors import SpecError

    with pytest.raises(SpecError, match="--datasets must name some of vtrain, torchtitan, megatron_bridge"):
        coverage.run(datasets="vtrain,mlperf")
    with pytest.raises(SpecError, match="--write stores the calibration of every data set"):
        coverage.run(datasets="torchtitan", write=True)
