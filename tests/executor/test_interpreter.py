"""The L1 interpreter in one process: supported kinds, and a one-rank plan against single-process training."""

import pytest
import torch

from executor.interpreter import HANDLED_KINDS, RankInterpreter, check_supported
from executor.modules import boundary_specs, build_stage, loss_fn, synthetic_batch
from executor.optim import make_optimizer
from executor.reference import train_reference
from sim.ir import Op, OpKind
from sim.planning import PlanInputs, build_plan
from sim.validate import PlanError

SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50"


def _plan(schedule="1f1b", topology="1xcpu", m=3):
    return build_plan(PlanInputs(model=SPEC, topology=topology, schedule=schedule, microbatches=m,
                                 partition="uniform")).plan


def test_lowered_flush_plans_are_supported():
    for schedule in ("gpipe", "1f1b"):
        check_supported(_plan(schedule, "2xcpu"))


def test_unknown_kind_is_rejected_before_running_naming_the_op():
    plan = _plan(topology="2xcpu")
    programs = list(plan.programs)
    programs[1] = programs[1] + (Op(OpKind.W, 1, 0),)
    with pytest.raises(PlanError, match=r"W \(first: 1W0\)"):
        check_supported(plan.with_programs(tuple(programs), level="L1"))
    assert OpKind.W not in HANDLED_KINDS  # issue #4 adds it; until then it must be refused, not skipped


def test_unlowered_plan_is_rejected():
    plan = _plan()
    with pytest.raises(PlanError, match="L1"):
        check_supported(plan.with_programs(plan.programs, level="L0"))


def _run_single_rank(plan, steps, optimizer):
    stage = build_stage(SPEC, 0, 4, seed=0)
    opt = make_optimizer(optimizer, stage.parameters())
    boundary = {0: boundary_specs(SPEC, [0], plan.microbatch_size)[0]}
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: opt}, loss_fn(SPEC), boundary)
    losses, records = [], None
    m = plan.num_microbatches
    for step in range(steps):
        batches = [synthetic_batch(SPEC, plan.microbatch_size, seed=0, index=step * m + j) for j in range(m)]
        records, step_losses = interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
        losses.append(tuple(step_losses))
    return stage, losses, records


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_rank_run_equals_single_process_training_bitwise(optimizer):
    plan = _plan(m=3)
    stage, losses, records = _run_single_rank(plan, steps=3, optimizer=optimizer)
    reference = train_reference(SPEC, steps=3, num_microbatches=3, microbatch_size=1, optimizer=optimizer)
    assert tuple(losses) == reference.losses
    for key, value in stage.state_dict().items():
        assert torch.equal(value, reference.state[key]), key
    assert [r.op.id for r in records] == [op.id for op in plan.programs[0]]
    assert all(r.end >= r.start for r in records)


def test_an_op_failure_names_the_op():
    plan = _plan(m=2)
    stage = build_stage(SPEC, 0, 4, seed=0)
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())},
                                  loss_fn(SPEC), {}, fail_at="0B1")
    batches = [synthetic_batch(SPEC, 1, seed=0, index=j) for j in range(2)]
    with pytest.raises(RuntimeError, match="op 0B1 failed") as info:
        interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
    assert info.value.op_id == "0B1"
