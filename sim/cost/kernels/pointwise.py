"""The memory-bound work between a Llama-family block's GEMMs and its attention kernel, run eagerly (one kernel per
aten op that torchtitan's model code dispatches) or under ``torch.compile`` (the kernels inductor fuses the same ops
into).

Eager PyTorch launches one kernel per aten op, and the Llama code people train with computes its norms and rotary
embeddings in fp32 through a chain of small ops: torchtitan's ``RMSNorm`` is ``x.float()`` → ``pow(2)`` →
``mean(-1)`` → ``+ eps`` → ``rsqrt`` → ``*`` → ``type_as`` → ``* weight`` (``torchtitan/models/norms.py`` at
9dec370, the commit of torchtitan's December 2024 H100 tables), each a pass over memory, and its backward is the
16 ops autograd derives from them; ``apply_rotary_emb`` casts q and k to fp32, multiplies them as complex numbers by
the rotation and casts back; ``repeat_kv`` copies each key/value head ``heads / kv_heads`` times before SDPA;
``F.silu(w1(x)) * w3(x)`` is two ops. The eager lists here are those ops in the order autograd runs them; a test
holds them, op by op, against what ``TorchDispatchMode`` sees torch dispatch for the same code.

``torch.compile`` (torchtitan compiles each ``TransformerBlock`` with ``fullgraph=True``; ``apply_compile`` at
9dec370) fuses the pointwise ops and reductions between two extern kernels (cuBLAS GEMMs, SDPA) into one kernel
per region, which reads each input once and writes only what leaves the region. What that gives, region by region:

* a norm reads x and γ and writes its output and the fp32 1/rms per row, the residual add before it folded in
  (it reads both addends and writes the sum too); its backward is one kernel for dx (the gradients reaching the
  norm's output summed in, the residual's gradient added) and one for dγ, a reduction over the other axis;
* SwiGLU's ``silu(a) * b`` is one kernel forward and one backward (reads dZ, a, b; writes da, db);
* the rotary embedding stays three passes per tensor, because inductor does not generate code for complex
  operators and falls back to the aten op for the complex multiply (its own warning: "Torchinductor does not
  support code generation for complex operators"); only the casts around it fuse with their neighbours (the key's
  cast back with ``repeat_kv``'s copy, the key gradient's sum over the repeated heads with its cast to fp32).

Byte conventions as in :mod:`sim.cost.kernels` (every tensor read plus every tensor written, once; a broadcast
operand at its own size). fp32 values are 4 bytes, a complex64 8.
"""

from __future__ import annotations

from sim.cost.kernels.record import ADD_FLOPS, LN_FLOPS, STAT_BYTES, Kernel, mem

__all__ = ["norm_kernels", "norm_backward_kernels", "rotary_kernels", "swiglu_kernels", "add_kernel",
           "grad_sum_kernels"]

#: Bytes of an fp32 value, and of the complex64 rotation the rotary embedding multiplies by.
F32, C64 = 4, 8
#: FLOPs per element of SiLU × up (the sigmoid, two multiplies) and of a complex rotation.
SILU_MUL_FLOPS, ROPE_FLOPS = 5, 3


def add_kernel(name: str, elements: int, db: int) -> Kernel:
    """``a + b`` of two tensors of ``elements`` values in the training dtype (a residual add, or autograd summing
    two gradients): reads both, writes the sum."""
    return mem(name, "elementwise", elements, ADD_FLOPS, 3 * elements * db)


def grad_sum_kernels(name: str, elements: int, count: int, db: int, *, compiled: bool) -> list[Kernel]:
    """The sum of ``count`` gradients of ``elements`` values each that reach one tensor (the input gradients of the
    linears a norm's output feeds), where it is not part of the norm's backward (sequence parallelism reduce-scatters
    the sum first): ``count − 1`` adds eagerly, one kernel reading all of them compiled."""
    if count < 2:
        return []
    if compiled:
        return [mem(name, "elementwise", elements, (count - 1) * ADD_FLOPS, (count + 1) * elements * db)]
    return [add_kernel(f"{name}{i}", elements, db) for i in range(count - 1)]


