"""The caching allocator's reserve (sim.cost.allocator): the allocated peak grown by the fragmentation, never past
the device, nothing on a CPU."""

import math

import pytest

from sim.cost.allocator import FRAGMENTATION, reserved_bytes
from sim.hw.catalog import get_device


def test_the_reserve_grows_the_peak_and_stops_at_the_device():
    gpu = get_device("H100")
    assert reserved_bytes(10 * 2**30, gpu) == math.ceil(10 * 2**30 * (1 + FRAGMENTATION))
    assert reserved_bytes(10 * 2**30, gpu, 0.0) == 10 * 2**30
    assert reserved_bytes(int(gpu.memory_bytes), gpu) == int(gpu.memory_bytes)  # squeezed to the device
    assert reserved_bytes(0, gpu) == 0


def test_a_cpu_reports_no_reserve_and_bad_figures_are_refused():
    assert reserved_bytes(2**30, get_device("cpu")) is None
    with pytest.raises(ValueError, match="allocated_peak"):
        reserved_bytes(-1, get_device("H100"))
    with pytest.raises(ValueError, match="fragmentation"):
        reserved_bytes(1, get_device("H100"), -0.1)
