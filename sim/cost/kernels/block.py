"""One decoder block on one tensor-parallel rank, in execution order: Megatron's pre-LN block, its column- and
row-parallel linears around the attention core and the MLP; its parameter count; and what a recompute mode re-runs
before the block's backward (Korthikanti et al. §5)."""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.cost.kernels.attention import attention_core
from sim.cost.kernels.elementwise import dropout_add, layer_norm, residual_grad_add
from sim.cost.kernels.record import ADD_FLOPS, FP8_BYTES, GELU_FLOPS, Kernel, Narrow, check, gemm, mem

__all__ = ["block_kernels", "block_parameters", "layer_step_kernels", "linear_kernels", "cast_kernel",
           "rowwise_cast_kernels",
           "RECOMPUTE_MODES"]

#: What ``layer_step_kernels`` may recompute: nothing, the attention core (selective), or the whole block (full).
RECOMPUTE_MODES = ("none", "selective", "full")


def linear_kernels(name: str, tokens: int, n_in: int, n_out: int, db: int, backward: bool, fused_bias: bool, *,
                   bias_grad: bool = True, narrow: Narrow | None = None, compiled: bool = False,
                   cast_input: bool = True) -> list[Kernel]:
    """Y[T×out] = X[T×in]·W[in×out]; backward: dgrad dX = dY·Wᵀ, wgrad dW = Xᵀ·dY, and (``bias_grad``) the bias
    gradient, a column sum of dY. In a GPT block only the QKV linear adds its bias in the GEMM (``fused_bias``); the
    others are built with ``skip_bias_add`` and leave it to the fused bias+GELU and bias+dropout+add kernels, whose
    backward yields the same column sum. The wgrad writes dW in the training dtype; Megatron's gradient-accumulation
    fusion would instead read and write an fp32 main gradient (not modelled here).

    With ``narrow`` the three GEMMs take low-precision operands (:class:`sim.cost.kernels.record.Narrow`), each cast
    first. Tensorwise FP8 (torchao's Float8Linear with dynamic scaling, as torchtitan converts its linears): an amax
    pass (one read) then a scale-and-cast pass (a read and a one-byte write) of the input and the weight before the
    forward and of the output gradient before the backward, and the backward's operands in the other major order (X
    and W transposed for the wgrad and dgrad, dY for the wgrad: one-byte copies); ``compiled`` (torch.compile, as
    torchtitan runs FP8): each cast writes both major orders in its one pass, so the transposes are not kernels of
    their own (two one-byte writes per cast value). Block-scaled formats (MXFP8, NVFP4; Transformer Engine's
    quantizers): one pass per operand, no amax pass (each block's scale comes from its own values), writing both the
    row-wise and the column-wise blocks the forward and backward GEMMs read (the scales along the reduction axis
    differ per order), values and scales. Rowwise FP8 (torchao's ``rowwise`` recipe): two passes per operand, compiled
    or not (:func:`rowwise_cast_kernels`), and the GEMMs at the format's ``gemm_share``. ``cast_input`` False: the
    input's cast is another linear's (an identical
    cast of the same tensor is made once: q, k and v share theirs, as do the gate and up projections)."""
    if narrow is not None and narrow.rowwise:
        roles = ((["input"] if cast_input else []) + ["weight"]) if not backward else ["weight", "grad"]
        sizes = {"input": tokens * n_in, "weight": n_in * n_out, "grad": tokens * n_out}
        casts = [kernel for role in roles for kernel in rowwise_cast_kernels(name, role, sizes[role], db, backward)]
    elif not backward:
        casts = ([cast_kernel(name + "_cast_input", tokens * n_in, db, narrow, compiled)] if cast_input else []) \
            + [cast_kernel(name + "_cast_weight", n_in * n_out, db, narrow, compiled)] if narrow else []
    else:
        casts = [cast_kernel(name + "_cast_grad", tokens * n_out, db, narrow, compiled)] if narrow else []
    if not backward:
        return [*casts, gemm(name, tokens, n_out, n_in, db, bias=fused_bias, narrow=narrow)]
    if narrow and not narrow.block_scaled and not narrow.rowwise and not compiled:
        casts += [mem(f"{name}_transpose_{what}", "elementwise", count, 0, 2 * count * FP8_BYTES)
                  for what, count in (("input", tokens * n_in), ("weight", n_in * n_out), ("grad", tokens * n_out))]
    kernels = [*casts, gemm(name + "_dgrad", tokens, n_in, n_out, db, narrow=narrow),
               gemm(name + "_wgrad", n_in, n_out, tokens, db, narrow=narrow)]
    if bias_grad:
        kernels.append(mem(name + "_bias_grad", "elementwise", tokens * n_out, ADD_FLOPS,
                           (tokens * n_out + n_out) * db))
    return kernels


