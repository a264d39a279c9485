"""A slowed device (a topology file's ``slowdown:``) costs its catalog device's time times its factor, by every rule
of the oracle (roofline, GPU kernel model, synthetic times, a measured profile), and whole plans follow: closed forms
of a two-stage pipeline with one stage slowed, and the balanced partition's share for the slow stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sim.cost.oracle import CostOracle
from sim.cost.profile import LayerTiming, MeasuredProfile
from sim.hw.catalog import get_device, slowed_device
from sim.hw.topology import Topology
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict

GPT = "gpt:layers=2,hidden=512,heads=8,seq=256,vocab=1000"


def _mixed(tmp_path: Path, device: str, factor: float) -> str:
    path = tmp_path / f"{device}-slow.yaml"
    path.write_text(f"nodes:\n  - {{device: {device}, count: 2}}\nslowdown: {{1: {factor}}}\n")
    return str(path)


@pytest.mark.parametrize(("model", "device"), [(GPT, "cpu"), (GPT, "V100"), (GPT, "A100"),
                                               ("uniform:layers=3,fwd_ms=4,bwd_ms=9", "ideal")])
@pytest.mark.parametrize("factor", [2, 3.5])
def test_every_layer_time_is_the_catalog_devices_times_the_factor(model: str, device: str, factor: float) -> None:
    oracle = CostOracle(build_model(model), 2)
    base, slow = get_device(device), slowed_device(get_device(device), factor)
    fast, slowed = oracle.layer_costs(base), oracle.layer_costs(slow)
    for times, base_times in ((slowed.fwd, fast.fwd), (slowed.bwd, fast.bwd), (slowed.opt, fast.opt)):
        assert times == pytest.approx([factor * t for t in base_times], rel=1e-15)
    assert oracle.step_overhead_s(slow) == pytest.approx(factor * oracle.step_overhead_s(base), rel=1e-15)
    assert oracle.microbatch_overhead_s(slow) == pytest.approx(factor * oracle.microbatch_overhead_s(base), rel=1e-15)
    assert oracle.layer_costs(base) is fast  # the catalog device's own costs are not disturbed


@pytest.mark.parametrize("factor", [2, 5])
def test_the_slowed_devices_own_roofline_numbers_agree_with_the_factor(factor: float) -> None:
    # The same device, read as a catalog device of its own (no base): the roofline of its divided rates and
    # multiplied overhead gives factor x the original's times, so a search that reads the numbers agrees.
    graph = build_model(GPT)
    cpu = get_device("cpu")
    standalone = dataclasses.replace(slowed_device(cpu, factor), name="standalone", base=None, slowdown=1.0)
    base, alone = CostOracle(graph, 2).layer_costs(cpu), CostOracle(graph, 2).layer_costs(standalone)
    assert alone.fwd == pytest.approx([factor * t for t in base.fwd], rel=1e-12)
    assert alone.bwd == pytest.approx([factor * t for t in base.bwd], rel=1e-12)
    assert alone.opt == pytest.approx([factor * t for t in base.opt], rel=1e-12)


def _cpu_profile(model: str, microbatch_size: int) -> MeasuredProfile:
    graph = build_model(model)
    timings = tuple(LayerTiming(layer.name, 1e-3 * (i + 1), 3e-3 * (i + 1), 1e-4 * (i + 1))
                    for i, layer in enumerate(graph.layers))
    return MeasuredProfile("test-profile", graph.spec, "cpu", microbatch_size, timings, p2p_latency_s=5e-4,
                           p2p_bandwidth=1e9)


def test_a_cpu_profile_applies_to_a_slowed_cpu_times_the_factor_and_its_p2p_fit_to_its_messages(
        tmp_path: Path) -> None:
    profile = _cpu_profile(GPT, 1)
    topology = Topology.parse(_mixed(tmp_path, "cpu", 2))
    oracle = CostOracle(build_model(GPT), 2, profile, topology)
    slow = topology.devices[1]
    assert oracle.profile_applies(slow) and oracle.profiled_ranks() == (0, 1) and oracle.uses_measured_p2p()
    costs = oracle.layer_costs(slow)
    # Measured at 1 sample per microbatch, asked at 2: scaled linearly, then by the factor.
    assert costs.fwd == pytest.approx([2 * 2 * t.fwd_s for t in profile.layers], rel=1e-15)
    assert costs.bwd == pytest.approx([2 * 2 * t.bwd_s for t in profile.layers], rel=1e-15)
    assert costs.opt == pytest.approx([2 * t.opt_s for t in profile.layers], rel=1e-15)
    # Messages are not slowed: the fit measured between two processes of the host.
    assert oracle.transfer_time(4e6, 0, 1) == pytest.approx(5e-4 + 4e6 / 1e9, rel=1e-15)
    assert oracle.transfer_time(4e6, 1, 0) == oracle.transfer_time(4e6, 0, 1)


def test_a_v100_profile_does_not_apply_to_a_slowed_cpu(tmp_path: Path) -> None:
    profile = dataclasses.replace(_cpu_profile(GPT, 1), device="v100-sxm2-32gb")
    topology = Topology.parse(_mixed(tmp_path, "cpu", 2))
    oracle = CostOracle(build_model(GPT), 1, profile, topology)
    assert not oracle.profile_applies(topology.devices[1]) and oracle.profiled_ranks() == ()
    roofline = CostOracle(build_model(GPT), 1).layer_costs(get_device("cpu"))
    assert oracle.layer_costs(topology.devices[1]).fwd == pytest.approx([2 * t for t in roofline.fwd], rel=1e-15)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("m", "factor"), [(4, 2), (6, 3)])
def test_a_two_stage_pipeline_with_its_last_stage_slowed_matches_the_closed_form(
        tmp_path: Path, schedule: str, m: int, factor: float) -> None:
    # Stage times f, b on rank 0 and factor x f, factor x b on rank 1, free links (ideal devices): the last stage is
    # the bottleneck, so one iteration is rank 0's first forward, rank 1's m forwards and m backwards back to back,
    # then rank 0's last backward: f + m·factor·(f + b) + b (synthetic layers have no optimizer time).
    f, b = 0.010, 0.020
    built = build_plan(PlanInputs("uniform:layers=2,fwd_ms=10,bwd_ms=20", _mixed(tmp_path, "ideal", factor),
                                  schedule, microbatches=m, partition="1,1"))
    assert predict(built.plan, topology=built.topology).metrics["iteration_time_s"] == pytest.approx(
        f + m * factor * (f + b) + b, rel=1e-12)


def test_the_balanced_partition_gives_the_slow_device_its_share_of_the_layers(tmp_path: Path) -> None:
    # Six equal layers on a device and one twice as slow: 4 and 2 layers take 4·t and 2·2t, equal stage times.
    built = build_plan(PlanInputs("uniform:layers=6,fwd_ms=10,bwd_ms=20", _mixed(tmp_path, "ideal", 2), "1f1b",
                                  microbatches=4, partition="balanced"))
    assert built.plan.placement.layer_counts() == (4, 2)
    even = build_plan(PlanInputs("uniform:layers=6,fwd_ms=10,bwd_ms=20", "2xideal", "1f1b", microbatches=4))
    assert even.plan.placement.layer_counts() == (3, 3)
