"""Where a device's time goes (``sim.report.metrics.time_split``): compute, pipeline bubble and exposed communication
by kind, against timelines worked out by hand, GPipe's and Megatron's closed forms, and a brute-force sweep of the
definition on simulated plans of every kind of parallelism."""

import pytest

from sim.ir.ops import OP_SEMANTICS, Action
from sim.ir.trace import Span, Trace
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.metrics import COMM_KINDS, compute_metrics, split_text, time_split

MOE = ("moe:layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,ffn=96,expert_ffn=32,experts=4,topk=2,vocab=100,"
       "seq=32")


def _span(op, kind, rank, start, end):
    return Span(op, kind, rank, OP_SEMANTICS[kind].stream if kind in {k.value for k in OP_SEMANTICS} else "compute",
                start, end, 0, 0)


def _metrics(spans, ranks):
    return compute_metrics(Trace.from_spans(spans, ["d"] * ranks), num_microbatches=1, microbatch_size=1)


def test_every_action_but_compute_is_a_kind_of_communication():
    # Derived from the op table: a new communicating action must be given a kind, or the module refuses to import.
    kinds = {kind.value for kind, semantics in OP_SEMANTICS.items() if semantics.action is not Action.COMPUTE}
    assert kinds == {"TP_F", "TP_B", "TP_R", "EP_F", "EP_B", "EP_R", "SEND_F", "SEND_B", "RECV_F", "RECV_B",
                     "PREFETCH", "EVICT", "REDUCE_GRAD", "GATHER_PARAMS"}
    assert set(COMM_KINDS) == {"tp", "ep", "pp", "dp", "host_copy"}


def test_two_stage_gpipe_with_a_tp_all_reduce_by_hand():
    # GPipe, 2 stages, 2 microbatches; F 1 ms followed by its TP all-reduce of 0.5 ms (the compute stream waits for
    # it), B 2 ms; the activation's transfer 0.25 ms, the gradient's 0.25 ms; a gradient reduction of 1 ms issued
    # after rank 0's last B and overlapped by nothing. Times in ms:
    #   rank 0: F0 0-1, TP 1-1.5, F1 1.5-2.5, TP 2.5-3 | SEND_F0 1.5-1.75, SEND_F1 3-3.25 |
    #           B1 7.5-9.5 (its gradient arrives 7.25-7.5), B0 11.75-13.75 (arrives 11.5-11.75) | REDUCE 13.75-14.75
    #   rank 1: RECV_F0 1.5-1.75, F0 1.75-2.75, TP 2.75-3.25, RECV_F1 3-3.25, F1 3.25-4.25, TP 4.25-4.75,
    #           B1 4.75-6.75, B0 6.75-8.75, and the two SEND_B at their RECV_B's times
    ms = 1e-3
    r0 = [("F", 0, 1), ("TP_F", 1, 1.5), ("F", 1.5, 2.5), ("TP_F", 2.5, 3), ("SEND_F", 1.5, 1.75),
          ("SEND_F", 3, 3.25), ("RECV_B", 7.25, 7.5), ("B", 7.5, 9.5), ("RECV_B", 11.5, 11.75), ("B", 11.75, 13.75),
          ("REDUCE_GRAD", 13.75, 14.75)]
    r1 = [("RECV_F", 1.5, 1.75), ("F", 1.75, 2.75), ("TP_F", 2.75, 3.25), ("RECV_F", 3, 3.25), ("F", 3.25, 4.25),
          ("TP_F", 4.25, 4.75), ("B", 4.75, 6.75), ("B", 6.75, 8.75), ("SEND_B", 7.25, 7.5), ("SEND_B", 11.5, 11.75)]
    spans = [_span(f"{i}{kind}", kind, rank, a * ms, b * ms)
             for rank, ops in enumerate((r0, r1)) for i, (kind, a, b) in enumerate(ops)]
    metrics = _metrics(spans, 2)
    total = 14.75
    d0, d1 = metrics["devices"]
    # rank 0: compute 1 + 1 + 2 + 2 = 6; TP 0.5 + 0.5 exposed; SEND_F0 under F1, SEND_F1 3-3.25 exposed (after the
    # TP ends at 3); both RECV_B exposed (0.25 each); REDUCE 1 exposed; bubble the rest.
    assert d0["busy_s"] == pytest.approx(6 * ms)
    assert d0["exposed_comm_fraction"] == pytest.approx({"tp": 1 / total, "ep": 0.0, "pp": 0.75 / total,
                                                         "dp": 1 / total, "host_copy": 0.0})
    assert d0["bubble_fraction"] == pytest.approx((total - 6 - 1 - 0.75 - 1) / total)
    # rank 1: RECV_F0 1.5-1.75 exposed; RECV_F1 3-3.25 runs beside a TP: counted once, as TP (the blocking kind
    # first); SEND_B 7.25-7.5 runs under B0, SEND_B 11.5-11.75 is exposed; the head before 1.5 and the tail after
    # 11.75 are bubble.
    assert d1["busy_s"] == pytest.approx(6 * ms)
    assert d1["exposed_comm_fraction"] == pytest.approx({"tp": 1 / total, "ep": 0.0, "pp": 0.5 / total,
                                                         "dp": 0.0, "host_copy": 0.0})
    assert d1["bubble_fraction"] == pytest.approx((total - 6 - 1 - 0.5) / total)
    # The plan's fractions are the devices' time summed over (devices × iteration).
    assert metrics["bubble_fraction"] == pytest.approx((total - 8.75 + total - 7.5) / (2 * total))
    assert metrics["exposed_comm_fraction"]["dp"] == pytest.approx(1 / (2 * total))
    # idle is what bubble_fraction meant before: 1 − busy ÷ time
    assert metrics["idle_fraction"] == pytest.approx(1 - 12 / (2 * total))
    for fractions in (d0, d1):
        assert (fractions["busy_s"] / metrics["iteration_time_s"] + fractions["bubble_fraction"]
                + sum(fractions["exposed_comm_fraction"].values())) == pytest.approx(1, abs=1e-12)


