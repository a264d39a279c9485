"""Split-conformal intervals per regime (sim.report.interval): the order statistics of the definition, coverage on
exchangeable draws, the relaxation of features, and the regime of a plan."""

import math
import random

import pytest

from sim.core.errors import SpecError
from sim.report.interval import (
    FEATURES,
    MIN_RUNS,
    Regime,
    Residual,
    calibrate,
    conformal_bounds,
    load_residuals,
    write_residuals,
)

HOPPER = Regime("hopper", "llama", "16-bit", "fsdp", "1-8")


def test_the_bounds_are_the_defined_order_statistics():
    values = list(range(1, 20))  # n = 19: ranks floor(20 * 0.05) = 1 and ceil(20 * 0.95) = 19
    assert conformal_bounds(values, 0.9) == (1, 19)
    values = list(range(1, 40))  # n = 39: ranks 2 and 38
    assert conformal_bounds(random.Random(0).sample(values, len(values)), 0.9) == (2, 38)
    assert conformal_bounds(list(range(18)), 0.9) is None  # too few: the upper rank is past the end
    with pytest.raises(ValueError, match="level"):
        conformal_bounds([1.0], 1.0)


def test_exchangeable_draws_are_covered_at_the_level():
    # The guarantee: for n calibration draws and one new draw from the same distribution, P(covered) >= level.
    rng = random.Random(7)
    trials, covered = 4000, 0
    for _ in range(trials):
        calibration = [rng.gauss(0.05, 0.1) for _ in range(39)]
        low, high = conformal_bounds(calibration, 0.9)
        covered += low <= rng.gauss(0.05, 0.1) <= high
    # exact coverage between the 2nd and 38th of 39 continuous draws: (38 - 2) / 40 = 0.9; 4000 trials: 3 sigma is
    # about 1.4 points
    assert abs(covered / trials - 36 / 40) < 0.015


def _residuals(regime, values, dataset="d"):
    return [Residual(dataset, f"r{i}", regime, v) for i, v in enumerate(values)]


def test_the_regime_is_matched_whole_when_enough_runs_share_it_and_relaxed_from_the_last_feature_otherwise():
    same = _residuals(HOPPER, [0.01 * i for i in range(MIN_RUNS)])
    other_scale = _residuals(Regime("hopper", "llama", "16-bit", "fsdp", "9-64"), [1.0] * 30)
    found = calibrate(HOPPER, same + other_scale)
    assert found.validated and found.runs == MIN_RUNS and found.relaxed == () and found.matched == FEATURES
    assert (found.low, found.high) == (0.0, 0.01 * (MIN_RUNS - 1))
    # one run fewer in the regime: its scale is dropped, and the pool takes the other scale's runs
    relaxed = calibrate(HOPPER, same[1:] + other_scale)
    assert not relaxed.validated and relaxed.relaxed == ("scale",) and relaxed.runs == MIN_RUNS - 1 + 30
    # nothing of its generation: every feature relaxed, every run pooled
    blackwell = calibrate(Regime("blackwell", "moe", "fp4", "ep", "513+"), same + other_scale)
    assert blackwell.relaxed == FEATURES and blackwell.runs == MIN_RUNS + 30
    # no residuals at all: no interval
    empty = calibrate(HOPPER, [])
    assert (empty.low, empty.high, empty.runs) == (None, None, 0) and empty.time_interval(1.0) is None


def test_the_intervals_of_a_time_and_a_rate_are_the_residuals_applied():
    found = calibrate(HOPPER, _residuals(HOPPER, [-0.1] + [0.0] * 17 + [0.2]))
    assert found.time_interval(10.0) == pytest.approx((10 * math.exp(-0.1), 10 * math.exp(0.2)))
    # a rate is the inverse of a time: a slower measurement is a lower rate
    assert found.rate_interval(100.0) == pytest.approx((100 / math.exp(0.2), 100 / math.exp(-0.1)))


def test_residuals_round_trip_through_their_csv_and_bad_files_are_refused(tmp_path):
    rows = _residuals(HOPPER, [0.25, -0.125])
    path = tmp_path / "r.csv"
    path.write_text(write_residuals(rows))
    assert load_residuals(path) == tuple(rows)
    path.write_text(write_residuals(rows).replace("0.25", "fast"))
    with pytest.raises(SpecError, match=r"r.csv:2: log_ratio must be a number"):
        load_residuals(path)
    path.write_text("dataset,run\n")
    with pytest.raises(SpecError, match="columns must be"):
        load_residuals(path)
    with pytest.raises(SpecError, match="cannot read"):
        load_residuals(tmp_path / "missing.csv")


def test_a_plans_regime_names_its_devices_family_precision_dims_and_scale():
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs
    from sim.predict import predict_built

    inputs = PlanInputs(model="llama3.1-8b,seq=1024", topology="2x8xH100", schedule="1f1b", microbatch_size=1,
                        tp=2, dp=8, zero=3, global_batch=8, precision="fp8")
    metrics = predict_built(build_plan(inputs), check_memory=False).metrics
    assert metrics["regime"] == {"generation": "hopper", "family": "llama", "precision": "fp8", "dims": "tp+fsdp",
                                 "scale": "9-64"}
    interval = metrics["iteration_time_s_interval"]
    assert set(interval) == {"low", "high", "level", "runs", "matched", "relaxed"} and interval["level"] == 0.9
    # the shipped calibration's bounds for that regime, applied to the predicted time and to its inverse, the rate
    from sim.report.interval import shipped_index

    calibration = shipped_index().calibrate(Regime(**metrics["regime"]))
    time_s, rate = metrics["iteration_time_s"], metrics["tokens_per_s_per_device"]
    assert (interval["low"], interval["high"]) == pytest.approx((time_s * math.exp(calibration.low),
                                                                  time_s * math.exp(calibration.high)))
    rates = metrics["tokens_per_s_per_device_interval"]
    assert (rates["low"], rates["high"]) == pytest.approx((rate / math.exp(calibration.high),
                                                            rate / math.exp(calibration.low)))
    assert interval["runs"] == calibration.runs and interval["relaxed"] == list(calibration.relaxed)
