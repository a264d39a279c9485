"""``--fsdp-float8-all-gather``: FSDP gathers each block's linear weights in FP8 (torchao's Float8Linear with
``enable_fsdp_float8_all_gather``). Oracles: the block's parameter count in closed form, the per-layer collectives
built without the option, a written plan predicting as the built one, and refusals."""

import pytest

from sim.core.errors import SpecError
from sim.ir.plan import Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

SPEC = "llama:layers=4,hidden=512,heads=8,kv_heads=2,ffn=1536,vocab=1000,seq=1024"


def _built(gather: bool, **extra):
    return build_plan(PlanInputs(SPEC, "8xH100", "1f1b", 2, dp=8, zero=3, precision="fp8", fsdp_float8_gather=gather,
                                 **extra))


def test_a_block_is_gathered_at_one_byte_a_linear_weight():
    # By hand for SPEC: q 512x512, k and v 512x128 (2 of 8 heads' 64), o 512x512, the SwiGLU 3 x 512x1536, and two
    # RMSNorm weights of 512.
    linears = 512 * 512 + 2 * 512 * 128 + 512 * 512 + 3 * 512 * 1536
    norms = 2 * 512
    for gather, expected in ((False, 2 * (linears + norms)), (True, linears + 2 * norms)):
        built = _built(gather)
        view, device = built.costs, built.topology.devices[0]
        blocks = [i for i, layer in enumerate(view.graph.layers)
                  if layer.transformer is not None and layer.transformer.part == "block"]
        assert len(blocks) == 4
        assert {view.gather_bytes(i, device) for i in blocks} == {expected}
        # the embedding and the head are gathered as they are
        others = [i for i in range(len(view.graph.layers)) if i not in blocks]
        assert all(view.gather_bytes(i, device) == view.oracle.memory.param_bytes(i, i + 1, device) for i in others)


def test_it_gathers_faster_holds_less_and_a_written_plan_predicts_the_same():
    plain, float8 = _built(False), _built(True)
    assert float8.plan.layout.fsdp_float8_gather and '"fsdp_float8_gather": true' in float8.plan.dumps()
    assert "fsdp_float8_gather" not in plain.plan.dumps()
    slow, fast = predict_built(plain), predict_built(float8)
    assert fast.metrics["iteration_time_s"] <= slow.metrics["iteration_time_s"]
    peak = [max(d["peak_memory_bytes"] for d in p.metrics["devices"]) for p in (slow, fast)]
    assert peak[1] < peak[0]
    again = predict(Plan.loads(float8.plan.dumps()))
    assert again.metrics["iteration_time_s"] == fast.metrics["iteration_time_s"]


@pytest.mark.parametrize("extra, message", [
    ({"zero": 1}, "needs zero 3"), ({"precision": "bf16"}, "needs --precision fp8"),
    ({"precision": "fp8-rowwise"}, "needs --precision fp8"),
])
def test_without_fsdp_or_tensorwise_fp8_it_is_refused(extra, message):
    inputs = dict(dp=8, zero=3, precision="fp8", fsdp_float8_gather=True)
    inputs.update(extra)
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(SPEC, "8xH100", "1f1b", 2, **inputs))
