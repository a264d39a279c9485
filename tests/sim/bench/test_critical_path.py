"""The longest-path evaluator against its oracle, the SimPy engine: equal to the bit when no link is contended, a
lower bound when one is, the same peak memory always; and a small plan worked out by hand."""

import random

import numpy as np
import pytest

from sim.bench.critical_path import NotCompilable, compile_plan
from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from tests.sim.search.random_plans import MODEL, engine_views, random_plan_inputs


def test_equal_to_the_engine_when_uncontended_and_a_lower_bound_otherwise():
    rng = random.Random(14)
    exact = bounded = 0
    while exact + bounded < 60:
        inputs = random_plan_inputs(rng)
        try:  # a random draw may break a rule (TP across device models, more stages than layers): draw again
            built = build_plan(inputs)
            prediction = predict_built(built, check_memory=False)
        except SpecError:
            continue
        views = engine_views(built)
        compiled = compile_plan(built.plan, len(views))
        values = compiled.slot_values(views)
        makespan = compiled.makespan(values)
        engine = prediction.metrics["iteration_time_s"]
        assert compiled.peak_memory(views) == prediction.peak_memory_bytes, inputs
        if compiled.contended(views, *compiled.times(values)):
            assert makespan <= engine * (1 + 1e-12), inputs  # waiting for a link only delays
            bounded += 1
        else:
            assert makespan == engine, inputs  # the same sums in the same order: bit-identical
            exact += 1
    assert exact >= 20 and bounded >= 1  # both branches were exercised


def test_a_batch_of_cost_vectors_gives_each_ones_makespan():
    built = build_plan(PlanInputs(model=MODEL, topology="4xA100", schedule="1f1b", microbatches=4, pp=4))
    views = engine_views(built)
    compiled = compile_plan(built.plan, len(views))
    base = compiled.slot_values(views)
    rng = np.random.default_rng(3)
    batch = base[:, None] * rng.uniform(0.5, 2.0, size=(len(base), 5))
    together = compiled.makespan(batch)
    one_by_one = [compiled.makespan(batch[:, k]) for k in range(5)]
    assert list(together) == one_by_one


def test_a_two_stage_pipeline_worked_by_hand():
    """GPipe, 2 ranks, 2 microbatches; costs set by hand: F = 1 s, B = 2 s on both stages, each transfer 0.5 s,
    optimizer steps 0. A transfer starts once its SEND and RECV are both issued (a rendezvous), and lowering issues
    each RECV right before its consumer, after the op before it. By hand:
    rank 0: F0 [0,1], F1 [1,2]; RECV_B0 issued at 2.
    rank 1: transfer F0 [1,1.5]; F0 [1.5,2.5]; RECV_F1 issued at 2.5, so transfer F1 [2.5,3]; F1 [3,4];
            B0 [4,6]; transfer B0 [6,6.5]; B1 [6,8]; SEND_B1 issued at 8.
    rank 0: B0 [6.5,8.5]; RECV_B1 issued at 8.5, so transfer B1 [8.5,9]; B1 [9,11]. Makespan 11 s."""
    built = build_plan(PlanInputs(model="uniform:layers=2", topology="2xideal", schedule="gpipe", microbatches=2,
                                  partition="uniform"))
    compiled = compile_plan(built.plan, 1)
    values = np.array([{"F": 1.0, "B": 2.0, "SEND_F": 0.5, "SEND_B": 0.5}.get(slot.kind.value, 0.0)
                       for slot in compiled.slots])
    starts, ends = compiled.times(values)
    span = {op: (starts[node], ends[node]) for node, _, op in compiled.op_nodes}
    assert span["1F1"] == (3.0, 4.0) and span["0B0"] == (6.5, 8.5) and span["0B1"] == (9.0, 11.0)
    assert compiled.makespan(values) == 11.0


def test_plans_it_does_not_model_are_refused():
    stash = build_plan(PlanInputs(model=MODEL, topology="2xA100", schedule="pipedream", microbatches=4, pp=2))
    with pytest.raises(NotCompilable, match="stash"):
        compile_plan(stash.plan)
    overlap = build_plan(PlanInputs(model=MODEL, topology="2xA100", schedule="1f1b", microbatches=4, dp=2, pp=1,
                                    grad_overlap=True))
    with pytest.raises(NotCompilable, match="overlapped"):
        compile_plan(overlap.plan)
