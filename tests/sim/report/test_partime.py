"""Stream metrics against closed forms, PARTIME's own: with free links the step time is the slowest stage's forward +
backward + update and a frame takes 2N − 1 steps; one stage is plain online SGD; a live source below the sustainable
rate paces the pipeline without queueing, above it frames queue; a stage holds one frame's activations."""

import pytest

from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

FWD_MS, BWD_MS = 1.0, 2.0


def run(stages: int, frames: int, *, partition: str = "uniform", layers: int | None = None,
        fps: float | None = None):
    built = build_plan(PlanInputs(model=f"uniform:layers={layers or 2 * stages},fwd_ms={FWD_MS:g},bwd_ms={BWD_MS:g}",
                                  topology=f"{stages}xideal", schedule="stream", microbatches=frames,
                                  partition=partition, fps=fps))
    return built, predict_built(built)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_uniform_stages_on_free_links_step_at_the_stage_time_and_a_frame_takes_2n_minus_1_steps(stages):
    _, prediction = run(stages, frames=4 * stages + 3)
    stream = prediction.metrics["stream"]
    stage = 2 * (FWD_MS + BWD_MS) * 1e-3  # two layers per stage; the ideal device's update is free
    assert stream["step_time_s"] == pytest.approx(stage, rel=1e-12)
    assert stream["stage_step_time_s"] == pytest.approx([stage] * stages, rel=1e-12)
    assert stream["steady_latency_s"] == pytest.approx((2 * stages - 1) * stage, rel=1e-12)
    assert stream["latency_in_steps"] == pytest.approx(2 * stages - 1, rel=1e-12)


def test_unequal_stages_step_at_the_slowest():
    _, prediction = run(3, frames=20, layers=6, partition="1,3,2")
    stream = prediction.metrics["stream"]
    per_layer = (FWD_MS + BWD_MS) * 1e-3
    assert stream["stage_step_time_s"] == pytest.approx([per_layer, 3 * per_layer, 2 * per_layer], rel=1e-12)
    assert stream["step_time_s"] == pytest.approx(3 * per_layer, rel=1e-12)


def test_one_stage_is_plain_online_sgd():
    frames = 7
    _, prediction = run(1, frames=frames, layers=3)
    step = 3 * (FWD_MS + BWD_MS) * 1e-3
    assert prediction.metrics["iteration_time_s"] == pytest.approx(frames * step, rel=1e-12)
    assert prediction.metrics["stream"]["latency_s"]["per_frame"] == pytest.approx([step] * frames, rel=1e-12)


def test_a_source_below_the_sustainable_rate_paces_the_pipeline_and_real_time_holds():
    stage = 2 * (FWD_MS + BWD_MS) * 1e-3
    fps = 0.5 / stage  # half the sustainable rate
    _, prediction = run(3, frames=16, fps=fps)
    stream = prediction.metrics["stream"]
    assert stream["step_time_s"] == pytest.approx(1 / fps, rel=1e-12)
    assert stream["queued_wait_s"] == pytest.approx(0.0, abs=1e-15)  # each frame starts as it arrives
    verdict = stream["real_time"]
    assert verdict["holds"] and verdict["sustainable_fps"] == pytest.approx(1 / stage, rel=1e-12)
    assert verdict["margin_s"] == pytest.approx(1 / fps - stage, rel=1e-12)


def test_a_source_above_it_makes_frames_queue():
    stage = 2 * (FWD_MS + BWD_MS) * 1e-3
    fps = 1.25 / stage
    frames = 20
    _, prediction = run(2, frames=frames, fps=fps)
    stream = prediction.metrics["stream"]
    verdict = stream["real_time"]
    assert not verdict["holds"] and verdict["kept_fraction_if_dropping"] == pytest.approx(0.8, rel=1e-12)
    # Stage 0 starts a frame every `stage` seconds once it is saturated, so frame f waits about f·(stage − 1/fps):
    # the last one at least (frames − 1 − 2(N − 1))·(stage − 1/fps), past the warm-up.
    assert stream["queued_wait_s"] >= (frames - 1 - 2) * (stage - 1 / fps) - 1e-12
    latencies = stream["latency_s"]["per_frame"]
    assert latencies[-3] > latencies[5]  # growing


def test_a_stage_holds_one_frame_of_activations():
    built, prediction = run(4, frames=12)
    costs = built.costs
    for stage in range(4):
        assert prediction.peak_memory_bytes[stage] == (costs.state_bytes(stage) + costs.activation_bytes(stage)
                                                      + costs.workspace_bytes(stage))


def test_too_few_frames_for_a_steady_state_say_so():
    _, prediction = run(4, frames=6)
    stream = prediction.metrics["stream"]
    assert stream["step_time_s"] is None and "more than 2(N - 1) = 6 frames" in stream["why_no_steady_state"]
    assert len(stream["latency_s"]["per_frame"]) == 6
