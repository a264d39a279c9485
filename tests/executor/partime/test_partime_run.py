"""A PARTIME stream plan run by ``executor.run`` on gloo ranks ends with bitwise the weights of the single-process
reference of PARTIME's rule (``executor.partime.partime_reference.partime``) on the same frames: every stage's forward
of its newest frame, the backward of the arriving gradient through it, an SGD step after each backward, the drain's
recompute. And its losses are the reference's online losses."""

from __future__ import annotations

import json

import pytest
import torch

from executor.nn.optim import make_optimizer
from executor.nn.stages import build_stage, loss_fn
from executor.partime.partime_interpreter import VIDEO_DRIFT
from executor.partime.partime_reference import partime
from executor.partime.video import VideoSpec, frame
from sim.ir.plan import Plan
from tests.executor.runs import execute, sim_plan

MODEL = "cnn:layers=4,features=4,kernel=3,size=16"
LR = 0.05


def reference(plan: Plan, iterations: int, data_seed: int = 0):
    """The reference over ``iterations`` segments of the stream, each a T-frame plan run to its end."""
    stages = [build_stage(MODEL, start, end, seed=0) for start, end in plan.placement.vstage_layers]
    spec = VideoSpec(size=16, features=4, seed=data_seed, drift=VIDEO_DRIFT)
    frames_per_plan = plan.num_microbatches
    losses = []
    for k in range(iterations):
        result = partime(stages, lambda stage: make_optimizer("sgd", stage.parameters(), LR),
                         lambda f, k=k: frame(spec, k * frames_per_plan + f), frames_per_plan, loss_fn(MODEL))
        losses.append(result.losses)
    return stages, losses


@pytest.mark.parametrize("ranks, frames, warmup", [(1, 5, 0), (2, 6, 0), (3, 7, 0), (2, 2, 1)],
                         ids=["1-stage", "2-stages", "3-stages", "2-stages-short-two-iterations"])
def test_the_run_ends_with_the_reference_weights_bit_for_bit(tmp_path, ranks, frames, warmup):
    plan_path = sim_plan(tmp_path / "sim", ranks, frames, "--schedule", "stream", model=MODEL)
    plan = Plan.loads(plan_path.read_text())
    state = tmp_path / "state"
    run = execute(plan_path, tmp_path / "real", "--iterations", "1", "--warmup", str(warmup), "--optimizer", "sgd",
                  "--lr", str(LR), "--save-state", str(state))
    assert run.returncode == 0, run.stderr
    stages, losses = reference(plan, warmup + 1)
    moved = 0.0
    initial = [build_stage(MODEL, start, end, seed=0) for start, end in plan.placement.vstage_layers]
    for v, stage in enumerate(stages):
        saved = torch.load(state / f"stage{v}.pt")
        for name, value in stage.state_dict().items():
            assert torch.equal(saved[name], value), (v, name)
            moved = max(moved, (value - initial[v].state_dict()[name]).abs().max().item())
    assert moved > 1e-4  # the weights did change: agreeing is not agreeing on nothing
    metrics = json.loads((tmp_path / "real" / "metrics.json").read_text())
    measured = metrics["measurement"]["losses"]
    for got, want in zip(measured, losses, strict=True):
        assert list(got) == pytest.approx(list(want), rel=1e-6)
    assert metrics["stream"]["frames"] == frames and metrics["stream"]["stages"] == ranks


def test_a_live_source_paces_the_first_stage_and_the_compare_has_the_step_times(tmp_path):
    # 40 frames/s: a frame every 25 ms, against well under 5 ms of compute per step on these ranks, so the measured
    # step is the source's period (the pacing wait sits before the forward's span, as in the simulator). One warm-up
    # iteration: a process's first backward through the first stage once took 400 ms (lazy set-up in torch).
    fps = 40.0
    plan_path = sim_plan(tmp_path / "sim", 2, 10, "--schedule", "stream", "--fps", str(fps), model=MODEL)
    run = execute(plan_path, tmp_path / "real", "--iterations", "1", "--warmup", "1", "--optimizer", "sgd")
    assert run.returncode == 0, run.stderr
    metrics = json.loads((tmp_path / "real" / "metrics.json").read_text())
    assert metrics["stream"]["fps"] == fps
    assert metrics["stream"]["step_time_s"] == pytest.approx(1 / fps, rel=0.2)
    compare = json.loads((tmp_path / "real" / "compare.json").read_text())
    assert compare["stream"]["step_time_s"]["predicted"] == pytest.approx(1 / fps, rel=1e-9)  # paced, simulated
    assert compare["stream"]["step_time_s"]["measured"] == metrics["stream"]["step_time_s"]
    assert "measured stream: 10 frames on 2 stages" in run.stdout


def test_a_cuda_graphs_plan_is_refused_on_nccl_and_runs_eagerly_with_a_warning_on_gloo(capsys):
    from executor.backend import check_cuda_graphs
    from sim.core.errors import SpecError
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    plan = build_plan(PlanInputs(model=MODEL, topology="2xV100", schedule="stream", microbatches=4,
                                 cuda_graphs=True)).plan
    with pytest.raises(SpecError, match="cannot capture a step as a CUDA graph yet"):
        check_cuda_graphs(plan, "nccl")
    check_cuda_graphs(plan, "gloo")
    assert "its steps run eagerly" in capsys.readouterr().err
    eager = build_plan(PlanInputs(model=MODEL, topology="2xV100", schedule="stream", microbatches=4)).plan
    check_cuda_graphs(eager, "nccl")  # nothing to refuse
