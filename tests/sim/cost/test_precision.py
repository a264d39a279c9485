"""``--precision``: FP8 peaks in the catalog, FP8 GEMMs and their casts in the kernel model, and who may ask for
what."""

import dataclasses

import pytest

from sim.core.errors import SpecError
from sim.cost.gpu_time import default_kernel_model, kernel_seconds
from sim.cost.kernels.block import linear_kernels
from sim.cost.kernels.llama import LlamaBlockShape, llama_block_kernels, llama_head_kernels
from sim.cost.kernels.record import FP8, gemm
from sim.cost.model_flops import training_rates
from sim.hw.catalog import get_device
from sim.ir.plan import Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict

LLAMA = "llama:layers=2,hidden=1024,heads=8,kv_heads=2,ffn=2816,vocab=1000,seq=1024"


@pytest.mark.parametrize("name, tflops, efficiency", [("H100", 1979.0, 0.71), ("H200", 1979.0, 0.71),
                                                      ("GH200", 1979.0, 0.78), ("B200", 4500.0, 0.78),
                                                      ("A100", 0.0, 0.0)])
def test_the_catalog_fp8_peaks(name, tflops, efficiency):
    # stas00/ml-engineering's TFLOPS table (fp8 column, dense) and FP8 MAMF table (H100 1402.6, GH200 1535.0 of 1979).
    device = get_device(name)
    assert device.peak_fp8_flops == tflops * 1e12 and device.fp8_matmul_efficiency == efficiency


def test_an_fp8_gemm_runs_at_the_fp8_ceiling():
    h100, model = get_device("H100"), default_kernel_model()
    size = 8192  # large enough to be bound by its FLOPs in both formats
    bf16, fp8 = gemm("g", size, size, size, 2), gemm("g", size, size, size, 2, narrow=FP8)
    assert fp8.flops == bf16.flops and fp8.bytes < bf16.bytes
    gap = model.kernel_gap_s
    ratio = (kernel_seconds(bf16, h100, model) - gap) / (kernel_seconds(fp8, h100, model) - gap)
    assert ratio == pytest.approx(1979.0 * 0.71 / (989.0 * 0.80), rel=1e-12)


def test_an_fp8_linear_casts_its_operands():
    tokens, n_in, n_out, db = 64, 32, 48, 2
    forward = linear_kernels("w", tokens, n_in, n_out, db, False, False, bias_grad=False, narrow=FP8)
    backward = linear_kernels("w", tokens, n_in, n_out, db, True, False, bias_grad=False, narrow=FP8)
    plain = linear_kernels("w", tokens, n_in, n_out, db, True, False, bias_grad=False)
    # The amax read, then a read and a one-byte write, for the input and the weight; the output gradient's cast and
    # three one-byte transposes backward; the same FLOPs as in bf16.
    assert [k.bytes for k in forward[:2]] == [tokens * n_in * 5, n_in * n_out * 5]
    assert [k.name for k in backward[:4]] == ["w_cast_grad", "w_transpose_input", "w_transpose_weight",
                                              "w_transpose_grad"]
    assert backward[0].bytes == tokens * n_out * 5 and backward[1].bytes == 2 * tokens * n_in
    assert sum(k.flops for k in backward if k.kind == "gemm") == sum(k.flops for k in plain if k.kind == "gemm")
    assert all(k.narrow is FP8 for k in backward if k.kind == "gemm")


def test_fp8_reaches_the_linears_only():
    shape = LlamaBlockShape(1, 512, 256, 4, 2, 64, 704, 1)
    kernels = llama_block_kernels(shape, backward=False, narrow=FP8)
    assert all(k.narrow is FP8 for k in kernels if k.kind == "gemm")
    assert not any(k.narrow for k in kernels if k.kind != "gemm")
    assert not any(k.narrow for k in llama_head_kernels(1, 512, 256, 1000, 1, backward=False))  # the LM head stays bf16


def _iteration(model, precision):
    built = build_plan(PlanInputs(model, "2xH100", "1f1b", microbatches=4, precision=precision))
    return built, predict(built.plan, topology=built.topology).metrics["iteration_time_s"]


