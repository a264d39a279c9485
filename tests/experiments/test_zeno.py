"""``experiments.run zeno``'s simulated cost: Zeno's step is the all-gather of every replica's gradients and one
forward pass per replica and one more, costed by the plan's own cost model; the mean is the plan's all-reduce."""

import pytest

from experiments.zeno import MODEL, simulated_cost
from sim.ir.ops import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built


def test_zenos_simulated_step_is_its_all_gather_and_five_forwards():
    built = build_plan(PlanInputs(MODEL, "4xcpu", "1f1b", None, dp=4, global_batch=8))
    costs = predict_built(built, check_memory=False).costs
    cost = simulated_cost(built.plan)
    gathered = costs.oracle.collective("all_gather", (built.plan.layout.dp_group(0, 0),), 4 * costs.param_bytes(0))
    assert cost["zeno_s"] == pytest.approx(gathered.seconds + 5 * costs.compute_time(OpKind.F, 0), rel=1e-12)
    assert cost["mean_s"] == costs.collective_op(OpKind.REDUCE_GRAD, 0).seconds and cost["zeno_s"] > cost["mean_s"]
