"""ZB-H1 (``zb1p``, Qi et al., arXiv 2401.10241 §3.1) against a hand-written schedule and its closed forms.

Units: ``uniform:fwd_ms=1,bwd_ms=2`` with one layer per stage gives F = 1 ms and, the backward split in halves
(``sim.cost.cost_view``), I = W = 1 ms: one time unit is 1 ms. ``Nxideal`` links are free.
"""

import pytest

from sim.engine.simpy_engine import simulate
from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.validate import validate
from sim.schedules import SCHEDULES


def _rows(programs):
    return [" ".join(op.id for op in program) for program in programs]


def _simulate(schedule, p, m, **kw):
    built = build_plan(PlanInputs(f"uniform:layers={p},fwd_ms=1,bwd_ms=2", f"{p}xideal", schedule, m,
                                  partition="uniform", **kw))
    return built, simulate(built.plan, built.costs, built.topology)


def test_order_p3_m4_by_hand():
    # Rank r: p−r−1 warm-up F; then per step F (while left), I_k, and from step r on the oldest pending W.
    assert _rows(SCHEDULES["zb1p"].build(3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


def test_exact_timeline_p3_m4():
    # The diagram in sim/schedules/zero_bubble.py, worked by hand: F(s) waits for F(s−1), I(s) for I(s+1) (the last
    # stage's I for its F), W for its own I. Each rank idles p − 1 = 2 units; iteration 3m + p − 1 = 14.
    expected = {
        0: "F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3",
        1: ".  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        2: ".  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    }
    _, result = _simulate("zb1p", 3, 4)
    for rank, row in expected.items():
        got = ["."] * 14
        for span in result.trace.on_rank(rank, "compute"):
            if span.kind in ("F", "I", "W"):
                assert span.duration == pytest.approx(1e-3)
                got[round(span.start * 1e3)] = f"{span.kind}{span.mb}"
        assert got == row.split(), rank
    assert result.trace.makespan == pytest.approx(14e-3, rel=1e-12)


@pytest.mark.parametrize("p", range(1, 7))
def test_makespan_is_3m_plus_p_minus_1_units(p):
    # §3.1: m(T_F + T_B + T_W) + (p − 1)(T_F + T_B − T_W) = 3m + p − 1 at T_F = T_B(= I) = T_W = 1, for m ≥ p;
    # 1F1B on the same model takes 3(m + p − 1), so the bubble shrinks from (p−1)/m to (p−1)/(3m) of the ideal 3m.
    for m in range(p, 3 * p + 3):
        _, result = _simulate("zb1p", p, m)
        trace = result.trace
        assert trace.makespan == pytest.approx((3 * m + p - 1) * 1e-3, rel=1e-12), (p, m)
        for rank in range(p):
            busy = sum(s.duration for s in trace.on_rank(rank, "compute"))
            assert trace.makespan - busy == pytest.approx((p - 1) * 1e-3, abs=1e-12), (p, m, rank)
        ideal = 3 * m * 1e-3
        assert (trace.makespan - ideal) / ideal == pytest.approx((p - 1) / (3 * m), rel=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 4), (6, 6), (3, 7), (4, 2), (1, 3)])
def test_peak_activation_memory_same_as_1f1b_first_stage(p, m):
    # Activations live from F to W. Every rank holds at most min(p, m) microbatches: the first rank exactly what 1F1B
    # holds there (p, Megatron §2.2.1), i.e. the same worst-stage peak (ZB paper §3.1; hardware.md §5). A one-layer
    # uniform stage keeps its input and output per microbatch: 2 × 1 MB.
    built, zb = _simulate("zb1p", p, m)
    _, one_f_one_b = _simulate("1f1b", p, m)
    for rank in range(p):
        state = built.costs.state_bytes(rank)
        assert zb.peak_memory_bytes[rank] - state == min(p, m) * 2e6, rank
    assert zb.peak_memory_bytes[0] == one_f_one_b.peak_memory_bytes[0]
    assert max(zb.peak_memory_bytes) == max(one_f_one_b.peak_memory_bytes)


def test_every_backward_is_split_and_plans_validate_on_real_links():
    for p, m in [(2, 2), (4, 8), (8, 8), (4, 3)]:
        built = build_plan(PlanInputs("gpt:layers=8,hidden=256,seq=128,vocab=1000", f"{p}xV100", "zb1p", m,
                                      partition="uniform"))
        validate(built.plan)
        compute = [op for program in built.plan.programs for op in program if op.kind in (OpKind.B, OpKind.I,
                                                                                          OpKind.W)]
        assert sorted((op.kind.value, op.vstage, op.mb) for op in compute) == sorted(
            (kind, s, mb) for kind in "IW" for s in range(p) for mb in range(m))
        # Only I sends gradients upstream; W has no communication.
        sends = [op for program in built.plan.programs for op in program if op.kind is OpKind.SEND_B]
        assert all(op.deps == (f"{op.vstage}I{op.mb}",) for op in sends) and len(sends) == (p - 1) * m
        assert simulate(built.plan, built.costs, built.topology).trace.makespan > 0
