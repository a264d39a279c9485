"""Host↔device copies are costed by the oracle: the link model of the PCIe path, or a measured profile's pinned
copy bandwidth on the profile's device (and the engine's PREFETCH and EVICT take that time)."""

import json

import pytest

from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.oracle import CostOracle
from sim.cost.profile import LayerTiming, MeasuredProfile, load_profile, profile_document
from sim.engine.simpy_engine import simulate
from sim.hw.topology import Topology, message_time
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.models import build_model
from sim.plan.validate import validate

MODEL = "uniform:layers=1,fwd_ms=1,bwd_ms=2,act_mb=1,param_mb=100"
H2D, D2H = 2e10, 1e10  # bytes/s


def _profile(topology: Topology, **bandwidths: float) -> MeasuredProfile:
    graph = build_model(MODEL)
    return MeasuredProfile("measured.json", graph.spec, topology.devices[0].hardware.name, 1,
                           (LayerTiming(graph.layers[0].name, 1e-3, 2e-3),), **bandwidths)


def test_the_oracle_takes_the_measured_bandwidth_on_the_profile_device_else_the_link_model():
    topology = Topology.parse("1xV100+1xA100")
    graph = build_model(MODEL)
    measured = CostOracle(graph, 1, _profile(topology, h2d_bandwidth=H2D, d2h_bandwidth=D2H), topology)
    assert measured.host_to_device_s(0, 1e8) == 1e8 / H2D
    assert measured.device_to_host_s(0, 1e8) == 1e8 / D2H
    # rank 1 is an A100, where a V100's profile says nothing: the link model
    assert measured.host_to_device_s(1, 1e8) == message_time(topology.host_to_device_path(1), 1e8)
    plain = CostOracle(graph, 1, _profile(topology), topology)  # a profile without host_copy
    assert plain.device_to_host_s(0, 1e8) == message_time(topology.device_to_host_path(0), 1e8)


def test_the_engine_copies_for_the_oracles_time():
    prefetch = Op(OpKind.PREFETCH, 0)
    program = (prefetch, Op(OpKind.F, 0, 0, deps=(prefetch.id,)), Op(OpKind.B, 0, 0),
               Op(OpKind.EVICT, 0, deps=("0B0",)))
    graph = build_model(MODEL)
    placement = Placement(((0, 1),), (0,))
    topology = Topology.parse("1xV100")
    plan = Plan("file", "L1", graph.spec, "1xV100", 1, 1, "flush", placement, (program,))
    validate(plan)
    profile = _profile(topology, h2d_bandwidth=H2D, d2h_bandwidth=D2H)
    spans = {s.op: s for s in simulate(plan, CostView(graph, topology, placement, 1, profile), topology).trace.spans}
    assert spans["0PREFETCH"].duration == pytest.approx(1e8 / H2D, rel=1e-12)
    assert spans["0EVICT"].duration == pytest.approx(1e8 / D2H, rel=1e-12)


def _write(tmp_path, host_copy):
    document = profile_document(model="m", device="d", microbatch_size=1,
                                layers=[{"name": "l", "fwd_s": 1.0, "bwd_s": 2.0}], method={}, machine={},
                                software={}, extra={"host_copy": host_copy})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return path


def test_a_profile_reads_the_pinned_copy_bandwidths(tmp_path):
    profile = load_profile(_write(tmp_path, {"h2d_pinned_bytes_per_s": H2D, "d2h_pinned_bytes_per_s": D2H,
                                             "h2d_pageable_bytes_per_s": 1.0, "d2h_pageable_bytes_per_s": 1.0}))
    assert (profile.h2d_bandwidth, profile.d2h_bandwidth) == (H2D, D2H)
    with pytest.raises(SpecError, match="host_copy: h2d_pinned_bytes_per_s must be > 0"):
        load_profile(_write(tmp_path, {"h2d_pinned_bytes_per_s": 0}))
    with pytest.raises(SpecError, match="host_copy must be an object"):
        load_profile(_write(tmp_path, [1]))
