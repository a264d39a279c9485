"""A kernel launch as the inventory records it, the two ways one is built (a GEMM from its shape, a memory-bound
kernel from its element count and bytes), the argument check every family shares, and the byte sizes of the values
that are not in the training dtype."""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError

__all__ = ["Kernel", "KINDS", "MASK_BYTES", "STAT_BYTES", "TOKEN_ID_BYTES", "FP8_BYTES", "LN_FLOPS", "SOFTMAX_FLOPS",
           "DROPOUT_FLOPS", "GELU_FLOPS", "ADD_FLOPS", "Narrow", "FP8", "FP8_ROWWISE", "ROWWISE_GEMM_SHARE", "MXFP8",
           "NVFP4", "NARROW_FORMATS", "gemm", "grouped_gemm", "mem", "check"]

#: Kernel kinds: how a cost model should treat one.
KINDS = ("gemm", "attention", "elementwise", "norm", "softmax", "dropout", "loss", "optimizer")
#: Bytes per dropout-mask element (Korthikanti §4.1: "a mask of size ... 1 byte").
MASK_BYTES = 1
#: Bytes per LayerNorm statistic (mean, 1/σ) and per log-sum-exp value: kept in fp32 by apex's fused LayerNorm
#: and by FlashAttention.
STAT_BYTES = 4
#: Bytes per token id (int64 in Megatron's data loader).
TOKEN_ID_BYTES = 8

