"""The screen's bounds (:mod:`sim.search.bound`) against their oracle, the SimPy engine: over random plans the time
bound is never above the engine's iteration time and the memory bound never above any rank's simulated peak; on
uniform stages the drain chain is GPipe's and 1F1B's closed form (m + p - 1)(f + b) plus the update."""

import random

import pytest

from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.search.bound import memory_lower_bound, stage_times, time_lower_bound
from tests.sim.search.random_plans import engine_views, random_plan_inputs


def _bounds(built, inputs):
    plan = built.plan
    recompute_full = inputs.recompute_mode == "full"
    split = plan.schedule == "zb1p"
    stashing = plan.weight_policy == "stash"
    updates = plan.num_microbatches if stashing else 1
    times, memory = [], []
    for view in engine_views(built):
        st = stage_times(view, split_backward=split, recompute_full=recompute_full, updates=updates)
        times.append(time_lower_bound(plan.schedule, plan.num_microbatches, plan.placement.vstage_to_rank, st))
        memory.extend(memory_lower_bound(view, plan.schedule, plan.num_microbatches, recompute_full=recompute_full,
                                         stashing=stashing))
    return max(times), memory


def test_the_bounds_are_below_the_engine_on_random_plans():
    rng = random.Random(27)
    checked, tight = 0, 0
    schedules = set()
    while checked < 60:
        inputs = random_plan_inputs(rng, ("gpipe", "1f1b", "zb1p", "pipedream"), grad_overlap=True)
        try:  # a random draw may break a rule (TP across device models, more stages than layers): draw again
            built = build_plan(inputs)
            prediction = predict_built(built, check_memory=False)
        except SpecError:
            continue
        bound, memory = _bounds(built, inputs)
        engine = prediction.metrics["iteration_time_s"]
        assert 0 < bound <= engine * (1 + 1e-9), (inputs, bound, engine)
        peaks = prediction.peak_memory_bytes
        assert len(memory) == len(peaks) and all(0 < low <= peak for low, peak in zip(memory, peaks)), \
            (inputs, memory, peaks)
        checked += 1
        tight += bound >= 0.9 * engine
        schedules.add(inputs.schedule)
    assert schedules == {"gpipe", "1f1b", "zb1p", "pipedream", "interleaved"}
    assert tight >= 20  # a bound that is mostly far below the engine would prove little


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_stages_give_the_closed_form(schedule):
    """4 equal stages on ideal devices, m = 6: the engine's time is (m + p - 1)(f + b) + the transfers on the
    fill and drain chains + the update, and the bound is within the rendezvous waits of it."""
    inputs = PlanInputs(model="uniform:layers=4", topology="4xideal", schedule=schedule, microbatches=6,
                        partition="uniform")
    built = build_plan(inputs)
    engine = predict_built(built, check_memory=False).metrics["iteration_time_s"]
    bound, _ = _bounds(built, inputs)
    view = engine_views(built)[0]
    st = stage_times(view, split_backward=False, recompute_full=False)
    f, b = st.forward_s[0], st.backward_s[0]
    assert set(st.forward_s) == {f} and set(st.backward_s) == {b}
    closed = (6 + 4 - 1) * (f + b) + sum(st.send_forward_s) + sum(st.send_backward_s) + st.update_s[0]
    assert bound == pytest.approx(closed, rel=1e-12)
    assert bound <= engine
