"""Raw rank timings → measured traces: clock offsets, the transfer rule, shifting, iteration times."""

import pytest

from executor.clock import ClockOffset
from executor.compare import median_iteration
from executor.measured import RankReport, iteration_times, measured_trace
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


def _plan():
    # 2 ranks, 1 microbatch: rank 0 = 0F0 0SEND_F0 0RECV_B0 0B0 0OPT_STEP; rank 1 = 1RECV_F0 1F0 1B0 1SEND_B0 ...
    return build_plan(PlanInputs(model="uniform:layers=2", topology="2xideal", schedule="gpipe", microbatches=1,
                                 partition="uniform")).plan


def _reports(plan, rank1_shift=0.0):
    """Rank 0 clock origin 100 s; rank 1's clock reads rank1_shift less than rank 0's."""
    t = {  # on rank 0's clock
        "0F0": (100.0, 100.010), "0SEND_F0": (100.011, 100.011), "0RECV_B0": (100.012, 100.050),
        "0B0": (100.050, 100.070), "0OPT_STEP": (100.070, 100.072),
        "1RECV_F0": (100.001, 100.013), "1F0": (100.013, 100.023), "1B0": (100.023, 100.043),
        "1SEND_B0": (100.044, 100.044), "1OPT_STEP": (100.045, 100.047),
    }
    reports = []
    for rank, program in enumerate(plan.programs):
        shift = rank1_shift if rank == 1 else 0.0
        timings = tuple((op.id, t[op.id][0] - shift, t[op.id][1] - shift) for op in program)
        reports.append(RankReport(rank, "cpu", 1, (timings,), ((0.5,),) if rank == 1 else ((),)))
    return reports


def test_transfers_start_when_both_sides_posted_and_end_on_arrival():
    plan = _plan()
    assert {op.id for op in plan.programs[0]} >= {"0SEND_F0", "0RECV_B0"}
    trace = measured_trace(plan, _reports(plan), [ClockOffset(0, 0), ClockOffset(0, 0)], 0)
    spans = {s.op: s for s in trace.spans}
    assert spans["0F0"].start == 0.0  # shifted to the iteration's first op
    # Forward: sender posted at 11 ms, receiver at 1 ms, data there at 13 ms.
    assert (spans["0SEND_F0"].start, spans["0SEND_F0"].end) == pytest.approx((0.011, 0.013))
    assert (spans["1RECV_F0"].start, spans["1RECV_F0"].end) == pytest.approx((0.011, 0.013))
    # Backward: receiver posted at 12 ms and waited, sender posted at 44 ms, arrival 50 ms.
    assert (spans["0RECV_B0"].start, spans["0RECV_B0"].end) == pytest.approx((0.044, 0.050))
    assert spans["1SEND_B0"].stream == "send" and spans["0RECV_B0"].stream == "recv"
    assert trace.makespan == pytest.approx(0.072)
    assert trace.meta["source"] == "executor"


def test_clock_offsets_put_ranks_on_one_axis():
    plan = _plan()
    aligned = measured_trace(plan, _reports(plan), [ClockOffset(0, 0), ClockOffset(0, 0)], 0)
    shifted = measured_trace(plan, _reports(plan, rank1_shift=7.5), [ClockOffset(0, 0), ClockOffset(7.5, 0)], 0)
    assert [(s.op, round(s.start, 9), round(s.end, 9)) for s in aligned.spans] == \
        [(s.op, round(s.start, 9), round(s.end, 9)) for s in shifted.spans]


def test_reports_must_match_the_plan():
    plan = _plan()
    reports = _reports(plan)
    bad = RankReport(1, "cpu", 1, ((("0F0", 0.0, 1.0),),), ((),))
    with pytest.raises(ValueError, match="not in its program"):
        measured_trace(plan, [reports[0], bad], [ClockOffset(0, 0)] * 2, 0)
    with pytest.raises(ValueError, match="iterations"):
        measured_trace(plan, reports, [ClockOffset(0, 0)] * 2, 1)


def test_iteration_times_and_median():
    plan = _plan()
    assert iteration_times(plan, _reports(plan), [ClockOffset(0, 0)] * 2) == pytest.approx([0.072])
    assert median_iteration([9.0, 3.0, 2.0, 4.0], warmup=1) == (1, 3.0)  # median of 3, 2, 4 is iteration 1
    assert median_iteration([9.0, 3.0, 2.0, 4.0, 1.0], warmup=1) == (2, 2.0)  # lower median of 3, 2, 4, 1
    assert median_iteration([9.0, 5.0, 2.0, 5.0, 7.0], warmup=1) == (1, 5.0)  # of 5, 2, 5, 7; a tie: the earliest
    with pytest.raises(ValueError):
        median_iteration([1.0], warmup=1)


def test_a_measured_trace_splits_as_a_simulated_one():
    # The same definition (sim.report.metrics): worked by hand from the timings above, in ms after the shift.
    # Rank 0: F 0-10, SEND_F 11-13, RECV_B 44-50, B 50-70, OPT_STEP 70-72: compute 32, p2p 2 + 6, bubble 1 + 31.
    # Rank 1: RECV_F 11-13, F 13-23, B 23-43, SEND_B 44-50 under OPT_STEP 45-47: compute 32, p2p 2 + 1 + 3,
    # bubble 11 + 1 + 22.
    from sim.report.metrics import compute_metrics

    plan = _plan()
    trace = measured_trace(plan, _reports(plan), [ClockOffset(0, 0), ClockOffset(0, 0)], 0)
    metrics = compute_metrics(trace, num_microbatches=1, microbatch_size=1)
    d0, d1 = metrics["devices"]
    assert (d0["busy_s"], d1["busy_s"]) == pytest.approx((0.032, 0.032))
    assert (d0["exposed_comm_fraction"]["pp"], d1["exposed_comm_fraction"]["pp"]) == pytest.approx((8 / 72, 6 / 72))
    assert (d0["bubble_fraction"], d1["bubble_fraction"]) == pytest.approx((32 / 72, 34 / 72))
    assert metrics["idle_fraction"] == pytest.approx(1 - 64 / 144)
    assert metrics["bubble_fraction"] == pytest.approx(66 / 144)
