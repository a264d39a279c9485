"""executor.calibration: how far a calibration can be trusted (stage stability) and its latencies by posting order,
against hand-made traces whose answers are known by construction."""

import json

import pytest

from executor.calibration import (
    MAX_HALF_DRIFT,
    MIN_STABLE_ITERATIONS,
    calibrated_profile,
    posting_order_latencies,
    stage_stability,
)
from sim.cost.profile import load_profile
from sim.ir.plan import OpKind
from sim.ir.trace import Span, Trace
from sim.plan.build import PlanInputs, build_plan

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


def _two_rank_trace(*, rank1_busy_until):
    """F of mb 0 on vstage 0 (rank 0) ends at 10 ms; rank 1 is busy with another op until ``rank1_busy_until`` s,
    then posts RECV_F; the transfer takes 3 ms from the later post; rank 1's F0 follows."""
    produced = 0.010
    start = max(produced, rank1_busy_until)
    spans = [Span("0F0", "F", 0, "compute", 0.0, produced, 0, 0),
             Span("1OTHER", "B", 1, "compute", 0.0, rank1_busy_until, 1, 7),
             Span("0SEND_F0", "SEND_F", 0, "send", start, start + 0.003, 0, 0, 0, 1),
             Span("1RECV_F0", "RECV_F", 1, "recv", start, start + 0.003, 1, 0, 0, 0),
             Span("1F0", "F", 1, "compute", start + 0.003, start + 0.013, 1, 0)]
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
    assert set(profile["p2p"]["latency_by_posting_order"]) == {"receiver_first", "sender_first"}
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
