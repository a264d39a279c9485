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
from tests.sim.plan.reference_validate import RULES, reference_accepts, reference_violations


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


# --- an oracle written from the IR's definitions (tests/sim/plan/reference_validate.py) ------------------------------


def _lowered_good():
    return lower(_plan(GOOD))


def _replace_op(plan, op_id, **fields):
    """The plan with the op ``op_id`` given other fields, wherever it stands."""
    return plan.with_programs(tuple(tuple(replace(op, **fields) if op.id == op_id else op for op in program)
                                    for program in plan.programs), plan.level)


def _renamed_receives(plan, first, second):
    """The receives ``first`` and ``second`` trade names (kind, vstage, mb) everywhere, deps included, keeping
    their pair ids, peers and places: the plan runs as before, but each receive names the other microbatch."""
    swap = {first: second, second: first}
    ops = {op.id: op for program in plan.programs for op in program}

    def rename(op):
        deps = tuple(swap.get(dep, dep) for dep in op.deps)
        if op.id in swap:
            other = ops[swap[op.id]]
            return replace(op, kind=other.kind, vstage=other.vstage, mb=other.mb, deps=deps)
        return replace(op, deps=deps)
    return plan.with_programs(tuple(tuple(rename(op) for op in program) for program in plan.programs), plan.level)


def _swapped_send_pairs(plan, first, second):
    """The sends ``first`` and ``second`` trade pair ids and places: each channel still posts the pair ids in the
    receiver's order, but each pair id now joins a microbatch's receive with the other microbatch's send."""
    ops = {op.id: op for program in plan.programs for op in program}
    a, b = ops[first], ops[second]
    moved = {first: replace(b, pair=a.pair), second: replace(a, pair=b.pair)}
    return plan.with_programs(tuple(tuple(moved.get(op.id, op) for op in program) for program in plan.programs),
                              plan.level)


def _op(plan, op_id):
    return next(op for program in plan.programs for op in program if op.id == op_id)


def _without(plan, op_id):
    return plan.with_programs(tuple(tuple(op for op in program if op.id != op_id) for program in plan.programs),
                              plan.level)


def _inserted(plan, rank, pos, op):
    programs = [list(program) for program in plan.programs]
    programs[rank].insert(pos, op)
    return plan.with_programs(tuple(map(tuple, programs)), plan.level)