def test_communication_under_compute_is_not_exposed_and_a_kind_outside_the_table_goes_by_its_stream():
    spans = [Span("0F0", "F", 0, "compute", 0.0, 4.0, 0, 0),
             Span("0REDUCE_GRAD", "REDUCE_GRAD", 0, "collective", 1.0, 5.0, 0, None),  # 1 s sticks out
             Span("0PREFETCH", "PREFETCH", 0, "h2d", 4.5, 6.0, 0, None),  # 4.5-5 under the reduction
             Span("0CHECKPOINT0", "CHECKPOINT", 0, "compute", 7.0, 8.0, 0, 0)]  # the CSP executor's kind: compute
    (split,) = time_split(Trace.from_spans(spans, ["d"]))
    assert split.compute_s == 5.0
    assert split.exposed_s == {"tp": 0.0, "ep": 0.0, "pp": 0.0, "dp": 1.0, "host_copy": 1.0}
    assert split.bubble_s == 1.0


def test_an_empty_trace_has_nothing_to_split():
    metrics = _metrics([], 2)
    assert metrics["bubble_fraction"] == metrics["idle_fraction"] == 0.0
    assert set(metrics["exposed_comm_fraction"].values()) == {0.0}


@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1)])
def test_on_free_links_the_bubble_is_the_closed_form_and_nothing_is_exposed(schedule, chunks):
    # GPipe §2.3, Megatron-LM SC'21 §2.2.2: uniform stages on free links, bubble ÷ total = (p − 1)/(v·m + p − 1);
    # ZB-H1 (Qi et al. 2024 §3): (p − 1)(T_F + T_B − T_W) of 3m·T + (p − 1)(T_F + T_B − T_W), T_F = T_B = T_W.
    p, m = 4, 8
    built = build_plan(PlanInputs(f"uniform:layers={p * chunks},fwd_ms=1,bwd_ms=2", f"{p}xideal", schedule, m,
                                  chunks=chunks, partition="uniform"))
    metrics = predict_built(built).metrics
    closed = (p - 1) / (chunks * m + p - 1) if schedule != "zb1p" else (p - 1) / (3 * m + (p - 1))
    assert metrics["bubble_fraction"] == pytest.approx(closed, abs=1e-12)
    assert metrics["idle_fraction"] == pytest.approx(closed, abs=1e-12)
    assert set(metrics["exposed_comm_fraction"].values()) == {0.0}


