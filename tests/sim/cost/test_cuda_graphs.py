"""``--cuda-graphs``: a captured stream step costs its kernels' own time plus one launch. Against the closed form: a
stage of k convolutions runs 3k ops per step (forward, backward, update of each layer), each paying the catalog's
per-op overhead eagerly; captured, it pays one launch, so its time per step drops by exactly (3k − 1) launches."""

import pytest

from sim.core.errors import SpecError
from sim.hw.catalog import get_device
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

MODEL = "cnn:layers=10,features=16,kernel=5,size=64"


def partime_metrics(cuda_graphs: bool, topology: str = "4xV100"):
    built = build_plan(PlanInputs(model=MODEL, topology=topology, schedule="stream", microbatches=24,
                                  partition="3,2,2,3", cuda_graphs=cuda_graphs))
    prediction = predict_built(built)
    return built, prediction.metrics["stream"]


def test_a_captured_step_saves_all_but_one_launch_per_stage():
    built, eager = partime_metrics(False)
    captured_built, captured = partime_metrics(True)
    assert built.plan.placement.layer_counts() == captured_built.plan.placement.layer_counts()
    launch = get_device("V100").launch_overhead_s
    assert launch > 0
    for k, slow, fast in zip(built.plan.placement.layer_counts(), eager["stage_step_time_s"],
                             captured["stage_step_time_s"]):
        assert slow - fast == pytest.approx((3 * k - 1) * launch, rel=1e-9)
    assert captured_built.plan.option("cuda_graphs") is True


def test_the_plan_records_it_and_the_prediction_path_costs_it_from_the_plan():
    built, captured = partime_metrics(True)
    again = predict(built.plan)  # the oracle rebuilt from plan.json alone (sim.cost.cost_view.plan_oracle)
    assert again.metrics["stream"]["stage_step_time_s"] == captured["stage_step_time_s"]


@pytest.mark.parametrize("change, needle", [
    ({"schedule": "1f1b"}, "for schedule stream, not 1f1b"),
    ({"topology": "4xcpu"}, "cuda_graphs needs GPUs"),
    ({"topology": "4xideal"}, "cuda_graphs needs GPUs"),
])
def test_where_it_does_not_apply_is_one_error(change, needle):
    inputs = {"model": MODEL, "topology": "4xV100", "schedule": "stream", "microbatches": 8, "cuda_graphs": True,
              **change}
    with pytest.raises(SpecError, match=needle):
        build_plan(PlanInputs(**inputs))