def norm_kernels(name: str, rows: int, width: int, db: int, *, compiled: bool,
                 residual: bool = False) -> list[Kernel]:
    """An RMSNorm's forward over ``rows`` rows of ``width``; ``residual``: the residual add that makes its input
    comes first (``h = x + attention(...)``), in its own kernel eagerly and inside the norm's kernel compiled."""
    n = rows * width
    if compiled:
        # reads x (and the other addend), γ; writes (the sum and) the output, and 1/rms per row in fp32
        return [mem(name, "norm", n, LN_FLOPS + residual * ADD_FLOPS,
                    (2 + 2 * residual) * n * db + width * db + rows * STAT_BYTES)]
    kernels = [add_kernel(name + "_residual_add", n, db)] if residual else []
    return kernels + [
        mem(name + "_to_fp32", "norm", n, 0, n * (db + F32)),
        mem(name + "_pow", "norm", n, 1, 2 * n * F32),
        mem(name + "_mean", "norm", n, 1, n * F32 + rows * F32),
        mem(name + "_add_eps", "norm", rows, 1, 2 * rows * F32),
        mem(name + "_rsqrt", "norm", rows, 1, 2 * rows * F32),
        mem(name + "_scale", "norm", n, 1, 2 * n * F32 + rows * F32),
        mem(name + "_to_dtype", "norm", n, 0, n * (F32 + db)),
        mem(name + "_weight", "norm", n, 1, 2 * n * db + width * db),
    ]


def norm_backward_kernels(name: str, rows: int, width: int, db: int, *, compiled: bool, summed_grads: int = 1,
                          skip: bool = True) -> list[Kernel]:
    """An RMSNorm's backward over ``rows`` × ``width``: the norm's output gradient is the sum of ``summed_grads``
    tensors (the input gradients of the linears it feeds, summed by autograd in ``summed_grads - 1`` adds eagerly),
    and (``skip``: a norm on the residual stream) the result is added to the gradient arriving through the skip path.

    Eagerly, autograd's ops for ``y = type_as(x32 · rsqrt(mean(x32²) + eps)) · γ``: dγ's product and sum, the
    output gradient times γ, its cast to fp32, the two products and the row sum for d(1/rms), the rsqrt's and mean's
    backward (a row-sized chain, then the mean's gradient spread over the row), pow's backward (x¹, times 2, times
    the gradient), the two branches' sum and the cast back."""
    n = rows * width
    if compiled:
        return [mem(name + "_bwd", "norm", n, 2 * LN_FLOPS + summed_grads * ADD_FLOPS,  # the grads, (skip), x → dx
                    (summed_grads + skip + 2) * n * db + rows * STAT_BYTES + width * db),
                mem(name + "_weight_grad", "norm", n, 2, 2 * n * db + rows * STAT_BYTES + width * F32)]
    adds = [add_kernel(f"{name}_input_grad_add{i}", n, db) for i in range(summed_grads - 1)]
    return adds + [
        mem(name + "_weight_grad_mul", "norm", n, 1, 3 * n * db),
        mem(name + "_grad_mul_weight", "norm", n, 1, 2 * n * db + width * db),
        mem(name + "_weight_grad_sum", "norm", n, 1, n * db + width * db),
        mem(name + "_grad_to_fp32", "norm", n, 0, n * (db + F32)),
        mem(name + "_grad_mul_x", "norm", n, 1, 3 * n * F32),
        mem(name + "_grad_mul_rstd", "norm", n, 1, 2 * n * F32 + rows * F32),
        mem(name + "_rstd_grad_sum", "norm", n, 1, n * F32 + rows * F32),
        mem(name + "_rsqrt_grad_pow", "norm", rows, 1, 2 * rows * F32),
        mem(name + "_rsqrt_grad_scale", "norm", rows, 1, 2 * rows * F32),
        mem(name + "_rsqrt_grad_mul", "norm", rows, 1, 3 * rows * F32),
        mem(name + "_mean_grad", "norm", n, 1, rows * F32 + n * F32),
        mem(name + "_pow_grad_x", "norm", n, 0, 2 * n * F32),
        mem(name + "_pow_grad_scale", "norm", n, 1, 2 * n * F32),
        mem(name + "_pow_grad_mul", "norm", n, 1, 3 * n * F32),
        mem(name + "_grad_sum", "norm", n, 1, 3 * n * F32),
        mem(name + "_grad_to_dtype", "norm", n, 0, n * (F32 + db)),
    ] + ([add_kernel(name + "_residual_grad_add", n, db)] if skip else [])


