"""Tests of slowed devices: ``sim.hw.catalog.slowed_device`` and a topology file's ``slowdown:``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sim.core.errors import SpecError
from sim.hw.catalog import MAX_SLOWDOWN, get_device, slowed_device
from sim.hw.topology import Topology


def _edges(topology: Topology) -> list[tuple[str, str, str]]:
    return sorted((a, b, link.spec.name) for a, b, link in topology.graph.edges(data="link"))


@pytest.mark.parametrize("name", ["cpu", "V100", "A100", "ideal"])
@pytest.mark.parametrize("factor", [1.5, 2, 7.25])
def test_a_slowed_device_is_its_catalog_device_with_every_rate_divided(name: str, factor: float) -> None:
    base = get_device(name)
    slow = slowed_device(base, factor)
    assert slow.base is base and slow.hardware is base and slow.slowdown == factor
    assert slow.name == f"{base.name}-slowed-{factor:g}x" and slow.name != base.name
    # The roofline's three terms each take factor times as long; what the device holds and how it is wired stay.
    assert slow.peak_flops == base.peak_flops / factor
    assert slow.memory_bandwidth == base.memory_bandwidth / factor
    assert slow.launch_overhead_s == base.launch_overhead_s * factor
    assert (slow.memory_bytes, slow.host_link, slow.compute_units, slow.matmul_efficiency) == (
        base.memory_bytes, base.host_link, base.compute_units, base.matmul_efficiency)
    assert slow.is_gpu == base.is_gpu and "[derived" in slow.source


def test_factor_one_is_the_device_itself_and_slowing_twice_multiplies() -> None:
    cpu = get_device("cpu")
    assert slowed_device(cpu, 1) is cpu and cpu.hardware is cpu and cpu.slowdown == 1.0 and cpu.base is None
    twice = slowed_device(slowed_device(cpu, 2), 3)
    assert twice.base is cpu and twice.slowdown == 6 and twice == slowed_device(cpu, 6)
    assert slowed_device(slowed_device(cpu, 2), 1) == slowed_device(cpu, 2)


@pytest.mark.parametrize("factor", [0.5, 0, -2, math.nan, math.inf, MAX_SLOWDOWN + 1, True, "2"])
def test_a_factor_outside_one_to_the_maximum_is_refused(factor: object) -> None:
    with pytest.raises(SpecError, match="slowdown must be a finite number from 1 to 1000"):
        slowed_device(get_device("cpu"), factor)  # type: ignore[arg-type]


def test_slowing_a_slowed_device_past_the_maximum_is_refused() -> None:
    with pytest.raises(SpecError, match="at most 1000x"):
        slowed_device(slowed_device(get_device("cpu"), 100), 20)


def _topology(tmp_path: Path, text: str) -> Topology:
    path = tmp_path / "mixed.yaml"
    path.write_text(text)
    return Topology.parse(str(path))


def test_a_topology_file_slows_the_ranks_it_names_and_keeps_the_wiring(tmp_path: Path) -> None:
    topology = _topology(tmp_path, "nodes:\n  - {device: cpu, count: 4}\nslowdown: {1: 2, 3: 1.5}\n")
    cpu = get_device("cpu")
    assert topology.devices == (cpu, slowed_device(cpu, 2), cpu, slowed_device(cpu, 1.5))
    plain = Topology.parse("4xcpu")
    assert _edges(topology) == _edges(plain) and topology.node_of_rank == plain.node_of_rank
    assert topology.transfer_time(1e6, 0, 1) == plain.transfer_time(1e6, 0, 1)
    text = topology.describe()
    assert "rank 1 x2 (cpu-slowed-2x)" in text and "rank 3 x1.5 (cpu-slowed-1.5x)" in text
    assert "slowed" not in plain.describe()


def test_slowdown_ranks_are_global_across_repeated_and_mixed_servers(tmp_path: Path) -> None:
    topology = _topology(tmp_path, "nodes:\n  - {device: V100, count: 2, repeat: 2}\n  - {device: A100, count: 2}\n"
                                   "slowdown: {2: 4, 5: 2}\n")
    v100, a100 = get_device("V100"), get_device("A100")
    assert topology.devices == (v100, v100, slowed_device(v100, 4), v100, a100, slowed_device(a100, 2))
    assert _edges(topology) == _edges(Topology.parse("2x2xV100+2xA100"))


def test_a_factor_of_one_changes_nothing(tmp_path: Path) -> None:
    topology = _topology(tmp_path, "nodes:\n  - {device: cpu, count: 2}\nslowdown: {0: 1, 1: 1.0}\n")
    assert topology.devices == Topology.parse("2xcpu").devices and topology.nodes == Topology.parse("2xcpu").nodes


@pytest.mark.parametrize(
    ("slowdown", "message"),
    [
        ("[1, 2]", "mapping of rank to factor"),
        ("{}", "mapping of rank to factor"),
        ("2", "mapping of rank to factor"),
        ("{2: 2}", "rank 2 is not a rank of this topology (0..1)"),
        ("{-1: 2}", "rank -1 is not a rank"),
        ("{one: 2}", "rank 'one' is not a rank"),
        ("{1: 0.5}", "rank 1's factor must be a number from 1"),
        ("{1: .nan}", "got nan"),
        ("{1: .inf}", "got inf"),
        ("{1: 1001}", "got 1001"),
        ("{1: fast}", "got 'fast'"),
        ("{1: true}", "got True"),
        ("{1: 2, 1: 3}", "duplicate key 1"),
    ],
)
def test_a_bad_slowdown_names_the_file_and_the_value(tmp_path: Path, slowdown: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"nodes:\n  - {{device: cpu, count: 2}}\nslowdown: {slowdown}\n")
    with pytest.raises(SpecError) as info:
        Topology.parse(str(path))
    assert str(path) in str(info.value) and message in str(info.value)
