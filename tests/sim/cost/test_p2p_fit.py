"""The α-β fit against exact lines, noisy lines and input that admits no line."""

import numpy as np
import pytest

from sim.core.errors import SpecError
from sim.cost.p2p_fit import fit_latency_bandwidth

SIZES = [2**k for k in range(10, 25)]  # the profiler's default range, 1 KiB .. 16 MiB


@pytest.mark.parametrize("alpha, beta", [(25e-6, 2e9), (2e-6, 2.5e10), (1e-3, 1.25e8)])
def test_fit_recovers_latency_and_bandwidth_from_exact_points(alpha, beta):
    times = [alpha + x / beta for x in SIZES]
    latency, bandwidth = fit_latency_bandwidth(SIZES, times)
    assert latency == pytest.approx(alpha, rel=1e-9)
    assert bandwidth == pytest.approx(beta, rel=1e-9)


def test_fit_of_two_points_is_the_line_through_them():
    assert fit_latency_bandwidth([1000, 3000], [3e-6, 5e-6]) == pytest.approx((2e-6, 1e9), rel=1e-9)


def test_fit_recovers_latency_and_bandwidth_from_noisy_points():
    # 2 % multiplicative noise, five samples per size: what a loaded 2-core box gives. Plain least squares would let
    # the 16 MiB points (8 ms, +-160 µs of noise) swamp the 25 µs intercept; the relative fit must not.
    rng = np.random.default_rng(20261122)
    alpha, beta = 25e-6, 2e9
    sizes = np.repeat(SIZES, 5)
    times = (alpha + sizes / beta) * (1 + 0.02 * rng.standard_normal(sizes.size))
    latency, bandwidth = fit_latency_bandwidth(sizes.tolist(), times.tolist())
    assert latency == pytest.approx(alpha, rel=0.05)
    assert bandwidth == pytest.approx(beta, rel=0.05)


def test_a_negative_intercept_is_clipped_to_zero_with_the_best_line_through_the_origin():
    beta = 1e9
    times = [-2e-8 + x / beta for x in SIZES]  # slightly negative latency, as noise can make it on a fast link
    latency, bandwidth = fit_latency_bandwidth(SIZES, times)
    assert latency == 0.0
    x, t = np.array(SIZES, float), np.array(times)
    through_origin = np.sum(x / t) / np.sum((x / t) ** 2)  # minimises sum((x * slope - t) / t)^2
    assert bandwidth == pytest.approx(1 / through_origin, rel=1e-9)
    assert bandwidth == pytest.approx(beta, rel=0.01)


@pytest.mark.parametrize("sizes, times, message", [
    ([1024], [1e-5], "two distinct"),
    ([1024, 1024, 1024], [1e-5, 2e-5, 3e-5], "two distinct"),
    ([1024, 2048], [1e-5], "one time per size"),
    ([1024, 2048], [2e-5, 1e-5], "not positive"),
    ([1024, 2048], [1e-5, 1e-5], "not positive"),
    ([1024, 2048], [0.0, 1e-5], "times > 0"),
    ([-1, 2048], [1e-5, 2e-5], "sizes must be >= 0"),
    ([1024, 2048], [1e-5, float("nan")], "finite"),
])
def test_fit_rejects_input_that_admits_no_line(sizes, times, message):
    with pytest.raises(SpecError, match=message) as info:
        fit_latency_bandwidth(sizes, times)
    assert isinstance(info.value, ValueError)
