"""The op notation and the plan's canonical JSON."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.ir.plan import Op, OpKind, Placement, Plan


@pytest.mark.parametrize("text, kind, vstage, mb", [
    ("2F0", OpKind.F, 2, 0),
    ("13B127", OpKind.B, 13, 127),
    ("0I4", OpKind.I, 0, 4),
    ("1W4", OpKind.W, 1, 4),
    ("3SEND_F1", OpKind.SEND_F, 3, 1),
    ("0RECV_B2", OpKind.RECV_B, 0, 2),
    ("5OPT_STEP", OpKind.OPT_STEP, 5, None),
])
def test_parse_pytorch_action_syntax(text, kind, vstage, mb):
    op = Op.parse(text)
    assert (op.kind, op.vstage, op.mb) == (kind, vstage, mb)
    assert op.id == text == str(op)


@given(st.sampled_from(list(OpKind)), st.integers(0, 999), st.one_of(st.none(), st.integers(0, 9999)))
def test_op_string_round_trips(kind, vstage, mb):
    op = Op(kind, vstage, mb)
    assert Op.parse(op.id) == op


@pytest.mark.parametrize("bad", ["", "F0", "2X0", "2F-1", "-1F0", "2 F0", "2F0x", "SEND_F1"])
def test_parse_rejects_non_ops_with_the_text(bad):
    with pytest.raises(SpecError, match="not an op"):
        Op.parse(bad)


def _plan(programs, level="L1"):
    return Plan("1f1b", level, "uniform:layers=2", "2xideal", 2, 1, "flush",
                Placement(((0, 1), (1, 2)), (0, 1)), programs, (("partition", "uniform"),))


def test_plan_json_round_trip_keeps_l1_fields():
    programs = (
        (Op.parse("0F0"), Op(OpKind.SEND_F, 0, 0, peer=1, pair=0, deps=("0F0",))),
        (Op(OpKind.RECV_F, 1, 0, peer=0, pair=0, deps=("0SEND_F0",)), Op(OpKind.F, 1, 0, deps=("1RECV_F0",))),
    )
    plan = _plan(programs)
    text = plan.dumps()
    again = Plan.loads(text)
    assert again == plan
    assert again.dumps() == text
    assert again.option("partition") == "uniform"


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ("{}", "not a pipedejavu plan"),
    ('{"format": "pipedejavu-plan", "format_version": 99}', "format_version 99"),
    ('{"format": "pipedejavu-plan", "format_version": 1}', "not a valid plan"),
])
def test_plan_loads_rejects_malformed_text(text, message):
    with pytest.raises(SpecError, match=message):
        Plan.loads(text, source="x.json")


def test_duplicate_op_ids_are_rejected():
    plan = _plan(((Op.parse("0F0"),), (Op.parse("0F0"),)), level="L0")
    with pytest.raises(SpecError, match="appears twice"):
        plan.op_index()


def test_placement_must_be_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        Placement(((0, 2), (3, 4)), (0, 1))


@pytest.mark.parametrize("path,key", [((), "typo_field"), (("placement",), "ranks"), (("ranks", 0, 0), "stream")])
def test_a_plan_file_with_an_unknown_field_is_refused_by_name(path, key):
    """A misspelt or invented field must not be ignored silently: the plan would run without what it asks for."""
    import json

    plan = Plan("gpipe", "L0", "uniform:layers=2", "2xideal", 1, 1, "flush", Placement(((0, 1), (1, 2)), (0, 1)),
                ((Op.parse("0F0"),), (Op.parse("1F0"),)))
    data = json.loads(plan.dumps())
    target = data
    for step in path:
        target = target[step]
    target[key] = 1
    with pytest.raises(SpecError, match=f"unknown field\\(s\\) '{key}'"):
        Plan.loads(json.dumps(data))
    assert Plan.loads(plan.dumps()) == plan  # the unedited file reads back


def test_the_subnet_table_is_written_only_when_present():
    plan = Plan("gpipe", "L0", "uniform:layers=1", "1xideal", 1, 1, "flush", Placement(((0, 1),), (0,)),
                ((Op.parse("0F0"),),))
    assert '"subnets"' not in plan.dumps()
    with_table = Plan.loads(plan.dumps().replace('"schedule"', '"subnets": [[0, 1], [1, 0]],\n "schedule"'))
    assert with_table.subnets == ((0, 1), (1, 0)) and '"subnets"' in with_table.dumps()
    with pytest.raises(SpecError, match="subnets must be a list"):
        Plan.loads(plan.dumps().replace('"schedule"', '"subnets": [[-1]],\n "schedule"'))


def test_the_streamed_text_is_the_text():
    """``iter_dumps`` pieces join to exactly ``dumps`` (what ``sim.run`` streams to plan.json is the canonical file),
    for lowered plans of every shape: several ranks, empty programs, a subnet table."""
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    for inputs in (PlanInputs("uniform:layers=6", "3xideal", "interleaved", microbatches=6, chunks=2),
                   PlanInputs("uniform:layers=2", "1xideal", "gpipe", microbatches=1)):
        plan = build_plan(inputs).plan
        assert "".join(plan.iter_dumps()) == plan.dumps() and Plan.loads(plan.dumps()) == plan
    empty = Plan("csp", "L1", "uniform:layers=2", "2xideal", 2, 1, "csp", Placement(((0, 1), (1, 2)), (0, 1)),
                 ((), ()), subnets=((0,), (1,)))
    assert "".join(empty.iter_dumps()) == empty.dumps() and Plan.loads(empty.dumps()) == empty
