"""compare.json and calibrated profiles, against hand-made traces."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from executor.calibration import calibrated_profile, profile_device, stage_medians
from executor.compare import compare_report, median_iteration
from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.oracle import CostOracle
from sim.cost.profile import load_profile
from sim.engine.simpy_engine import simulate
from sim.hw.catalog import get_device
from sim.ir.trace import Span, Trace
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50"


def _trace(f, b, *, opt=0.001):
    """Two F and two B on rank 0, one after the other, then the optimizer step."""
    spans, t = [], 0.0
    for op, kind, duration, mb in (("0F0", "F", f, 0), ("0F1", "F", f, 1), ("0B0", "B", b, 0), ("0B1", "B", b, 1),
                                   ("0OPT_STEP", "OPT_STEP", opt, None)):
        spans.append(Span(op, kind, 0, "compute", t, t + duration, 0, mb))
        t += duration
    return Trace.from_spans(spans, ["cpu"])


def test_relative_error_is_against_the_median_measured_iteration():
    predicted = _trace(0.010, 0.020)  # 61 ms
    measured = [_trace(0.010, 0.020), _trace(0.020, 0.040), _trace(0.012, 0.024)]  # 61, 121, 73 ms
    index, _ = median_iteration([trace.makespan for trace in measured], 0)
    report = compare_report(predicted, measured, median_index=index, cost_source="roofline")
    assert report["measured_iteration_time_s"] == pytest.approx(0.073)
    assert report["predicted_iteration_time_s"] == pytest.approx(0.061)
    assert report["relative_error"] == pytest.approx(0.061 / 0.073 - 1)
    assert report["ops"]["F"]["count"] == 2
    assert report["ops"]["F"]["measured_mean_s"] == pytest.approx((0.010 + 0.020 + 0.012) / 3)
    assert report["ops"]["B"]["predicted_mean_s"] == pytest.approx(0.020)
    assert report["measured_iterations_s"] == pytest.approx([0.061, 0.121, 0.073])
    with pytest.raises(ValueError):
        compare_report(predicted, [], median_index=0, cost_source="roofline")
    with pytest.raises(ValueError, match="median_index 3"):
        compare_report(predicted, measured, median_index=3, cost_source="roofline")


def test_an_even_count_of_iterations_reports_the_lower_middle_one():
    # The number compare.json reports is the time of the iteration metrics.json and trace.json show (finish.py).
    predicted = _trace(0.010, 0.020)
    measured = [_trace(0.010, 0.020), _trace(0.020, 0.040), _trace(0.012, 0.024), _trace(0.011, 0.022)]
    index, median = median_iteration([trace.makespan for trace in measured], 0)  # 61, 121, 73, 67 ms
    report = compare_report(predicted, measured, median_index=index, cost_source="roofline")
    assert (index, median) == median_iteration(report["measured_iterations_s"], 0)
    assert index == 3 and report["measured_iteration_time_s"] == median == measured[3].makespan
    assert median == pytest.approx(0.067)  # not statistics.median's 70 ms, which no iteration took


def test_stage_medians():
    medians = stage_medians([_trace(0.010, 0.020), _trace(0.030, 0.060), _trace(0.011, 0.022)])
    assert medians[(0, "F")] == pytest.approx(0.011)
    assert medians[(0, "B")] == pytest.approx(0.022)
    assert medians[(0, "OPT_STEP")] == pytest.approx(0.001)


def test_calibrated_profile_reproduces_the_measured_stage_times(tmp_path):
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="1f1b", microbatches=4,
                                  partition="uniform"))
    plan, graph, topology = built.plan, built.graph, built.topology
    medians = {(0, "F"): 0.010, (0, "B"): 0.030, (0, "OPT_STEP"): 0.002,
               (1, "F"): 0.012, (1, "B"): 0.020, (1, "OPT_STEP"): 0.001}
    profile = calibrated_profile(plan, graph, built.costs, medians, device="cpu", p2p=(1e-4, 1e9),
                                 machine={"cores": 2}, software={}, iterations=3)
    assert profile["device"] == "cpu"
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(profile))
    loaded = load_profile(path)
    assert [t.name for t in loaded.layers] == [layer.name for layer in graph.layers]
    costs = CostView(graph, topology, plan.placement, plan.microbatch_size, loaded)
    from sim.ir.plan import OpKind

    for v in range(2):
        assert costs.compute_time(OpKind.F, v) == pytest.approx(medians[(v, "F")])
        assert costs.compute_time(OpKind.B, v) == pytest.approx(medians[(v, "B")])
        assert costs.compute_time(OpKind.OPT_STEP, v) == pytest.approx(medians[(v, "OPT_STEP")])
    # Within a stage the layers keep the prior's proportions.
    prior = CostOracle(graph, 1).layer_costs(topology.devices[0])
    start, end = plan.placement.vstage_layers[0]
    shares = [t.fwd_s for t in loaded.layers[start:end]]
    assert shares[0] / sum(shares) == pytest.approx(prior.fwd[start] / sum(prior.fwd[start:end]))
    assert costs.oracle.transfer_time(10**6, 0, 1) == pytest.approx(1e-4 + 1e-3)
    simulate(plan, costs, topology)  # the simulator accepts it


def test_calibration_needs_every_stage_measured():
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="1f1b", microbatches=2, partition="uniform"))
    with pytest.raises(ValueError, match="no measured B for stage 1"):
        calibrated_profile(built.plan, built.graph, built.costs, {(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 1.0},
                           device="cpu", p2p=None, machine={}, software={}, iterations=1)


def test_a_plan_measured_on_another_device_is_labelled_with_the_measured_one():
    # A V100 plan run on this host's CPU: the profile is a cpu profile, split by the cpu roofline.
    built = build_plan(PlanInputs(model=SPEC, topology="2xV100", schedule="1f1b", microbatches=2,
                                  partition="uniform"))
    medians = {(v, kind): 0.01 for v in range(2) for kind in ("F", "B")}
    profile = calibrated_profile(built.plan, built.graph, built.costs, medians, device="cpu", p2p=None,
                                 machine={}, software={}, iterations=1)
    assert profile["device"] == "cpu"
    prior = CostOracle(built.graph, 1).layer_costs(get_device("cpu"))
    start, end = built.plan.placement.vstage_layers[0]
    fwd = [layer["fwd_s"] for layer in profile["layers"][start:end]]
    assert fwd == pytest.approx([0.01 * p / sum(prior.fwd[start:end]) for p in prior.fwd[start:end]])


@pytest.mark.parametrize("names,expected", [
    (["cpu", "cpu"], "cpu"),
    (["Tesla V100-SXM2-32GB", "Tesla V100-SXM2-32GB"], "v100-sxm2-32gb"),
    (["NVIDIA H100 80GB HBM3"], "h100-sxm5-80gb"),
])
def test_profile_device_is_the_catalog_id_every_rank_ran_on(names, expected):
    assert profile_device(names) == expected


@pytest.mark.parametrize("names,message", [
    (["cpu", "NVIDIA A100-SXM4-80GB"], "but the ranks run on a100-sxm4-80gb, cpu$"),
    (["NVIDIA H100 NVL"], "'NVIDIA H100 NVL', which the hardware catalog"),
])
def test_profile_device_refuses_mixed_or_unknown_devices(names, message):
    with pytest.raises(SpecError, match=message):
        profile_device(names)


def test_looking_up_a_cuda_device_imports_neither_torch_nor_the_profiler():
    # The lookup lives in executor.provenance (string matching over the catalog's names), not in the profiler's CLI.
    code = ("import sys; from executor.calibration import device_catalog_id; "
            "print(device_catalog_id('NVIDIA H100 80GB HBM3'), 'torch' in sys.modules, "
            "'profiles.measure' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.split() == ["h100-sxm5-80gb", "False", "False"]