# Approximate FLOPs per element of the memory-bound kernels (they are costed by bytes; these are for completeness).
LN_FLOPS, SOFTMAX_FLOPS, DROPOUT_FLOPS, GELU_FLOPS, ADD_FLOPS = 8, 5, 2, 8, 1


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: ``flops`` (FLOP), ``bytes`` (bytes read + written in device memory), and for GEMMs the
    shape ``gemm = (M, N, K)`` of each of ``batch`` independent products (FLOPs = 2·batch·M·N·K); ``narrow``: a GEMM
    on low-precision operands (:class:`Narrow`), run on the tensor cores of that format; ``group``: a grouped GEMM
    (the experts of a mixture, one launch), the M of each of its products, which share N and K (``gemm``'s M is
    their sum, ``batch`` 1)."""

    name: str
    kind: str
    flops: float
    bytes: float
    gemm: tuple[int, int, int] | None = None
    batch: int = 1
    narrow: Narrow | None = None
    group: tuple[int, ...] = ()


#: Bytes per FP8 value (float8_e4m3fn, float8_e5m2).
FP8_BYTES = 1


@dataclass(frozen=True)
class Narrow:
    """A low-precision GEMM format: how its operands are stored and scaled and which tensor cores multiply them.

    Attributes:
        name: ``fp8``, ``fp8-rowwise``, ``mxfp8`` or ``nvfp4`` (:data:`NARROW_FORMATS`).
        value_bytes: bytes per operand value (FP8 1, FP4 0.5).
        block: values sharing one scale factor along the reduction axis; 0: one scale per tensor (tensorwise).
        scale_bytes: bytes per block scale (E8M0 or E4M3: 1); 0 when tensorwise.
        tensor_cores: ``fp8`` or ``fp4``: the peak (``DeviceSpec.peak_fp8_flops``/``peak_fp4_flops``) it runs at.
        rowwise: one scale per row of each operand along the reduction axis (torchao's ``rowwise`` recipe), cast
            as :func:`sim.cost.kernels.block.rowwise_cast_kernels` says.
        gemm_share: the share of the format's measured GEMM ceiling (``fp8_matmul_efficiency``) its GEMM kernel
            reaches; 1 for the kernel the ceiling was measured with.
    """

    name: str
    value_bytes: float
    block: int
    scale_bytes: int
    tensor_cores: str
    rowwise: bool = False
    gemm_share: float = 1.0

    @property
    def block_scaled(self) -> bool:
        """Scaled per block (MX, NVFP4), not per tensor."""
        return self.block > 0

    def stored_bytes(self, values: float) -> float:
        """Bytes of ``values`` operand values in this format, their block scales included."""
        return values * self.value_bytes + (values / self.block * self.scale_bytes if self.block else 0.0)


#: Tensorwise FP8 (torchao's Float8Linear with dynamic scaling, Transformer Engine's current scaling "FP8-CS"): one
#: fp32 scale per tensor from its amax.
FP8 = Narrow("fp8", FP8_BYTES, 0, 0, "fp8")
#: The share of the tensorwise FP8 GEMM's speed that PyTorch's rowwise-scaled GEMM reaches on Hopper [assumed]:
#: ``torch._scaled_mm`` with tensorwise scales calls cuBLAS, with rowwise scales a CUTLASS kernel of PyTorch's own,
#: and its maintainers measured "most shapes within 90-100% of tensor-wise efficiency, ... a long tail going down to
#: 50%" (pytorch/pytorch issue 147971, fast accumulation, H100). The lower end of the bulk; not fitted to any run.
ROWWISE_GEMM_SHARE = 0.9
#: Rowwise FP8 (torchao's ``Float8Linear`` with the ``rowwise`` recipe, torchtitan's ``float8.recipe_name =
#: "rowwise"``): an fp32 scale per row of each operand, e4m3 values, on the FP8 tensor cores.
FP8_ROWWISE = Narrow("fp8-rowwise", FP8_BYTES, 0, 0, "fp8", rowwise=True, gemm_share=ROWWISE_GEMM_SHARE)
#: MXFP8 (OCP Microscaling Formats v1.0: 32-value blocks, an E8M0 power-of-two scale each), on Blackwell's tensor
#: cores at the FP8 rate.
MXFP8 = Narrow("mxfp8", FP8_BYTES, 32, 1, "fp8")
#: NVFP4 (NVIDIA's 4-bit format: E2M1 values, 16-value blocks with an E4M3 scale, and an fp32 scale per tensor; NVIDIA,
#: "Pretraining Large Language Models with NVFP4", arXiv 2509.25149 §2), at the FP4 rate.
NVFP4 = Narrow("nvfp4", 0.5, 16, 1, "fp4")
#: The formats by name.
NARROW_FORMATS = {fmt.name: fmt for fmt in (FP8, FP8_ROWWISE, MXFP8, NVFP4)}


def gemm(name: str, m: int, n: int, k: int, db: int, *, batch: int = 1, bias: bool = False,
         narrow: Narrow | None = None) -> Kernel:
    """C[M×N] = A[M×K]·B[K×N] (``batch`` times): reads A and B, writes C; a fused bias reads N more values. With
    ``narrow`` A and B are in that format (their block scales read too) and C is written in the training dtype."""
    operands = narrow.stored_bytes(m * k + k * n) if narrow else (m * k + k * n) * db
    return Kernel(name, "gemm", 2.0 * batch * m * n * k,
                  float(batch * (operands + m * n * db) + bias * n * db), (m, n, k), batch, narrow)


def grouped_gemm(name: str, ms: tuple[int, ...], n: int, k: int, db: int, *, narrow: Narrow | None = None) -> Kernel:
    """One grouped GEMM: C_e[M_e×N] = A_e[M_e×K]·B_e[K×N] for each M_e of ``ms`` (an expert's tokens), one launch:
    reads each A_e and the weights B_e of every expert that received tokens (one that received none has no tile),
    writes each C_e. ``narrow``: operands in that format."""
    rows = sum(ms)
    values = rows * k + sum(1 for m in ms if m) * k * n
    operands = narrow.stored_bytes(values) if narrow else values * db
    return Kernel(name, "gemm", 2.0 * rows * n * k, float(operands + rows * n * db), (rows, n, k), 1, narrow,
                  tuple(ms))


def mem(name: str, kind: str, elements: int, flops_per_element: int, nbytes: float) -> Kernel:
    """A memory-bound kernel over ``elements`` values: ``flops_per_element`` each (approximate), ``nbytes`` moved."""
    return Kernel(name, kind, float(flops_per_element * elements), float(nbytes))


def check(**values: int) -> None:
    """Every keyword a positive integer (a size or degree), else a SpecError naming it and its value."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{key} must be a positive integer, got {value!r}")