def rowwise_cast_kernels(name: str, role: str, count: int, db: int, backward: bool) -> list[Kernel]:
    """The kernels that cast one operand of a linear to rowwise-scaled FP8, in the forward (``backward`` False) or
    the backward, as torchao's roofline of its ``rowwise`` recipe counts their traffic
    (``torchao/testing/training/roofline_utils.py``, ``get_tensor_memory_traffic_ovhd_s``, unfused).

    Each GEMM reads its operands scaled along its own reduction axis, so every operand is needed in both major
    orders with its own row scales, and a row's scale needs the whole row: a cast cannot write the other order's
    values in the same pass (which tensorwise does, one scale serving both). ``role``:

    * ``input`` (forward) and ``grad`` (backward): one pass reads the value in the training dtype and writes its FP8
      rows and a transposed copy in the training dtype; a second reads that copy and writes its FP8 rows
      (``db + 1 + db`` then ``db + 1`` bytes per value);
    * ``weight``: in the forward one pass (``db + 1`` bytes per value); in the backward a transpose in the training
      dtype (``2·db``) and its cast (``db + 1``).
    """
    if role not in ("input", "grad", "weight"):
        raise SpecError(f"a rowwise cast is of an input, a weight or a gradient, got {role!r}")
    if role == "weight":
        if not backward:
            return [mem(f"{name}_cast_weight", "elementwise", count, 2, count * (db + FP8_BYTES))]
        return [mem(f"{name}_transpose_weight", "elementwise", count, 0, count * 2 * db),
                mem(f"{name}_cast_weight_t", "elementwise", count, 2, count * (db + FP8_BYTES))]
    return [mem(f"{name}_cast_{role}", "elementwise", count, 2, count * (2 * db + FP8_BYTES)),
            mem(f"{name}_cast_{role}_t", "elementwise", count, 2, count * (db + FP8_BYTES))]


def cast_kernel(name: str, count: int, db: int, narrow: Narrow, both_orders: bool = False) -> Kernel:
    """A cast of ``count`` values in the training dtype to ``narrow``: tensorwise, the amax (one read), then scale
    and cast (a read and a one-byte write, two with ``both_orders``); block-scaled, one read and both orders'
    values and scales written (:func:`linear_kernels`)."""
    if narrow.block_scaled:
        return mem(name, "elementwise", count, 2, count * db + 2 * narrow.stored_bytes(count))
    return mem(name, "elementwise", count, 2, count * (2 * db + FP8_BYTES * (1 + both_orders)))


