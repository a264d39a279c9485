"""Each invariant of a plan, violated once."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.plan.lower import add_optimizer_steps, add_recompute, add_send_recv, lower, order_receives
from sim.plan.validate import PlanError, check_topology, validate
from sim.schedules import SCHEDULES
from tests.sim.plan.reference_validate import reference_validate


def _plan(rows, m=2, vstage_to_rank=(0, 1)):
    programs = tuple(tuple(Op.parse(x) for x in row.split()) for row in rows)
    n = len(vstage_to_rank)
    return Plan("file", "L0", "uniform:layers=2", f"{n}xideal", m, 1, "flush",
                Placement(tuple((i, i + 1) for i in range(n)), vstage_to_rank), programs)


GOOD = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


def test_good_plan_passes_at_both_levels():
    plan = _plan(GOOD)
    validate(plan)
    validate(lower(plan))


@pytest.mark.parametrize("rows, message", [
    (["0F0 0B0 0B1", "1F0 1B0 1F1 1B1"], r"\(vstage 0, microbatch 1\) has no forward"),
    (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], r"\(vstage 0, microbatch 1\) has no backward"),
    (["0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"], "0B1 appears twice"),
    (["0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"], "0B1 comes before 0F1"),
    (["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"], "1F0 is on rank 0 but vstage 1 is placed on rank 1"),
    (["0F0 0F1 0B0 0B1 0F2 0B2", "1F0 1B0 1F1 1B1"], "microbatch 2 outside 0..1"),
    (["0F0 0F1 0I0 0B1", "1F0 1B0 1F1 1B1"], "0 input-gradient|1 input-gradient"),
    (["0F0 0F1 0B0 0I0 0W0 0B1", "1F0 1B0 1F1 1B1"], "both a full backward"),
])
def test_l0_violations(rows, message):
    with pytest.raises(PlanError, match=message):
        validate(_plan(rows))


def test_deadlock_reports_where_each_rank_waits():
    plan = lower(_plan(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]))
    with pytest.raises(PlanError) as info:
        validate(plan)
    text = str(info.value)
    assert text.startswith("plan deadlocks")
    assert "rank 0: 0F0 0SEND_F0 0RECV_B0 >>0B0<<" in text
    assert "waits for 0RECV_B0 (needs 1SEND_B0 from rank 1, not reached yet)" in text
    assert "rank 1: 1RECV_F0 1F0 1RECV_F1 >>1F1<<" in text


def test_channel_order_must_match_posting_order():
    # Rank 1 consumes microbatch 1 before microbatch 0, but rank 0 sends them in the other order. Receives placed
    # right before their consumers (add_send_recv alone) would be posted out of channel order.
    unordered = add_optimizer_steps(add_send_recv(_plan(["0F0 0F1 0B0 0B1", "1F1 1B1 1F0 1B0"])))
    with pytest.raises(PlanError, match="channel rank 0 → rank 1"):
        validate(unordered)


def test_lowering_posts_receives_in_channel_order():
    l0 = _plan(["0F0 0F1 0B0 0B1", "1F1 1B1 1F0 1B0"])
    plan = lower(l0)
    validate(plan)
    ids = [op.id for op in plan.programs[1]]
    # 1RECV_F0 moved up before 1F1's own receive; everything else keeps its order.
    assert ids[:3] == ["1RECV_F0", "1RECV_F1", "1F1"]
    before = [op.id for op in add_send_recv(l0).programs[1] if "RECV" not in op.id]
    assert [i for i in ids if "RECV" not in i and "OPT_STEP" not in i] == before
    in_order = add_send_recv(_plan(GOOD))
    assert order_receives(in_order) == in_order  # plans already in channel order are untouched


def _edit(plan, rank, pos, op):
    programs = list(plan.programs)
    row = list(programs[rank])
    if op is None:
        del row[pos]
    else:
        row[pos] = op
    programs[rank] = tuple(row)
    return plan.with_programs(tuple(programs), "L1")


def test_unmatched_send_and_missing_dep_are_named():
    plan = lower(_plan(GOOD))
    recv_pos = next(i for i, op in enumerate(plan.programs[1]) if op.kind is OpKind.RECV_F)
    consumer = plan.programs[1][recv_pos + 1]
    without_recv = _edit(plan, 1, recv_pos, None)
    with pytest.raises(PlanError, match="depends on 1RECV_F0, which is in no program"):
        validate(without_recv)
    fixed = _edit(without_recv, 1, recv_pos, Op(consumer.kind, consumer.vstage, consumer.mb))
    with pytest.raises(PlanError, match=r"0SEND_F0 on rank 0 \(pair 0\) has no matching receive"):
        validate(fixed)


def test_wrong_peer_is_rejected():
    plan = lower(_plan(GOOD))
    send = plan.programs[0][1]
    assert send.kind is OpKind.SEND_F
    bad = _edit(plan, 0, 1, Op(send.kind, send.vstage, send.mb, peer=0, pair=send.pair, deps=send.deps))
    with pytest.raises(PlanError, match="names peer 0"):
        validate(bad)


def test_topology_must_have_a_device_for_every_rank():
    plan = _plan(GOOD)  # 2 ranks on "2xideal"
    assert check_topology(plan).num_ranks == 2
    with pytest.raises(PlanError, match=r"^plan has 2 rank programs but its topology '1xideal' has 1 device\(s\)$"):
        check_topology(replace(plan, topology="1xideal"))
    assert check_topology(replace(plan, topology="4xideal")).num_ranks == 4  # extra devices stay idle
    with pytest.raises(SpecError, match="nonsense"):
        check_topology(replace(plan, topology="nonsense"))


# --- the linear-memory checks give the verdict and message of the plain ones they replaced -------------------------


@st.composite
def broken_plans(draw) -> Plan:
    """A generated plan, L0 or lowered, with up to three random edits: ops dropped, repeated, swapped, moved to
    another rank, or given another peer, pair or deps."""
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    entry = SCHEDULES[schedule]
    p = draw(st.integers(2 if entry.chunked else 1, 3))
    m = p * draw(st.integers(1, 2)) if entry.chunked else draw(st.integers(1, 4))
    chunks = 2 if entry.chunked else 1
    l0 = Plan(schedule, "L0", f"uniform:layers={p * chunks}", f"{p}xideal", m, 1, entry.weight_policy,
              Placement(tuple((i, i + 1) for i in range(p * chunks)), entry.vstage_to_rank(p, chunks)),
              entry.build(p, m, chunks))
    plan = lower(add_recompute(l0) if draw(st.booleans()) else l0) if draw(st.booleans()) else l0
    programs = [list(program) for program in plan.programs]
    for _ in range(draw(st.integers(0, 3))):
        rank = draw(st.integers(0, len(programs) - 1))
        if not programs[rank]:
            continue
        pos = draw(st.integers(0, len(programs[rank]) - 1))
        op = programs[rank][pos]
        edit = draw(st.sampled_from(["drop", "repeat", "swap", "move", "peer", "pair", "deps"]))
        if edit == "drop":
            del programs[rank][pos]
        elif edit == "repeat":
            programs[draw(st.integers(0, len(programs) - 1))].insert(draw(st.integers(0, pos)), op)
        elif edit == "swap":
            other = draw(st.integers(0, len(programs[rank]) - 1))
            programs[rank][pos], programs[rank][other] = programs[rank][other], op
        elif edit == "move":
            del programs[rank][pos]
            programs[draw(st.integers(0, len(programs) - 1))].insert(pos, op)
        else:
            ids = [o.id for program in programs for o in program] + ["9F9"]
            value = {"peer": draw(st.none() | st.integers(-1, 3)), "pair": draw(st.none() | st.integers(0, 12)),
                     "deps": tuple(draw(st.lists(st.sampled_from(ids), max_size=2)))}[edit]
            programs[rank][pos] = replace(op, **{edit: value})
    return plan.with_programs(tuple(map(tuple, programs)), plan.level)


def _verdict(check, plan: Plan) -> str | None:
    try:
        check(plan)
    except SpecError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@settings(max_examples=150, deadline=None)
@given(plan=broken_plans())
def test_checks_agree_with_the_reference_on_broken_plans(plan):
    assert _verdict(validate, plan) == _verdict(reference_validate, plan)


def test_a_valid_plan_is_checked_without_caching_an_op_index_on_it():
    plan = lower(_plan(GOOD))
    validate(plan)
    assert plan._index is None  # an id -> position dict per op, kept as long as the plan, is what this avoids
