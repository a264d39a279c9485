"""PARTIME's stream schedule: the exact small programs, the counts, which forward each backward runs through (a
closed form), and that its plans validate and lower with an update after every backward."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.schedules import SCHEDULES
from sim.schedules.partime import partime, partime_inputs, partime_steps


def text(programs) -> list[str]:
    return [" ".join(op.id for op in program) for program in programs]


def test_two_stages_three_frames_is_the_docstring_picture():
    assert text(partime(2, 3)) == [
        "0F0 0F1 0F2 0B0 0R1 0B1 0R2 0B2",
        "1F0 1B0 1F1 1B1 1F2 1B2",
    ]


def test_one_stage_is_plain_online_sgd_order():
    assert text(partime(1, 4)) == ["0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3"]


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 6), frames=st.integers(1, 20))
def test_counts_and_the_current_input_of_every_backward(stages, frames):
    programs = partime(stages, frames)
    assert partime_steps(stages, frames) == frames + 2 * (stages - 1)
    for stage, program in enumerate(programs):
        kinds = [op.kind for op in program]
        assert kinds.count(OpKind.F) == frames and kinds.count(OpKind.B) == frames
        # The drain recomputes before each backward that has no forward of its own step: the gradient of frame g
        # reaches stage s at step g + 2(N - 1) - s, when the stage's newest frame would be g + 2(N - 1 - s).
        drained = [g for g in range(frames) if g + 2 * (stages - 1 - stage) >= frames]
        assert [op.mb for op in program if op.kind is OpKind.R] == drained
    plan = build_plan(PlanInputs(model=f"uniform:layers={stages}", topology=f"{stages}xideal", schedule="stream",
                                 microbatches=frames)).plan
    inputs = partime_inputs(plan)
    for stage in range(stages):
        for g in range(frames):
            # Closed form: the stage's current frame when the gradient of g arrives, or its last frame in the drain.
            assert inputs[(stage, g)] == min(g + 2 * (stages - 1 - stage), frames - 1)


def test_the_lowered_plan_updates_after_every_backward_and_sends_each_gradient_once():
    plan = build_plan(PlanInputs(model="uniform:layers=6", topology="3xideal", schedule="stream",
                                 microbatches=5)).plan
    assert plan.weight_policy == "stream" and not plan.option("recompute")
    for stage, program in enumerate(plan.programs):
        ops = [op for op in program if op.kind in (OpKind.B, OpKind.OPT_STEP)]
        assert [(op.kind, op.mb) for op in ops] == [kind_mb for g in range(5)
                                                   for kind_mb in ((OpKind.B, g), (OpKind.OPT_STEP, g))]
        sends = [op.mb for op in program if op.kind is OpKind.SEND_B]
        assert sends == ([] if stage == 0 else list(range(5)))


def test_registry_entry_and_the_flags_it_refuses():
    entry = SCHEDULES["stream"]
    assert entry.weight_policy == "stream" and not entry.chunked
    base = dict(model="uniform:layers=4", topology="4xideal", schedule="stream", microbatches=8)
    with pytest.raises(Exception, match="recompute full does not apply to schedule stream"):
        build_plan(PlanInputs(**base, recompute="full"))
    with pytest.raises(Exception, match="fps 30 is the frame rate of a live source"):
        build_plan(PlanInputs(**{**base, "schedule": "1f1b"}, fps=30.0))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(Exception, match="fps must be a finite number"):
            build_plan(PlanInputs(**base, fps=bad))
    with pytest.raises(Exception, match="not modelled for stream plans"):
        build_plan(PlanInputs(**{**base, "topology": "8xideal"}, dp=2, pp=4))
