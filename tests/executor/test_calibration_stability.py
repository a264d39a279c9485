"""executor.calibration: how far a calibration can be trusted (stage stability) and its latencies by posting order,
against hand-made traces whose answers are known by construction."""

import json

import pytest

from executor.calibration import (
    MAX_HALF_DRIFT,
    MIN_STABLE_ITERATIONS,
    calibrated_profile,
    dispatch_time,
    in_place_p2p,
    posting_order_latencies,
    stage_stability,
)
from sim.cost.profile import load_profile
from sim.ir.plan import OpKind
from sim.ir.trace import Span, Trace
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50"


def _iteration(f, b, opt=0.001):
    """Rank 0 alone: F0, F1, B0, B1, OPT_STEP back to back (durations in s)."""
    spans, t = [], 0.0
    for op, kind, duration, mb in (("0F0", "F", f[0], 0), ("0F1", "F", f[1], 1), ("0B0", "B", b[0], 0),
                                   ("0B1", "B", b[1], 1), ("0OPT_STEP", "OPT_STEP", opt, None)):
        spans.append(Span(op, kind, 0, "compute", t, t + duration, 0, mb))
        t += duration
    return Trace.from_spans(spans, ["cpu"])


def test_stability_counts_samples_and_measures_the_drift_between_halves():
    # Four iterations: the first two at F = 10 ms, the last two at F = 11 ms; B steady at 20 ms.
    measured = [_iteration((0.010, 0.010), (0.020, 0.020))] * 2 + [_iteration((0.011, 0.011), (0.020, 0.020))] * 2
    stability = stage_stability(measured)
    assert stability["iterations"] == 4
    assert stability["samples"] == {"B": 8, "F": 8, "OPT_STEP": 4}
    # F's halves have medians 10 and 11 ms, all eight samples a median of 10.5 ms.
    assert stability["max_half_drift"] == pytest.approx(0.001 / 0.0105)
    # F's quartiles (inclusive method) over 4 x 10 ms and 4 x 11 ms: 10 and 11 ms.
    assert stability["max_relative_iqr"] == pytest.approx(0.001 / 0.0105)


def test_a_steady_run_has_no_drift_and_one_iteration_has_no_halves():
    steady = [_iteration((0.010, 0.010), (0.020, 0.020))] * 3
    # Durations are differences of span times, so "equal" is up to rounding.
    assert stage_stability(steady)["max_half_drift"] == pytest.approx(0.0, abs=1e-12)
    assert stage_stability(steady)["max_relative_iqr"] == pytest.approx(0.0, abs=1e-12)
    assert stage_stability(steady[:1])["max_half_drift"] == 0.0


def _two_rank_trace(*, rank1_busy_until, crossing=0.003):
    """F of mb 0 on vstage 0 (rank 0) ends at 10 ms; rank 1 is busy with another op until ``rank1_busy_until`` s,
    then posts RECV_F; the transfer takes ``crossing`` s from the later post; rank 1's F0 follows."""
    produced = 0.010
    start = max(produced, rank1_busy_until)
    spans = [Span("0F0", "F", 0, "compute", 0.0, produced, 0, 0),
             Span("1OTHER", "B", 1, "compute", 0.0, rank1_busy_until, 1, 7),
             Span("0SEND_F0", "SEND_F", 0, "send", start, start + crossing, 0, 0, 0, 1),
             Span("1RECV_F0", "RECV_F", 1, "recv", start, start + crossing, 1, 0, 0, 0),
             Span("1F0", "F", 1, "compute", start + crossing, start + crossing + 0.010, 1, 0)]
    return Trace.from_spans(spans, ["cpu", "cpu"])


def test_posting_order_splits_transfers_by_which_side_was_late():
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="gpipe", microbatches=1,
                                  partition="uniform"))
    nbytes = built.costs.message_bytes(OpKind.RECV_F, 1)
    bandwidth = nbytes / 0.001  # so that every transfer's bytes take 1 ms, leaving a latency of 2 ms
    # Receiver free at 5 ms, before the data is ready at 10 ms: it was waiting (receiver first). Receiver busy until
    # 20 ms: the data waited for it (sender first).
    result = posting_order_latencies(built.costs, [_two_rank_trace(rank1_busy_until=0.005),
                                                   _two_rank_trace(rank1_busy_until=0.020),
                                                   _two_rank_trace(rank1_busy_until=0.030)], bandwidth)
    assert result["receiver_first"]["count"] == 1 and result["sender_first"]["count"] == 2
    assert result["receiver_first"]["latency_s"] == pytest.approx(0.002)
    assert result["sender_first"]["latency_s"] == pytest.approx(0.002)
    assert result["all"] == {"count": 3, "latency_s": pytest.approx(0.002)}
    none = posting_order_latencies(built.costs, [_two_rank_trace(rank1_busy_until=0.005)], bandwidth)
    assert none["sender_first"] == {"count": 0, "latency_s": None}