def _shard(b: int, s: int, h: int, a: int, t: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """``(tokens, tokens a LayerNorm or dropout sees, hidden size on this rank)`` of a block split ``t`` ways; the
    sizes checked (heads divide h, the rank count divides the heads, and the sequence under sequence parallelism)."""
    check(b=b, s=s, h=h, a=a, t=t)
    if h % a:
        raise SpecError(f"hidden size {h} is not divisible by the {a} heads")
    if a % t:
        raise SpecError(f"{a} heads are not divisible by tensor-parallel degree {t}")
    if sequence_parallel and s % t:
        raise SpecError(f"sequence length {s} is not divisible by tensor-parallel degree {t} (sequence parallel)")
    tokens = b * s
    return tokens, tokens // t if sequence_parallel else tokens, h // t


def block_kernels(b: int, s: int, h: int, a: int, t: int, *, sequence_parallel: bool, backward: bool,
                  dtype_bytes: int = 2, flash: bool = False) -> tuple[Kernel, ...]:
    """One decoder block's kernels on one of ``t`` tensor-parallel ranks, in execution order.

    Args:
        b, s, h, a: microbatch size, sequence length, hidden size, attention heads (FFN hidden 4h).
        t: tensor-parallel degree: QKV and MLP-up GEMMs split their outputs, the output projection and MLP-down
            GEMMs their inputs, attention its heads (Megatron's column/row-parallel linears).
        sequence_parallel: LayerNorms and dropouts work on s/t of the sequence (Korthikanti §4.2.2); without it every
            rank runs them on the whole b·s·h.
        backward: the backward pass (the reverse order, each GEMM's dgrad then wgrad) instead of the forward.
        dtype_bytes: bytes per activation and weight value (2 for fp16/bf16).
        flash: attention as one FlashAttention kernel instead of QKᵀ, softmax, dropout and attention over V.
    """
    check(dtype_bytes=dtype_bytes)
    tokens, norm_tokens, hp = _shard(b, s, h, a, t, sequence_parallel)
    db, ap, ffn = dtype_bytes, a // t, 4 * h // t
    attention = attention_core(b, s, hp, ap, db, flash, backward)
    if not backward:
        return tuple([
            layer_norm("input_layernorm", norm_tokens, h, db, False),
            *linear_kernels("qkv", tokens, h, 3 * hp, db, False, True),
            *attention,
            *linear_kernels("attention_output", tokens, hp, h, db, False, False),
            dropout_add("attention_dropout_add", norm_tokens, h, db, False),
            layer_norm("post_attention_layernorm", norm_tokens, h, db, False),
            *linear_kernels("mlp_up", tokens, h, ffn, db, False, False),
            mem("bias_gelu", "elementwise", tokens * ffn, GELU_FLOPS, (2 * tokens * ffn + ffn) * db),
            *linear_kernels("mlp_down", tokens, ffn, h, db, False, False),
            dropout_add("mlp_dropout_add", norm_tokens, h, db, False),
        ])
    return tuple([
        dropout_add("mlp_dropout_add", norm_tokens, h, db, True),
        *linear_kernels("mlp_down", tokens, ffn, h, db, True, False),
        # reads dY and the saved GELU input, writes dX
        mem("bias_gelu_bwd", "elementwise", tokens * ffn, 2 * GELU_FLOPS, 3 * tokens * ffn * db),
        *linear_kernels("mlp_up", tokens, h, ffn, db, True, False),
        layer_norm("post_attention_layernorm", norm_tokens, h, db, True),
        residual_grad_add("attention_residual_grad_add", norm_tokens, h, db),
        dropout_add("attention_dropout_add", norm_tokens, h, db, True),
        *linear_kernels("attention_output", tokens, hp, h, db, True, False),
        *attention,
        *linear_kernels("qkv", tokens, h, 3 * hp, db, True, True),
        layer_norm("input_layernorm", norm_tokens, h, db, True),
        residual_grad_add("input_residual_grad_add", norm_tokens, h, db),
    ])


def layer_step_kernels(b: int, s: int, h: int, a: int, t: int, *, sequence_parallel: bool, recompute: str = "none",
                       dtype_bytes: int = 2, flash: bool = False) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """A block's (forward, backward) kernels of one microbatch under a recompute mode; the backward starts with
    what it recomputes. ``full``: Megatron re-runs the whole block's forward from its checkpointed input before its
    backward. ``selective`` (Korthikanti §5): it re-runs QKᵀ, softmax, softmax dropout and attention over V; with
    FlashAttention nothing (the kernel stores no b·a·s² tensor and recomputes its scores in its own backward)."""
    if recompute not in RECOMPUTE_MODES:
        raise SpecError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    kwargs = dict(sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes, flash=flash)
    forward = block_kernels(b, s, h, a, t, backward=False, **kwargs)
    backward = block_kernels(b, s, h, a, t, backward=True, **kwargs)
    if recompute == "full":
        again = forward
    elif recompute == "selective" and not flash:
        again = tuple(attention_core(b, s, h // t, a // t, dtype_bytes, False, False))
    else:
        again = ()
    return forward, tuple(Kernel("recompute_" + k.name, k.kind, k.flops, k.bytes, k.gemm, k.batch) for k in again) \
        + backward


def block_parameters(h: int, t: int) -> int:
    """Parameters of one decoder block on one of ``t`` tensor-parallel ranks: the split QKV (3h·h/t + 3h/t), output
    projection (h·h/t + h), MLP up (4h·h/t + 4h/t) and down (4h·h/t + h) weights and biases (row-parallel biases
    are whole on every rank), and the two LayerNorms' γ and β (4h)."""
    check(h=h, t=t)
    if h % t:
        raise SpecError(f"hidden size {h} is not divisible by tensor-parallel degree {t}")
    return 12 * h * h // t + 7 * h // t + 2 * h + 4 * h