#: One plant per rule of the oracle (several where the docs state the rule in several parts): every rule the broken
#: plan breaks (a send the transport cannot match also shifts its channel's order; the replay runs only once the
#: message rules hold) and the plan. Each starts from GOOD, or GOOD lowered, which both checks accept.
PLANTS = {
    "three programs, two placed ranks": ("rank-count", lambda: _plan(GOOD + [""])),
    "vstage 2 of 2": ("vstage-range", lambda: _plan(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 2F0"])),
    "microbatch 2 of 2": ("microbatch-range", lambda: _plan(["0F0 0F1 0B0 0B1 0F2", "1F0 1B0 1F1 1B1"])),
    "1F0 on rank 0": ("placement", lambda: _plan(["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"])),
    "0B1 twice": ("once", lambda: _plan(["0F0 0F1 0B0 0B1 0B1", "1F0 1B0 1F1 1B1"])),
    "no 0F1": ("forward", lambda: _plan(["0F0 0B0 0B1", "1F0 1B0 1F1 1B1"])),
    "no backward of 0,1": ("backward", lambda: _plan(["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"])),
    "0I1 without 0W1": ("backward", lambda: _plan(["0F0 0F1 0B0 0I1", "1F0 1B0 1F1 1B1"])),
    "0B0 and 0I0 0W0": ("backward", lambda: _plan(["0F0 0F1 0B0 0I0 0W0 0B1", "1F0 1B0 1F1 1B1"])),
    "0B1 before 0F1": ("compute-order", lambda: _plan(["0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"])),
    "0W1 before 0I1": ("compute-order", lambda: _plan(["0F0 0F1 0B0 0W1 0I1", "1F0 1B0 1F1 1B1"])),
    "0R0 after 0B0": ("compute-order", lambda: _plan(["0F0 0F1 0B0 0R0 0B1", "1F0 1B0 1F1 1B1"])),
    "0OPT_STEP twice": ("unique-id", lambda: _inserted(_lowered_good(), 0, 0, Op.parse("0OPT_STEP"))),
    "a dep on 9F9": ("dep-exists", lambda: _replace_op(_lowered_good(), "1F1", deps=("9F9",))),
    "a send to its own rank": ("endpoint matched channel-order", lambda: _replace_op(
        _lowered_good(), "0SEND_F0", peer=0)),
    "a send to rank 2 of 2": ("endpoint matched channel-order", lambda: _replace_op(
        _lowered_good(), "0SEND_F0", peer=2)),
    "a receive without a pair id": ("endpoint matched channel-order", lambda: _replace_op(
        _lowered_good(), "1RECV_F0", pair=None)),
    "a send without its receive": ("matched channel-order", lambda: _replace_op(
        _without(_lowered_good(), "1RECV_F0"), "1F0", deps=())),
    "two sends with one pair id": ("matched", lambda: _replace_op(
        _lowered_good(), "0SEND_F1", pair=_op(_lowered_good(), "0SEND_F0").pair)),
    "receives renamed": ("same-message", lambda: _renamed_receives(_lowered_good(), "1RECV_F0", "1RECV_F1")),
    "send pairs swapped": ("same-message", lambda: _swapped_send_pairs(_lowered_good(), "0SEND_F0", "0SEND_F1")),
    "receives posted out of order": ("channel-order", lambda: add_optimizer_steps(add_send_recv(
        _plan(["0F0 0F1 0B0 0B1", "1F1 1B1 1F0 1B0"])))),
    "1F1 waits for 0F1, sent after 0B0": ("no-deadlock", lambda: lower(
        _plan(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]))),
    "an op waiting for itself": ("no-deadlock", lambda: _replace_op(_lowered_good(), "0B1", deps=("0B1",))),
}


def test_the_oracle_accepts_the_unbroken_plants():
    assert reference_violations(_plan(GOOD)) == []
    assert reference_violations(_lowered_good()) == []


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_the_oracle_names_the_rules_each_plant_breaks(name):
    rules, build = PLANTS[name]
    assert {violation.rule for violation in reference_violations(build())} == set(rules.split())


def test_every_rule_of_the_oracle_has_a_plant():
    assert {rule for rules, _ in PLANTS.values() for rule in rules.split()} == set(RULES)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_validate_rejects_each_plant(name):
    with pytest.raises(SpecError):  # PlanError, or SpecError for an id that appears twice
        validate(PLANTS[name][1]())


def _generated(schedule: str, p: int, m: int) -> Plan:
    """The L0 plan of a schedule generator on p ranks (two vstages each where the schedule is chunked, and the
    schedule's own count where it fixes one)."""
    entry = SCHEDULES[schedule]
    chunks = 2 if entry.chunked else 1
    vstages = p * entry.chunks_per_rank(chunks)
    return Plan(schedule, "L0", f"uniform:layers={vstages}", f"{p}xideal", m, 1, entry.weight_policy,
                Placement(tuple((i, i + 1) for i in range(vstages)), entry.vstage_to_rank(p, chunks)),
                entry.build(p, m, chunks))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("recompute", [False, True])
def test_the_oracle_accepts_every_generated_plan(schedule, recompute):
    l0 = _generated(schedule, 3, 6)
    assert reference_violations(l0) == []
    assert reference_violations(lower(add_recompute(l0) if recompute else l0)) == []


@st.composite
def broken_plans(draw) -> Plan:
    """A generated plan, L0 or lowered, with up to three random edits: ops dropped, repeated, swapped, moved to
    another rank, or given another peer, pair or deps."""
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    entry = SCHEDULES[schedule]
    p = draw(st.integers(2 if entry.chunked else 1, 3))
    if entry.chunked:
        m = p * draw(st.integers(1, 2))
    elif entry.fixed_chunks > 1:  # DualPipeV: m >= 2p
        m = entry.fixed_chunks * p + draw(st.integers(0, 2))
    else:
        m = draw(st.integers(1, 4))
    l0 = _generated(schedule, p, m)
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


@st.composite
def rewired_plans(draw) -> Plan:
    """A lowered generated plan whose messages stay sound, with one to three ops given an extra dep on another op
    of the plan: what the replay alone decides (most random edits break a rule before it)."""
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(2, 3))
    # a multiple of p (interleaved), at least 2p where the schedule fixes two stages per rank (DualPipeV)
    l0 = _generated(schedule, p, p * draw(st.integers(SCHEDULES[schedule].fixed_chunks, 2)))
    plan = lower(add_recompute(l0) if draw(st.booleans()) else l0)
    programs = [list(program) for program in plan.programs]
    ids = [op.id for program in programs for op in program]
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(0, p - 1))
        pos = draw(st.integers(0, len(programs[rank]) - 1))
        op = programs[rank][pos]
        programs[rank][pos] = replace(op, deps=op.deps + (draw(st.sampled_from(ids)),))
    return plan.with_programs(tuple(map(tuple, programs)), plan.level)


def _accepted_by_validate(plan: Plan) -> bool:
    try:
        validate(plan)
    except SpecError:
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(plan=broken_plans())
def test_checks_agree_with_the_oracle_on_broken_plans(plan):
    assert _accepted_by_validate(plan) == reference_accepts(plan)


@settings(max_examples=60, deadline=None)
@given(plan=rewired_plans())
def test_the_deadlock_check_agrees_with_the_oracles_replay(plan):
    assert _accepted_by_validate(plan) == reference_accepts(plan)


def test_a_valid_plan_is_checked_without_caching_an_op_index_on_it():
    plan = lower(_plan(GOOD))
    validate(plan)
    assert plan._index is None  # an id -> position dict per op, kept as long as the plan, is what this avoids
