"""The α-β fit of point-to-point times, the message sizes, and the ping-pong's failure path (profiles/p2p)."""

import time

import numpy as np
import pytest

from profiles.p2p import P2PError, choose_p2p, fit_latency_bandwidth, ping_pong, power_of_two_sizes
from sim.errors import SpecError

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


def test_power_of_two_sizes_double_up_to_the_maximum():
    assert power_of_two_sizes(1024, 8192) == (1024, 2048, 4096, 8192)
    assert power_of_two_sizes(1000, 9000) == (1000, 2000, 4000, 8000)
    assert len(power_of_two_sizes(2**10, 2**24)) == 15


@pytest.mark.parametrize("low, high", [(1024, 2047), (0, 4096), (4096, 1024)])
def test_power_of_two_sizes_need_two_sizes_of_at_least_one_byte(low, high):
    with pytest.raises(SpecError):
        power_of_two_sizes(low, high)


def test_a_failing_rank_is_reported_at_once_and_leaves_no_child_behind():
    import multiprocessing

    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(P2PError, match="no-such-backend"):
        ping_pong([1024, 2048], warmup=0, repeats=1, backend="no-such-backend", timeout_s=60)
    # The children only import torch and fail; waiting for the 60 s timeout would mean the error was not seen.
    assert time.monotonic() - start < 30
    assert set(multiprocessing.active_children()) == before


def test_ping_pong_times_every_size_and_the_median_is_never_below_the_fastest():
    result = ping_pong([4096, 1024, 16384], warmup=1, repeats=5, timeout_s=60)
    assert result.backend == "gloo" and result.sizes_bytes == (1024, 4096, 16384)
    assert len(result.one_way_s) == len(result.one_way_min_s) == 3
    assert all(0 < fastest <= median < 1.0 for fastest, median in zip(result.one_way_min_s, result.one_way_s))


@pytest.mark.parametrize("device_type, gpus, backend, device", [
    ("cpu", 0, "gloo", "cpu"),
    ("cpu", 1, "gloo", "cpu"),  # a CPU profile measures CPU ranks' transport, whatever GPUs the host has
    ("cpu", 8, "gloo", "cpu"),
    ("cuda", 2, "nccl", "cuda"),
    ("cuda", 8, "nccl", "cuda"),
    # NCCL needs two GPUs; a loopback between CPU processes would measure the host, which sim.profile ignores for
    # GPU links, so a one-GPU host measures nothing and says why.
    ("cuda", 1, None, None),
    ("cuda", 0, None, None),
])
def test_the_p2p_measurement_follows_the_device_and_the_gpu_count(device_type, gpus, backend, device):
    choice = choose_p2p(device_type, gpus)
    assert (choice.backend, choice.device) == (backend, device)
    if device_type == "cuda" and gpus == 1:
        assert choice.note == "skipped: NCCL p2p needs 2 CUDA devices, this host has 1"
    if backend is None:
        assert choice.note.startswith("skipped")


@pytest.mark.parametrize("device_type, gpus, message", [("tpu", 0, "'cpu' or 'cuda'"), ("cuda", -1, ">= 0")])
def test_choose_p2p_rejects_an_unknown_device_or_a_negative_count(device_type, gpus, message):
    with pytest.raises(ValueError, match=message):
        choose_p2p(device_type, gpus)
