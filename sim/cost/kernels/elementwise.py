"""The memory-bound kernels around a block's GEMMs: Megatron's fused LayerNorm, RMSNorm (Llama-family models), the
fused bias + dropout + residual add, and autograd's sum of the two gradients that meet at a residual stream. Each
runs on ``tokens`` rows of ``h``: all of the sequence, or s/t of it under sequence parallelism (Korthikanti et al.
§4.2.2)."""

from __future__ import annotations

from sim.cost.kernels.record import ADD_FLOPS, DROPOUT_FLOPS, LN_FLOPS, MASK_BYTES, STAT_BYTES, Kernel, mem

__all__ = ["layer_norm", "rms_norm", "dropout_add", "residual_grad_add"]


def layer_norm(name: str, tokens: int, h: int, db: int, backward: bool) -> Kernel:
    """Fused LayerNorm over ``tokens`` rows of h. Forward reads x and γ, β; writes y and fp32 mean, 1/σ. Backward
    reads dy, x, the statistics and γ; writes dx and dγ, dβ."""
    stats = 2 * tokens * STAT_BYTES
    if not backward:
        return mem(name, "norm", tokens * h, LN_FLOPS, (2 * tokens * h + 2 * h) * db + stats)
    return mem(name + "_bwd", "norm", tokens * h, 2 * LN_FLOPS, (3 * tokens * h + 3 * h) * db + stats)


def rms_norm(name: str, tokens: int, h: int, db: int, backward: bool) -> Kernel:
    """RMSNorm over ``tokens`` rows of h (Zhang and Sennrich 2019): forward reads x and γ, writes y and the fp32
    reciprocal root mean square of each row; backward reads dy, x, that statistic and γ, writes dx and dγ."""
    stats = tokens * STAT_BYTES
    if not backward:
        return mem(name, "norm", tokens * h, LN_FLOPS, (2 * tokens * h + h) * db + stats)
    return mem(name + "_bwd", "norm", tokens * h, 2 * LN_FLOPS, (3 * tokens * h + 2 * h) * db + stats)


def dropout_add(name: str, tokens: int, h: int, db: int, backward: bool) -> Kernel:
    """Megatron's fused bias + dropout + residual add. Forward reads x, the bias and the residual; writes the sum
    and the mask. Backward reads dy and the mask, writes dx (the residual's gradient is dy itself, no kernel)."""
    if not backward:
        return mem(name, "dropout", tokens * h, DROPOUT_FLOPS + 2 * ADD_FLOPS,
                    (3 * tokens * h + h) * db + tokens * h * MASK_BYTES)
    return mem(name + "_bwd", "dropout", tokens * h, DROPOUT_FLOPS, 2 * tokens * h * db + tokens * h * MASK_BYTES)


def residual_grad_add(name: str, tokens: int, h: int, db: int) -> Kernel:
    """Autograd's sum of the two gradients reaching a residual stream (the skip path and the LayerNorm's)."""
    return mem(name, "elementwise", tokens * h, ADD_FLOPS, 3 * tokens * h * db)
