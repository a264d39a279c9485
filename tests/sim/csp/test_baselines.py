"""The NASPipe baselines on a CSP run's subnet sequence (sim.csp.baselines)."""

from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.csp.baselines import (
    flush_baseline,
    pipedream_baseline,
    run_baseline,
    stage_subnet_bytes,
    stage_supernet_bytes,
)
from sim.csp.csp_plan import CspInputs, build_csp_plan, build_csp_problem
from sim.predict import predict

SMALL = "supernet:blocks=6,choices=4,hidden=64,heads=4,seq=16,vocab=100"


def _inputs(**kw):
    return CspInputs(SMALL, None, "4xV100", subnets=kw.pop("subnets", 10), seed=kw.pop("seed", 1), **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_microbatch_with_a_flush_is_csp_one_at_a_time(schedule):
    # Two independent simulators: sim.engine.simpy_engine running a static plan per subnet and summing, and the CSP
    # simulation admitting a subnet only when the previous one has finished everywhere. One microbatch per subnet and a
    # flush between subnets is the same schedule, so they must agree to rounding.
    # NCCL's protocol latencies apply to both (transfers between GPUs); the kernel model's framework overheads apply
    # to GPT layers only (sim.cost.gpu_time), so neither charges them to this supernet.
    inputs = _inputs(microbatch_size=2)
    flush = flush_baseline(inputs, schedule, 1)
    alone = predict(build_csp_plan(replace(inputs, one_at_a_time=True))).trace.makespan
    assert flush.makespan_s == pytest.approx(alone, rel=1e-9)
    assert flush.reproducible and flush.subnets_per_s == pytest.approx(10 / flush.makespan_s)


def test_pipedream_ignores_dependencies_and_stashes_versions():
    inputs = _inputs(microbatch_size=2)
    dream = pipedream_baseline(inputs)
    plan, setup, _ = build_csp_problem(inputs)
    supernet, stage_layers, subnets = setup.supernet, plan.placement.vstage_layers, plan.subnets
    resident, largest = stage_supernet_bytes(supernet, stage_layers), stage_subnet_bytes(supernet, stage_layers,
                                                                                         subnets)
    assert dream.device_param_bytes == tuple(resident[r] + (3 - r) * largest[r] for r in range(4))
    assert not dream.reproducible and dream.microbatches == 1
    # No causal dependencies and the same costs: never slower than CSP holding every subnet to one at a time.
    assert dream.makespan_s <= predict(build_csp_plan(replace(inputs, one_at_a_time=True))).trace.makespan


def test_stage_bytes_cover_the_supernet_and_each_subnet():
    plan, setup, _ = build_csp_problem(_inputs())
    supernet, stage_layers, subnets = setup.supernet, plan.placement.vstage_layers, plan.subnets
    assert sum(stage_supernet_bytes(supernet, stage_layers)) == supernet.graph.total_param_bytes()
    largest = stage_subnet_bytes(supernet, stage_layers, subnets)
    assert all(0 < s <= w for s, w in zip(largest, stage_supernet_bytes(supernet, stage_layers)))


@pytest.mark.parametrize("call,message", [
    (lambda: run_baseline(_inputs(), "zb1p"), "baseline must be one of"),
    (lambda: flush_baseline(_inputs(microbatch_size=6), "gpipe", 4), "must divide"),
    (lambda: flush_baseline(_inputs(), "pipedream", 1), "gpipe or 1f1b"),
])
def test_bad_baselines_are_named(call, message):
    with pytest.raises(SpecError, match=message):
        call()