def rotary_kernels(tokens: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, db: int, *, backward: bool,
                   compiled: bool) -> list[Kernel]:
    """torchtitan's complex rotary embedding of q and k and ``repeat_kv``'s copies of k and v, for ``tokens`` tokens
    (``tokens / seq`` sequences of ``seq``) of ``q_heads`` query and ``kv_heads`` key/value heads of ``head_dim``.

    Forward, per rotated tensor of n values: cast to fp32 (n·(db + 4)), the complex multiply by the seq × d/2
    complex64 rotation (8n + 4·seq·d), the cast back (n·(4 + db)); then, with grouped heads, k and v repeated to the
    query heads (reads kv values, writes q's). Backward (k's first, as autograd runs it): the repeats' sums over the
    groups, and per tensor the cast to fp32, the rotation's conjugate materialised (a clone), the complex multiply
    and the cast back. Compiled, k's cast back writes the repeated copy directly, and k's group sum casts to fp32 in
    the same kernel (module docstring)."""
    q, kv = tokens * q_heads * head_dim, tokens * kv_heads * head_dim
    rotation = seq * head_dim // 2 * C64
    repeated = q_heads != kv_heads
    if not backward:
        kernels = []
        for tag, n in (("q", q), ("k", kv)):
            fuse_repeat = compiled and repeated and tag == "k"
            kernels += [mem(f"rotary_{tag}_to_fp32", "elementwise", n, 0, n * (db + F32)),
                        mem(f"rotary_{tag}_mul", "elementwise", n, ROPE_FLOPS, 2 * n * F32 + rotation),
                        mem(f"rotary_{tag}_to_dtype" + "_repeat" * fuse_repeat, "elementwise", n, 0,
                            n * F32 + (q if fuse_repeat else n) * db)]
        if repeated:
            if not compiled:
                kernels.append(mem("repeat_kv_k", "elementwise", q, 0, (kv + q) * db))
            kernels.append(mem("repeat_kv_v", "elementwise", q, 0, (kv + q) * db))
        return kernels
    kernels = [mem("repeat_kv_v_grad", "elementwise", q, ADD_FLOPS, (q + kv) * db)] if repeated else []
    for tag, n in (("k", kv), ("q", q)):
        fuse_sum = compiled and repeated and tag == "k"
        if repeated and tag == "k" and not compiled:
            kernels.append(mem("repeat_kv_k_grad", "elementwise", q, ADD_FLOPS, (q + kv) * db))
        kernels += [mem(f"rotary_{tag}_grad_to_fp32" + "_sum" * fuse_sum, "elementwise", n, 0,
                        (q if fuse_sum else n) * db + n * F32),
                    mem(f"rotary_{tag}_conj", "elementwise", seq * head_dim // 2, 0, 2 * rotation),
                    mem(f"rotary_{tag}_grad_mul", "elementwise", n, ROPE_FLOPS, 2 * n * F32 + rotation),
                    mem(f"rotary_{tag}_grad_to_dtype", "elementwise", n, 0, n * (F32 + db))]
    return kernels


def swiglu_kernels(elements: int, db: int, *, backward: bool, compiled: bool) -> list[Kernel]:
    """``silu(a) * b`` over ``elements`` values of each of a (the gate GEMM's output) and b (the up GEMM's).

    Eager forward: SiLU (reads a, writes silu(a)) then the product (reads both, writes it). Eager backward: the
    product's two gradients (dZ·b and dZ·silu(a), each two reads and a write) and SiLU's backward (reads its gradient
    and a, writes da). Compiled: one kernel each way (forward reads a and b, writes the product; backward reads dZ,
    a and b, writes da and db, recomputing silu(a))."""
    n = elements
    if compiled:
        return [mem("silu_mul_bwd" if backward else "silu_mul", "elementwise", n,
                    SILU_MUL_FLOPS * (1 + backward), (5 if backward else 3) * n * db)]
    if not backward:
        return [mem("silu", "elementwise", n, SILU_MUL_FLOPS - 1, 2 * n * db),
                mem("silu_mul", "elementwise", n, 1, 3 * n * db)]
    return [mem("silu_mul_grad_gate", "elementwise", n, 1, 3 * n * db),
            mem("silu_mul_grad_up", "elementwise", n, 1, 3 * n * db),
            mem("silu_bwd", "elementwise", n, SILU_MUL_FLOPS, 3 * n * db)]
