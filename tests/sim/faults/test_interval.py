"""Young's and Daly's checkpoint intervals against Daly's published cases, and Daly's expected wall time: its exact
minimum where his higher-order estimate says, Young's first-order one above it, and the bounds of its domain."""

import math

import pytest

from sim.faults.interval import daly_interval, expected_wall_time, optimal_interval, young_interval

MINUTE, HOUR = 60.0, 3600.0


@pytest.mark.parametrize("mtbf, daly, young", [(24 * HOUR, 116.7, 120.0), (6 * HOUR, 56.7, 60.0),
                                               (15 * MINUTE, 9.1, 12.2)])
def test_dalys_published_cases(mtbf, daly, young):
    # Daly (FGCS 2006): checkpoint 5 min, restart 10 min (../shared/reference/faults.md), printed to 0.1 min.
    assert daly_interval(5 * MINUTE, mtbf) / MINUTE == pytest.approx(daly, abs=0.05)
    assert young_interval(5 * MINUTE, mtbf) / MINUTE == pytest.approx(young, abs=0.05)


@pytest.mark.parametrize("checkpoint, mtbf", [(5 * MINUTE, 24 * HOUR), (5 * MINUTE, 6 * HOUR),
                                              (5 * MINUTE, 15 * MINUTE), (8.0, 3.1 * HOUR), (0.5, 50 * HOUR)])
def test_the_exact_optimum_minimises_the_expected_time_and_daly_estimates_it(checkpoint, mtbf):
    best = optimal_interval(checkpoint, mtbf)
    wall = lambda tau: expected_wall_time(1e6, tau, checkpoint, 10 * MINUTE, mtbf)  # noqa: E731
    # brute force over a fine grid around it: nothing lower
    grid = [best * (0.5 + k / 1000) for k in range(1001)]
    assert wall(best) <= min(wall(tau) for tau in grid) * (1 + 1e-12)
    # Daly's estimate is within 0.3 % of the exact optimum where δ ≪ M (and within 1 % at δ = M/3);
    # Young's is above both.
    assert daly_interval(checkpoint, mtbf) == pytest.approx(best, rel=0.003 if checkpoint < mtbf / 10 else 0.01)
    assert young_interval(checkpoint, mtbf) > best


def test_without_failures_the_expected_time_is_the_work_and_its_checkpoints():
    # M → ∞: T(τ) → work · (τ + δ) / τ
    assert expected_wall_time(3600.0, 600.0, 30.0, 120.0, 1e15) == pytest.approx(3600.0 * 630 / 600, rel=1e-9)


def test_daly_returns_the_mtbf_when_the_checkpoint_outlasts_two_of_them():
    assert daly_interval(3 * HOUR, HOUR) == HOUR


@pytest.mark.parametrize("call", [lambda: young_interval(0.0, 1.0), lambda: daly_interval(1.0, -1.0),
                                  lambda: expected_wall_time(1.0, 0.0, 1.0, 1.0, 1.0),
                                  lambda: optimal_interval(1.0, math.inf)])
def test_out_of_domain_values_are_refused(call):
    with pytest.raises(ValueError, match="must be a finite number"):
        call()
