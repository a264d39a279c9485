"""The α-β fit of point-to-point times, the message sizes, and the ping-pong's failure path (profiles/p2p)."""

import time

import pytest

from profiles.p2p import P2PError, choose_p2p, ping_pong, power_of_two_sizes
from sim.core.errors import SpecError

SIZES = [2**k for k in range(10, 25)]  # the profiler's default range, 1 KiB .. 16 MiB


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
    # NCCL needs two GPUs; a loopback between CPU processes would measure the host, which sim.cost.profile ignores for
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
