"""Lowering, written out in the string notation."""

from sim.ir.ops import op_id
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.plan.lower import lower
from sim.schedules import SCHEDULES


def _plan(name, p, m, vstage_to_rank=None):
    programs = SCHEDULES[name].build(p, m)
    return Plan(name, "L0", "uniform:layers=8", f"{p}xideal", m, 1, "flush",
                Placement(tuple((i, i + 1) for i in range(p)), vstage_to_rank or tuple(range(p))), programs)


def test_1f1b_two_stages_exact_l1_programs():
    l1 = lower(_plan("1f1b", 2, 2))
    assert [" ".join(op.id for op in program) for program in l1.programs] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0OPT_STEP",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT_STEP",
    ]


def test_deps_and_pairs_connect_producer_to_consumer():
    l1 = lower(_plan("gpipe", 2, 1))
    ops = {op.id: op for program in l1.programs for op in program}
    assert ops["0SEND_F0"].deps == ("0F0",) and ops["0SEND_F0"].peer == 1
    assert ops["1RECV_F0"].deps == ("0SEND_F0",) and ops["1RECV_F0"].peer == 0
    assert ops["1F0"].deps == ("1RECV_F0",)
    assert ops["0B0"].deps == ("0RECV_B0",)
    assert ops["0SEND_F0"].pair == ops["1RECV_F0"].pair != ops["1SEND_B0"].pair == ops["0RECV_B0"].pair


def test_recv_is_placed_right_before_its_consumer():
    l1 = lower(_plan("1f1b", 4, 8))
    for program in l1.programs:
        for pos, op in enumerate(program):
            if op.kind in (OpKind.RECV_F, OpKind.RECV_B):
                consumer = program[pos + 1]
                assert op.id in consumer.deps, f"{op.id} is followed by {consumer.id}"


def test_same_rank_neighbours_get_a_dep_not_a_transfer():
    # Two vstages on one rank hand the tensor over in memory.
    programs = ((Op.parse("0F0"), Op.parse("1F0"), Op.parse("1B0"), Op.parse("0B0")),)
    plan = Plan("file", "L0", "uniform:layers=2", "1xideal", 1, 1, "flush",
                Placement(((0, 1), (1, 2)), (0, 0)), programs)
    l1 = lower(plan)
    assert [op.id for op in l1.programs[0]] == ["0F0", "1F0", "1B0", "1OPT_STEP", "0B0", "0OPT_STEP"]
    assert l1.programs[0][1].deps == ("0F0",)
    assert l1.programs[0][4].deps == ("1B0",)


def test_one_opt_step_per_stage_after_its_last_backward():
    l1 = lower(_plan("gpipe", 3, 4))
    for program in l1.programs:
        steps = [pos for pos, op in enumerate(program) if op.kind is OpKind.OPT_STEP]
        assert len(steps) == 1
        last_backward = max(pos for pos, op in enumerate(program) if op.kind is OpKind.B)
        assert steps[0] > last_backward
        assert all(op.kind is OpKind.SEND_B for op in program[last_backward + 1:steps[0]])


def test_op_id_spells_ops_as_op_id_does():
    # op_id builds the string notation without an Op; Op.id is its definition.
    for kind in OpKind:
        for vstage, mb in ((0, None), (0, 0), (3, 7), (12, 34567)):
            assert op_id(kind, vstage, mb) == Op(kind, vstage, mb).id