def _brute_force(trace):
    """The definition swept over every elementary interval between span boundaries, each classified by its midpoint
    against every span of the rank: (compute, {kind: exposed}, bubble) per rank, s."""
    from sim.report.metrics import _class_of_span

    start = min(s.start for s in trace.spans)
    end = start + trace.makespan
    out = []
    for rank in range(trace.num_ranks):
        spans = [s for s in trace.spans if s.rank == rank]
        cuts = sorted({start, end, *(s.start for s in spans), *(s.end for s in spans)})
        compute, exposed, bubble = 0.0, dict.fromkeys(COMM_KINDS, 0.0), 0.0
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            running = {_class_of_span(s) for s in spans if s.start < mid < s.end}
            if -1 in running:
                compute += b - a
            elif running:
                exposed[COMM_KINDS[min(running)]] += b - a
            else:
                bubble += b - a
        out.append((compute, exposed, bubble))
    return out


PLANS = {
    "1f1b": PlanInputs("gpt:layers=8,hidden=256,heads=4,seq=128,vocab=1000", "4xA100", "1f1b", 8),
    "interleaved": PlanInputs("gpt:layers=8,hidden=256,heads=4,seq=128,vocab=1000", "4xV100", "interleaved", 8,
                              chunks=2),
    "zb1p": PlanInputs("gpt:layers=8,hidden=256,heads=4,seq=128,vocab=1000", "4xV100", "zb1p", 8),
    "tp-dp-pp": PlanInputs("gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000", "2x4xA100", "1f1b", 4, tp=2, dp=2,
                           pp=2, zero=1, sequence_parallel=True),
    "ep-moe": PlanInputs(MOE, "8xA100", "zb1p", 4, tp=2, ep=2, sequence_parallel=True),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_split_is_the_definition_and_sums_to_the_whole(name):
    prediction = predict_built(build_plan(PLANS[name]))
    trace, metrics = prediction.trace, prediction.metrics
    iteration = metrics["iteration_time_s"]
    for split, (compute, exposed, bubble), device in zip(time_split(trace), _brute_force(trace), metrics["devices"],
                                                          strict=True):
        assert split.compute_s == pytest.approx(compute, rel=1e-9, abs=1e-15)
        assert split.exposed_s == pytest.approx(exposed, rel=1e-9, abs=1e-15)
        assert split.bubble_s == pytest.approx(bubble, rel=1e-9, abs=1e-15)
        assert split.compute_s == pytest.approx(device["busy_s"], rel=1e-12)  # compute spans never overlap
        whole = device["busy_s"] / iteration + device["bubble_fraction"] + sum(device["exposed_comm_fraction"].values())
        assert whole == pytest.approx(1, abs=1e-9)
        assert device["idle_fraction"] == pytest.approx(1 - device["busy_s"] / iteration, abs=1e-15)
    exposed = metrics["exposed_comm_fraction"]
    plan_whole = 1 - metrics["idle_fraction"] + metrics["bubble_fraction"] + sum(exposed.values())
    assert plan_whole == pytest.approx(1, abs=1e-9)
    if name == "tp-dp-pp":
        assert exposed["tp"] > 0 and exposed["dp"] > 0
    if name == "ep-moe":
        assert exposed["ep"] > 0 and exposed["tp"] > 0
    assert split_text(metrics).startswith(f"compute {(1 - metrics['idle_fraction']) * 100:.1f} % · bubble ")
