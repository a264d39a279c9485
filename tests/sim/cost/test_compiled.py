"""``--compile`` (``sim.cost.compiled``): what may take it, that a plan records it and a written plan is checked
again, and that it costs a Llama-family plan its compiled kernels (``sim.cost.kernels.pointwise``)."""

import dataclasses

import pytest

from sim.core.errors import SpecError
from sim.cost.gpu_time import default_kernel_model, transformer_layer_seconds
from sim.hw.catalog import get_device
from sim.ir.plan import Plan
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict

LLAMA = "llama:layers=2,hidden=1024,heads=8,kv_heads=2,ffn=2816,vocab=1000,seq=1024"


@pytest.mark.parametrize("model, topology, message", [
    ("gpt:layers=2", "2xH100", "modelled for the llama and moe families"),
    (LLAMA, "2xcpu", "needs GPUs"),
])
def test_what_cannot_compile_is_refused(model, topology, message):
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(model, topology, "1f1b", microbatches=2, compiled=True))


def test_a_compiled_plan_records_it_and_is_faster():
    eager = build_plan(PlanInputs(LLAMA, "2xH100", "1f1b", microbatches=2))
    compiled = build_plan(PlanInputs(LLAMA, "2xH100", "1f1b", microbatches=2, compiled=True))
    assert compiled.plan.option("compile") is True and eager.plan.option("compile") is None
    # Oracle: the block's layer times are the kernel model's over the compiled inventory, and the prediction of
    # the written plan is the built plan's (one oracle).
    graph, device = build_model(LLAMA), get_device("H100")
    block = graph.layers[1].transformer
    fast = transformer_layer_seconds(block, 1, device, default_kernel_model(), compiled=True)
    slow = transformer_layer_seconds(block, 1, device, default_kernel_model())
    assert fast.fwd < slow.fwd and fast.bwd < slow.bwd
    assert compiled.costs.oracle.layer_costs(device).fwd[1] == fast.fwd
    written = predict(Plan.loads(compiled.plan.dumps()))
    assert written.metrics["iteration_time_s"] < predict(Plan.loads(eager.plan.dumps())).metrics["iteration_time_s"]


def test_a_written_plan_is_checked_again():
    built = build_plan(PlanInputs(LLAMA, "2xH100", "1f1b", microbatches=2, compiled=True))
    moved = dataclasses.replace(built.plan, topology="2xcpu")
    with pytest.raises(SpecError, match="needs GPUs"):
        predict(Plan.loads(moved.dumps()))
