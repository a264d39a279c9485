"""The op semantics table (``sim.ir.ops.OP_SEMANTICS``): complete, self-consistent, and the one source every
consumer's dispatch is derived from. Each consumer is shown to refuse, by name, a kind whose action it has lost the
handler for (a planted violation), instead of skipping the op."""

import pytest

from executor import interpreter
from sim.bench.critical_path import NotCompilable, compile_plan
from sim.engine import simpy_engine
from sim.hw.topology import Topology
from sim.ir.ops import (
    COMPUTE_KINDS,
    DP_KINDS,
    EP_KINDS,
    OP_SEMANTICS,
    SCHEDULED_KINDS,
    TP_KINDS,
    Action,
    MemoryEffect,
    Op,
    OpKind,
    handled_kinds,
    op_id,
    stream_of,
)
from sim.plan import validate
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


def test_every_kind_has_semantics_and_every_action_one_walk_rule():
    assert set(OP_SEMANTICS) == set(OpKind)
    for action in Action:
        kinds = [kind for kind, semantics in OP_SEMANTICS.items() if semantics.action is action]
        assert kinds, action
        assert len({OP_SEMANTICS[kind].blocks for kind in kinds}) == 1, action  # an action blocks or it does not
    assert {s.action for s in OP_SEMANTICS.values() if s.blocks} == {Action.COMPUTE, Action.TP_COLLECTIVE,
                                                                   Action.EP_COLLECTIVE}


def test_the_derived_sets_are_the_documented_ones():
    assert SCHEDULED_KINDS == {OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R}
    assert COMPUTE_KINDS == SCHEDULED_KINDS | {OpKind.OPT_STEP}
    assert TP_KINDS == {OpKind.TP_F, OpKind.TP_B, OpKind.TP_R}
    assert EP_KINDS == {OpKind.EP_F, OpKind.EP_B, OpKind.EP_R}
    assert DP_KINDS == {OpKind.REDUCE_GRAD, OpKind.GATHER_PARAMS}
    assert {kind: stream_of(kind) for kind in OpKind if stream_of(kind) != "compute"} == {
        OpKind.SEND_F: "send", OpKind.SEND_B: "send", OpKind.RECV_F: "recv", OpKind.RECV_B: "recv",
        OpKind.PREFETCH: "h2d", OpKind.EVICT: "d2h", OpKind.TP_F: "tp", OpKind.TP_B: "tp", OpKind.TP_R: "tp",
        OpKind.EP_F: "ep", OpKind.EP_B: "ep", OpKind.EP_R: "ep",
        OpKind.REDUCE_GRAD: "collective", OpKind.GATHER_PARAMS: "collective"}


def test_memory_effects_pair_up():
    """Every effect that allocates has the effect that frees it: activations kept by F are released by B, or by I
    which keeps what its W needs and W frees; weights loaded by PREFETCH are unloaded by EVICT."""
    effects = {semantics.memory for semantics in OP_SEMANTICS.values()}
    assert MemoryEffect.KEEP_ACTIVATIONS in effects and MemoryEffect.RELEASE_ACTIVATIONS in effects
    assert MemoryEffect.LOAD_WEIGHTS in effects and MemoryEffect.UNLOAD_WEIGHTS in effects
    assert OP_SEMANTICS[OpKind.I].memory is MemoryEffect.DEFER_WEIGHT_GRADIENTS
    assert OP_SEMANTICS[OpKind.W].memory is MemoryEffect.RELEASE_DEFERRED
    assert {kind for kind, s in OP_SEMANTICS.items() if s.backward} == {OpKind.B, OpKind.I, OpKind.W}
    assert {kind for kind, s in OP_SEMANTICS.items() if s.workspace} == SCHEDULED_KINDS


def test_op_id_is_the_ops_own_id():
    for kind in OpKind:
        for mb in (None, 0, 17):
            assert op_id(kind, 3, mb) == Op(kind, 3, mb).id == str(Op(kind, 3, mb))


def test_handled_kinds_follow_the_actions():
    assert handled_kinds([Action.SEND, Action.RECV]) == {OpKind.SEND_F, OpKind.SEND_B, OpKind.RECV_F, OpKind.RECV_B}
    assert simpy_engine.HANDLED_KINDS == set(OpKind)
    # host copies run only in CSP plans, whose executor is executor.csp
    assert interpreter.HANDLED_KINDS == set(OpKind) - {OpKind.PREFETCH, OpKind.EVICT}


def _plan_with_tp_and_dp():
    """A lowered TP 2 × DP 2 × PP 2 plan: every action but HOST_COPY appears in it."""
    return build_plan(PlanInputs("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100", "8xA100", "1f1b", 4, tp=2,
                                dp=2)).plan


def test_planted_engine_without_a_handler_refuses_the_kind_by_name(monkeypatch):
    plan = _plan_with_tp_and_dp()
    issuers = dict(simpy_engine._ISSUERS)
    del issuers[Action.DP_COLLECTIVE]
    monkeypatch.setattr(simpy_engine, "_ISSUERS", issuers)
    with pytest.raises(validate.PlanError, match=r"no handler for op kind\(s\) REDUCE_GRAD$"):
        simpy_engine.simulate(plan, (), Topology.parse("8xA100"))


def test_planted_deadlock_check_without_a_rule_refuses_the_kind_by_name(monkeypatch):
    plan = _plan_with_tp_and_dp()
    rules = {kind: rule for kind, rule in validate._DRY_RUN.items() if kind not in TP_KINDS}
    monkeypatch.setattr(validate, "_DRY_RUN", rules)
    with pytest.raises(validate.PlanError, match="no rule for op kind.*TP_B, TP_F"):
        validate.check_deadlock(plan)


def test_planted_fast_evaluator_without_a_rule_refuses_the_kind(monkeypatch):
    from sim.bench import critical_path

    plan = _plan_with_tp_and_dp()
    compile_plan(plan)  # compiles as it stands
    actions = dict(critical_path._ACTION)
    actions[OpKind.SEND_F] = Action.HOST_COPY  # a kind whose action the evaluator has no node rule for
    monkeypatch.setattr(critical_path, "_ACTION", actions)
    with pytest.raises(NotCompilable, match="SEND_F"):
        compile_plan(plan)


def test_planted_executor_without_a_handler_refuses_the_kind_by_name(monkeypatch):
    plan = build_plan(PlanInputs("uniform:layers=4", "2xcpu", "zb1p", 4)).plan
    interpreter.check_supported(plan)
    handlers = {kind: method for kind, method in interpreter.HANDLER_OF.items() if kind is not OpKind.W}
    monkeypatch.setattr(interpreter, "HANDLER_OF", handlers)
    with pytest.raises(validate.PlanError, match=r"no handler for op kind\(s\) W \(first: "):
        interpreter.check_supported(plan)