def test_fp8_pays_off_on_large_gemms_only_and_its_mfu_counts_the_fp8_peak():
    # Two Llama 3.1 8B blocks at seq 4096: faster, but by less than the peaks' ratio (attention, the LM head and the
    # elementwise work stay as they were, and the casts are added).
    large = "llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=4096"
    (_, slow), (fp8, fast) = _iteration(large, "bf16"), _iteration(large, "fp8")
    assert dict(fp8.plan.options)["precision"] == "fp8"
    assert fast < slow < fast * 1979.0 / 989.0
    rates = training_rates(fp8.plan, fp8.topology, fast)
    assert rates["mfu"] == pytest.approx(rates["model_flops_per_iteration"] / fast / (2 * 1979e12), rel=1e-12)
    # On small GEMMs the casts' passes and launches cost more than the faster GEMMs save.
    assert _iteration(LLAMA, "fp8")[1] > _iteration(LLAMA, "bf16")[1]


@pytest.mark.parametrize("model, topology, precision, message", [
    (LLAMA, "2xA100", "fp8", "fp8 needs FP8 tensor cores; a100-sxm4-80gb has none"),
    ("gpt:layers=2", "2xH100", "fp8", "fp8 is modelled for the llama and moe families"),
    (LLAMA, "2xH100", "fp32", "fp32 is not modelled for llama"),
    ("cnn:layers=2", "2xH100", "bf16", "modelled in fp32 only"),
    (LLAMA, "2xcpu", "fp8", "cpu has none"),
])
def test_what_cannot_take_a_precision_is_refused(model, topology, precision, message):
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(model, topology, "1f1b", microbatches=2, precision=precision))


def test_a_written_plan_is_checked_again():
    built = build_plan(PlanInputs(LLAMA, "2xH100", "1f1b", microbatches=2, precision="fp8"))
    moved = dataclasses.replace(built.plan, topology="2xA100")
    with pytest.raises(SpecError, match="a100-sxm4-80gb has none"):
        predict(Plan.loads(moved.dumps()))


def test_block_scaled_formats_run_on_their_tensor_cores_with_their_scales():
    from sim.cost.kernels.record import MXFP8, NVFP4

    model, b200 = default_kernel_model(), get_device("B200")
    size = 8192
    fp8, mx, nv = (gemm("g", size, size, size, 2, narrow=fmt) for fmt in (FP8, MXFP8, NVFP4))
    operands = 2 * size * size
    # one byte a value, plus an E8M0 scale per 32 (MXFP8) or half a byte plus an E4M3 scale per 16 (NVFP4)
    assert mx.bytes - fp8.bytes == operands / 32 and nv.bytes == fp8.bytes - operands / 2 + operands / 16
    gap = model.kernel_gap_s
    # large enough to be compute bound: MXFP8 at the FP8 peak, NVFP4 at the FP4 peak (twice B200's FP8)
    assert kernel_seconds(mx, b200, model) == pytest.approx(kernel_seconds(fp8, b200, model), rel=1e-9)
    ratio = (kernel_seconds(fp8, b200, model) - gap) / (kernel_seconds(nv, b200, model) - gap)
    assert ratio == pytest.approx(b200.peak_fp4_flops / b200.peak_fp8_flops, rel=1e-9)
    # a block-scaled cast: one read, both orders' values and scales written; no amax pass, no transposes
    forward = linear_kernels("w", 64, 32, 48, 2, False, False, bias_grad=False, narrow=NVFP4)
    assert forward[0].bytes == 64 * 32 * 2 + 2 * (64 * 32 * 0.5 + 64 * 32 / 16)
    backward = linear_kernels("w", 64, 32, 48, 2, True, False, bias_grad=False, narrow=MXFP8)
    assert not any("transpose" in k.name for k in backward)


@pytest.mark.parametrize("precision, topology, message", [
    ("mxfp8", "2xH100", "mxfp8 is block-scaled, which Blackwell's tensor cores run; h100-sxm5-80gb has no FP4 peak"),
    ("nvfp4", "2xA100", "nvfp4 needs FP8 tensor cores; a100-sxm4-80gb has none"),
])
def test_block_scaled_formats_need_blackwell(precision, topology, message):
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(LLAMA, topology, "1f1b", microbatches=2, precision=precision))


