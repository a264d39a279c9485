"""The optimizer step's kernels: mixed-precision Adam as Megatron runs it with apex's multi-tensor FusedAdam."""

from __future__ import annotations

from sim.cost.kernels.record import STAT_BYTES, Kernel, check, mem

__all__ = ["optimizer_kernels"]


def optimizer_kernels(params: int, *, dtype_bytes: int = 2, loss_scaling: bool = True) -> tuple[Kernel, ...]:
    """The mixed-precision Adam step over ``params`` parameters (Megatron's ``Float16OptimizerWithFloat16Params``
    with apex's multi-tensor FusedAdam; the states of ZeRO §3.1): with fp16 loss scaling, an unscale-and-inf-check
    pass over the fp32 gradients (read and written); the Adam update (reads the fp32 gradient, master weight, m and
    v, writes the master weight, m and v); the copy of the master weights into the training-dtype weights. In fp32
    (``dtype_bytes`` 4) there is no master copy and no loss scaling."""
    check(params=params, dtype_bytes=dtype_bytes)
    f32 = STAT_BYTES
    kernels = []
    if loss_scaling and dtype_bytes < f32:
        kernels.append(mem("grad_unscale_inf_check", "optimizer", params, 2, 2 * params * f32))
    kernels.append(mem("adam", "optimizer", params, 12, 7 * params * f32))
    if dtype_bytes < f32:
        kernels.append(mem("master_to_model_copy", "optimizer", params, 0, params * (f32 + dtype_bytes)))
    return tuple(kernels)
