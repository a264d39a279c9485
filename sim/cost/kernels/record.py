"""A kernel launch as the inventory records it, the two ways one is built (a GEMM from its shape, a memory-bound
kernel from its element count and bytes), the argument check every family shares, and the byte sizes of the values
that are not in the training dtype."""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError

__all__ = ["Kernel", "KINDS", "MASK_BYTES", "STAT_BYTES", "TOKEN_ID_BYTES", "FP8_BYTES", "LN_FLOPS", "SOFTMAX_FLOPS",
           "DROPOUT_FLOPS", "GELU_FLOPS", "ADD_FLOPS", "gemm", "grouped_gemm", "mem", "check"]

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
    shape ``gemm = (M, N, K)`` of each of ``batch`` independent products (FLOPs = 2·batch·M·N·K); ``fp8``: a GEMM
    on FP8 inputs, run on the FP8 tensor cores; ``group``: a grouped GEMM (the experts of a mixture, one launch),
    the M of each of its products, which share N and K (``gemm``'s M is their sum, ``batch`` 1)."""

    name: str
    kind: str
    flops: float
    bytes: float
    gemm: tuple[int, int, int] | None = None
    batch: int = 1
    fp8: bool = False
    group: tuple[int, ...] = ()


#: Bytes per FP8 value (float8_e4m3fn, float8_e5m2).
FP8_BYTES = 1


def gemm(name: str, m: int, n: int, k: int, db: int, *, batch: int = 1, bias: bool = False,
         fp8: bool = False) -> Kernel:
    """C[M×N] = A[M×K]·B[K×N] (``batch`` times): reads A and B, writes C; a fused bias reads N more values. With
    ``fp8`` A and B are FP8 (one byte each) and C is written in the training dtype."""
    operand = FP8_BYTES if fp8 else db
    return Kernel(name, "gemm", 2.0 * batch * m * n * k,
                  float(batch * ((m * k + k * n) * operand + m * n * db) + bias * n * db), (m, n, k), batch, fp8)


def grouped_gemm(name: str, ms: tuple[int, ...], n: int, k: int, db: int, *, fp8: bool = False) -> Kernel:
    """One grouped GEMM: C_e[M_e×N] = A_e[M_e×K]·B_e[K×N] for each M_e of ``ms`` (an expert's tokens), one launch:
    reads each A_e and the weights B_e of every expert that received tokens (one that received none has no tile),
    writes each C_e. ``fp8``: FP8 operands."""
    operand = FP8_BYTES if fp8 else db
    rows = sum(ms)
    weights = sum(1 for m in ms if m) * k * n
    return Kernel(name, "gemm", 2.0 * rows * n * k, float((rows * k + weights) * operand + rows * n * db),
                  (rows, n, k), 1, fp8, tuple(ms))


def mem(name: str, kind: str, elements: int, flops_per_element: int, nbytes: float) -> Kernel:
    """A memory-bound kernel over ``elements`` values: ``flops_per_element`` each (approximate), ``nbytes`` moved."""
    return Kernel(name, kind, float(flops_per_element * elements), float(nbytes))


def check(**values: int) -> None:
    """Every keyword a positive integer (a size or degree), else a SpecError naming it and its value."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{key} must be a positive integer, got {value!r}")
