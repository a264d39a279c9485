"""``--async-tp``: each tensor-parallel collective decomposed beside its GEMMs (PyTorch's async TP; Wang et al.,
ASPLOS'23). Oracles: the pairing's closed form ``max(C', A + C'/t)`` against ``C + A`` worked from the parts the
kernel model gives, the GEMMs paired with each collective by name, and refusals."""

import pytest

from sim.core.errors import SpecError
from sim.cost.gpu_time import ASYNC_TP_GEMMS, async_tp_gemm_seconds, default_kernel_model, kernel_seconds
from sim.cost.kernels.llama import LlamaBlockShape, llama_block_kernels
from sim.cost.kernels.record import gemm
from sim.ir.plan import OpKind, Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

SPEC = "llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=32000,seq=4096"


def _built(async_tp: bool, microbatch_size: int = 1, **extra):
    return build_plan(PlanInputs(SPEC, "8xH100", "1f1b", 2, tp=8, sequence_parallel=True, async_tp=async_tp,
                                 microbatch_size=microbatch_size, **extra))


def test_each_collective_is_paired_with_the_gemms_that_feed_or_follow_it():
    forward, backward = ASYNC_TP_GEMMS[False], ASYNC_TP_GEMMS[True]
    assert [name for name, _ in forward] == ["all_gather", "reduce_scatter"] * 2  # SP: gather in, scatter out
    assert forward[0][1] == ("wq", "wk", "wv") and forward[3][1] == ("w2",)
    # every GEMM of the block appears once a direction (a wgrad of a column-parallel projection needs no collective)
    shape = LlamaBlockShape(1, 4096, 4096, 32, 8, 128, 14336, 8, sequence_parallel=True)
    for direction, pairs in ((False, forward), (True, backward)):
        gemms = {k.name for k in llama_block_kernels(shape, backward=direction) if k.kind == "gemm"}
        paired = [g for _, names in pairs for g in names]
        assert len(paired) == len(set(paired)) and set(paired) <= gemms
        if not direction:
            assert set(paired) == gemms


def test_the_chunked_gemms_are_the_parts_the_kernel_model_costs():
    built = _built(True)
    part = built.costs.graph.layers[1].transformer
    device, model = built.topology.devices[0], default_kernel_model()
    pairs = async_tp_gemm_seconds(part, 1, device, model, None, False, backward=False)
    # the down projection, by hand: whole [4096 x 14336/8] x [14336/8 x 4096]; chunked 8 parts of 512 rows
    whole = kernel_seconds(gemm("w2", 4096, 4096, 1792, 2), device, model) - model.kernel_gap_s
    chunk = kernel_seconds(gemm("w2", 512, 4096, 1792, 2), device, model)
    assert pairs[3] == ("reduce_scatter", pytest.approx(whole, rel=1e-12), pytest.approx(8 * chunk - model.kernel_gap_s,
                                                                                          rel=1e-12))
    assert pairs[3][2] >= pairs[3][1]  # cutting a GEMM never makes it faster here


@pytest.mark.parametrize("microbatch_size", [1, 4])
def test_the_tp_op_keeps_what_the_pairing_does_not_hide(microbatch_size):
    plain, overlapped = _built(False, microbatch_size), _built(True, microbatch_size)
    view, t = overlapped.costs, 8
    device = overlapped.topology.devices[0]
    groups = view.layout.tp_groups(0, view.concurrent)
    hidden = 0.0
    for i, layer in enumerate(view.graph.layers):
        part = layer.transformer
        if part is None or part.part != "block":
            continue
        each = view.microbatch_size * layer.tp_comm_fwd_bytes // layer.tp_comm_fwd_count
        for name, whole, chunked in view.oracle.async_tp_gemms(i, device, False):
            a = view.oracle.collective(name, groups, each).seconds
            hidden += min(a, (whole + a) - max(chunked, a + chunked / t))  # blocking C + A against the pair
    before = plain.costs.collective_op(OpKind.TP_F, 0).seconds
    after = view.collective_op(OpKind.TP_F, 0).seconds
    assert after == pytest.approx(before - hidden, rel=1e-12)
    faster = predict_built(overlapped).metrics["iteration_time_s"] < predict_built(plain).metrics["iteration_time_s"]
    # one sequence of 4,096 tokens cut 8 ways is 512-row GEMMs, whose lost efficiency outweighs what they hide on
    # NVLink; four sequences' GEMMs are large enough to gain
    assert faster is (microbatch_size == 4) and (hidden > 0) is faster
    again = predict(Plan.loads(overlapped.plan.dumps()))
    assert again.metrics["iteration_time_s"] == predict_built(overlapped).metrics["iteration_time_s"]


@pytest.mark.parametrize("inputs, message", [
    (dict(model=SPEC, tp=8, sequence_parallel=False), "needs sequence_parallel"),
    (dict(model="gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=1000", tp=8, sequence_parallel=True),
     "llama family"),
])
def test_what_it_does_not_model_is_refused(inputs, message):
    model = inputs.pop("model")
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(model, "8xH100", "1f1b", 2, async_tp=True, **inputs))


def test_the_executor_refuses_such_a_plan(tmp_path, capsys):
    from tests.executor.runs import refused

    plan = tmp_path / "plan.json"
    plan.write_text(_built(True).plan.dumps())
    assert "sequence parallelism" in refused(capsys, plan, tmp_path / "out")  # which async TP needs


def test_the_gemm_times_are_each_oracles_own():
    # two plans on one topology share its collective memo; their GEMMs differ with the microbatch size, so these
    # times must not come from it
    from sim.hw.topology import Topology

    topology = Topology.parse("8xH100")
    small = build_plan(PlanInputs(SPEC, "8xH100", "1f1b", 2, tp=8, sequence_parallel=True, async_tp=True),
                       topology).costs
    large = build_plan(PlanInputs(SPEC, "8xH100", "1f1b", 2, tp=8, sequence_parallel=True, async_tp=True,
                                  microbatch_size=4), topology).costs
    device = topology.devices[0]
    one, four = small.oracle.async_tp_gemms(1, device, False), large.oracle.async_tp_gemms(1, device, False)
    assert all(b[1] > 3 * a[1] for a, b in zip(one, four, strict=True))  # four times the tokens