def test_nvfp4_mfu_counts_the_fp4_peak():
    built = build_plan(PlanInputs(LLAMA, "2xB200", "1f1b", microbatches=2, precision="nvfp4"))
    rates = training_rates(built.plan, built.topology, 1.0)
    assert rates["mfu"] == pytest.approx(rates["model_flops_per_iteration"] / (2 * get_device("B200").peak_fp4_flops))


# --- Float8 rowwise (torchao's "rowwise" recipe) ---------------------------------------------------------------------


def test_a_rowwise_linear_casts_each_operand_in_two_passes_as_torchaos_roofline_counts():
    """Bytes per value from torchao's roofline of its rowwise recipe (``roofline_utils.py``, unfused, bf16 in,
    float8 out): input and output gradient 2+1+2 then 2+1; the weight 2+1 forward, a bf16 transpose 2+2 and 2+1
    backward. Compiled or not alike."""
    from sim.cost.kernels.record import FP8_ROWWISE

    tokens, n_in, n_out, db = 64, 32, 48, 2
    for compiled in (False, True):
        forward = linear_kernels("w", tokens, n_in, n_out, db, False, False, bias_grad=False, narrow=FP8_ROWWISE,
                                 compiled=compiled)
        backward = linear_kernels("w", tokens, n_in, n_out, db, True, False, bias_grad=False, narrow=FP8_ROWWISE,
                                  compiled=compiled)
        casts = {k.name: k.bytes for k in [*forward, *backward] if k.kind != "gemm"}
        assert casts == {"w_cast_input": tokens * n_in * 5, "w_cast_input_t": tokens * n_in * 3,
                         "w_cast_weight": n_in * n_out * 3, "w_transpose_weight": n_in * n_out * 4,
                         "w_cast_weight_t": n_in * n_out * 3, "w_cast_grad": tokens * n_out * 5,
                         "w_cast_grad_t": tokens * n_out * 3}
        assert all(k.narrow is FP8_ROWWISE for k in [*forward, *backward] if k.kind == "gemm")
    # q, k and v share their input's cast: without it the forward casts the weight alone
    shared = linear_kernels("k", tokens, n_in, n_out, db, False, False, narrow=FP8_ROWWISE, cast_input=False)
    assert [k.name for k in shared if k.kind != "gemm"] == ["k_cast_weight"]


def test_a_rowwise_gemm_runs_at_its_share_of_the_fp8_ceiling():
    from sim.cost.kernels.record import FP8_ROWWISE, ROWWISE_GEMM_SHARE

    h100, model = get_device("H100"), default_kernel_model()
    size = 8192  # compute bound in both
    tensorwise, rowwise = gemm("g", size, size, size, 2, narrow=FP8), gemm("g", size, size, size, 2, narrow=FP8_ROWWISE)
    gap = model.kernel_gap_s
    ratio = (kernel_seconds(rowwise, h100, model) - gap) / (kernel_seconds(tensorwise, h100, model) - gap)
    assert ratio == pytest.approx(1 / ROWWISE_GEMM_SHARE, rel=1e-12)
    assert ROWWISE_GEMM_SHARE == 0.9  # pytorch/pytorch issue 147971: "most shapes within 90-100%"


def test_rowwise_lies_between_bf16_and_tensorwise_on_large_linears_as_torchao_measured():
    # torchao's e2e table (Llama3-8b, 8xH100, torchtitan, compile, FSDP2): bf16 6150, tensorwise 7689.5, rowwise 6768
    # tokens/s: rowwise faster than bf16 and slower than tensorwise. The ordering is the oracle, not the figures.
    large = "llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=4096"
    bf16, tensorwise, rowwise = (_iteration(large, p)[1] for p in ("bf16", "fp8", "fp8-rowwise"))
    assert tensorwise < rowwise < bf16


@pytest.mark.parametrize("topology, message", [
    ("2xA100", "fp8-rowwise needs FP8 tensor cores; a100-sxm4-80gb has none"),
])
def test_rowwise_needs_fp8_tensor_cores_not_blackwell(topology, message):
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(LLAMA, topology, "1f1b", microbatches=2, precision="fp8-rowwise"))
    built = build_plan(PlanInputs(LLAMA, "2xH100", "1f1b", microbatches=2, precision="fp8-rowwise"))
    assert dict(built.plan.options)["precision"] == "fp8-rowwise"