def test_a_short_or_drifting_calibration_warns_and_records_its_stability(tmp_path, capsys):
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="1f1b", microbatches=2,
                                  partition="uniform"))
    medians = {(v, kind): 0.01 for v in range(2) for kind in ("F", "B")}
    steady = [_iteration((0.010, 0.010), (0.020, 0.020))] * MIN_STABLE_ITERATIONS
    profile = calibrated_profile(built.plan, built.graph, built.costs, medians, device="cpu", p2p=(1e-4, 1e9),
                                 machine={}, software={}, iterations=len(steady), measured=steady)
    assert capsys.readouterr().err == ""
    assert profile["method"]["stability"]["iterations"] == MIN_STABLE_ITERATIONS
    assert set(profile["p2p"]["latency_by_posting_order"]) == {"receiver_first", "sender_first", "all"}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(profile))
    assert load_profile(path).p2p_latency_s == pytest.approx(1e-4)  # the extra fields leave the reader unmoved

    drift = 2 * MAX_HALF_DRIFT  # the second half's F is this much slower
    drifting = [_iteration((0.010, 0.010), (0.020, 0.020))] * 2 + [_iteration((0.010 * (1 + drift),) * 2,
                                                                              (0.020, 0.020))] * 2
    calibrated_profile(built.plan, built.graph, built.costs, medians, device="cpu", p2p=None, machine={},
                       software={}, iterations=len(drifting), measured=drifting)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("warning: calibrated over 4 iteration(s)")
    assert err[1].startswith("warning: a stage's median moved by")


def _dispatch_trace(gaps, *, received_in=None):
    """Rank 0 runs F ops of 10 ms separated by ``gaps`` (s); a RECV of rank 0 ends inside gap ``received_in``."""
    spans, t = [], 0.0
    for i, gap in enumerate([*gaps, 0.0]):
        spans.append(Span(f"0F{i}", "F", 0, "compute", t, t + 0.010, 0, i))
        t += 0.010
        if i == received_in:
            spans.append(Span(f"0RECV_B{i}", "RECV_B", 0, "recv", t, t + gap / 2, 0, i, i, 1))
        t += gap
    return Trace.from_spans(spans, ["cpu"])


def test_dispatch_time_is_the_median_gap_where_the_rank_did_not_wait():
    # Gaps 0.2, 0.4, 0.3 ms and one of 5 ms during which a receive completed (a wait, not dispatch): median 0.3 ms.
    trace = _dispatch_trace([0.0002, 0.0004, 0.0003, 0.005], received_in=3)
    assert dispatch_time([trace]) == pytest.approx(0.0003)
    assert dispatch_time([]) == 0.0


def test_a_calibration_charges_the_dispatch_time_to_every_op():
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="1f1b", microbatches=2,
                                  partition="uniform"))
    medians = {(0, "F"): 0.01, (0, "B"): 0.02, (0, "OPT_STEP"): 0.001, (1, "F"): 0.012, (1, "B"): 0.024}
    measured = [_dispatch_trace([0.0005, 0.0005])] * MIN_STABLE_ITERATIONS
    profile = calibrated_profile(built.plan, built.graph, built.costs, medians, device="cpu", p2p=None,
                                 machine={}, software={}, iterations=len(measured), measured=measured)
    assert profile["method"]["dispatch_s"] == pytest.approx(0.0005)
    for v, (start, end) in enumerate(built.plan.placement.vstage_layers):
        layers = profile["layers"][start:end]
        assert sum(layer["fwd_s"] for layer in layers) == pytest.approx(medians[(v, "F")] + 0.0005)
        assert sum(layer["bwd_s"] for layer in layers) == pytest.approx(medians[(v, "B")] + 0.0005)
    # A stage without a measured optimizer step stays without one.
    start, end = built.plan.placement.vstage_layers[1]
    assert sum(layer["opt_s"] for layer in profile["layers"][start:end]) == 0.0


def test_the_in_place_latency_is_the_sender_first_one():
    built = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="gpipe", microbatches=1,
                                  partition="uniform"))
    # A sweep with 1 us latency and 1e9 bytes/s, in the executor's (fp32) bytes.
    sizes = [1024, 4096, 16384, 65536]
    sweep = (sizes, [1e-6 + size / 1e9 for size in sizes])
    # One transfer of 1 ms that the receiver waited for, two of 5 ms that waited for the receiver: the latency is the
    # latter's (5 ms less the bytes' time), not the mean over all three.
    early = _two_rank_trace(rank1_busy_until=0.005, crossing=0.001)
    late = _two_rank_trace(rank1_busy_until=0.020, crossing=0.005)
    latency, bandwidth = in_place_p2p(built.plan, built.costs, [early, late, late], sweep)
    graph_bytes = built.costs.message_bytes(OpKind.RECV_F, 1)
    assert latency == pytest.approx(0.005 - graph_bytes / bandwidth)
    # Only receiver-first transfers: their mean is all there is.
    latency_early, _ = in_place_p2p(built.plan, built.costs, [early], sweep)
    assert latency_early == pytest.approx(0.001 - graph_bytes / bandwidth)
    assert bandwidth == pytest.approx(1e9 * graph_bytes / _real_bytes(built.plan), rel=1e-6)


def _real_bytes(plan):
    from executor.nn.stages import boundary_specs

    starts = [start for start, _ in plan.placement.vstage_layers]
    return boundary_specs(plan.model, starts, plan.microbatch_size)[starts[1]].nbytes
