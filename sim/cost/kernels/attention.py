"""The attention core of one tensor-parallel rank: QKᵀ, the softmax (Megatron's fused kernel, or PyTorch's five in
fp32 where the fused one does not run), dropout and attention over V; or one FlashAttention kernel (Dao et al.,
FlashAttention-2 Algorithms 1 and 2), with the layout copies Megatron makes around either."""

from __future__ import annotations

import math

from sim.cost.kernels.record import DROPOUT_FLOPS, MASK_BYTES, SOFTMAX_FLOPS, STAT_BYTES, Kernel, gemm, mem

__all__ = ["fused_softmax_available", "attention_core", "FLASH_QUERY_TILE"]

#: Query rows per FlashAttention tile (FlashAttention-2 §3.3: block sizes of 64 or 128; 128 for head dims ≤ 128).
FLASH_QUERY_TILE = 128


def fused_softmax_available(b: int, heads: int, s: int, dtype_bytes: int = 2) -> bool:
    """Whether Megatron's fused causal softmax kernel runs for ``b`` sequences of ``s`` tokens over ``heads`` heads
    (this rank's), as ``FusedScaleMaskSoftmax.is_kernel_available`` decides: 16-bit input, 16 < s ≤ 4096 (2048 in
    older versions), s divisible by 4, and the b·heads attention batches divisible by 4 and by the kernel's batches
    per thread block (``get_batch_per_block``: 128 threads of warps of min(2^⌈log₂ s⌉, 32) lanes, each warp taking
    2 rows when 2^⌈log₂ s⌉ ≤ 128, else 1). Otherwise PyTorch runs the softmax as separate kernels
    (:func:`_unfused_softmax`)."""
    if dtype_bytes != 2 or not 16 < s <= 4096 or s % 4:
        return False
    pow2 = 1 << (s - 1).bit_length()
    warp = min(pow2, 32)
    per_block = (128 // warp) * (2 if pow2 <= 128 else 1)
    return (b * heads) % 4 == 0 and (b * heads) % per_block == 0


def _unfused_softmax(scores: int, s: int, db: int, backward: bool) -> list[Kernel]:
    """Megatron's fallback (``forward_torch_softmax``) over ``scores`` elements: with query-key layer scaling on (the
    default) the softmax runs in fp32, so the scores are cast up, scaled, masked (``masked_fill`` with the s × s
    causal mask, read once per kernel), softmaxed and cast down: five kernels, and their five gradients backward."""
    f32 = STAT_BYTES
    if not backward:
        return [
            mem("softmax_cast_fp32", "elementwise", scores, 0, scores * (db + f32)),
            mem("softmax_scale", "elementwise", scores, 1, 2 * scores * f32),
            mem("softmax_mask_fill", "elementwise", scores, 1, 2 * scores * f32 + s * s),
            mem("softmax_fp32", "softmax", scores, SOFTMAX_FLOPS, 2 * scores * f32),
            mem("softmax_cast_half", "elementwise", scores, 0, scores * (f32 + db)),
        ]
    return [
        mem("softmax_cast_half_bwd", "elementwise", scores, 0, scores * (db + f32)),
        mem("softmax_fp32_bwd", "softmax", scores, SOFTMAX_FLOPS, 3 * scores * f32),
        mem("softmax_mask_fill_bwd", "elementwise", scores, 1, 2 * scores * f32 + s * s),
        mem("softmax_scale_bwd", "elementwise", scores, 1, 2 * scores * f32),
        mem("softmax_cast_fp32_bwd", "elementwise", scores, 0, scores * (f32 + db)),
    ]


def attention_core(b: int, s: int, hp: int, ap: int, db: int, flash: bool, backward: bool) -> list[Kernel]:
    """Attention over this rank's ``ap`` heads of size d = hp/ap, in execution order (forward or backward), with
    the layout copies Megatron makes around it: the context's [b, heads, s, d] → [s, b, heads·d] permute (one
    ``contiguous()`` copy) after the unfused core; [s, b, …] → [b, s, …] copies of Q, K, V before a flash kernel
    and of its output after it. Each copy's backward is the inverse copy."""
    d = hp // ap
    heads = b * ap
    scores = heads * s * s  # elements of one b·a·s² tensor on this rank
    qkv = heads * s * d  # elements of one of Q, K, V, O
    context_copy = mem("attention_context_transpose" + "_bwd" * backward, "elementwise", qkv, 0, 2 * qkv * db)
    if flash:
        tiles = math.ceil(s / FLASH_QUERY_TILE)
        rows = heads * s * STAT_BYTES  # one fp32 value per query row: log-sum-exp L, or D = rowsum(dO ⊙ O)
        in_copy = mem("flash_qkv_transpose" + "_bwd" * backward, "elementwise", 3 * qkv, 0, 6 * qkv * db)
        if not backward:
            # FlashAttention-2 Algorithm 1: the outer loop over query tiles reads Q once and K, V once per tile,
            # writes O and L once
            return [in_copy, Kernel("flash_attention", "attention", 4.0 * scores * d,
                                    float((2 * qkv + 2 * qkv * tiles) * db + rows)), context_copy]
        # Algorithm 2: D = rowsum(dO ⊙ O) first; the outer loop over key tiles reads K, V and writes dK, dV once,
        # and per tile reads Q, dO, L, D and reads and writes the fp32 dQ accumulator; dQ is then cast down.
        # The scores are recomputed: 5 matmuls against the forward's 2.
        return [
            context_copy,
            mem("flash_attention_bwd_preprocess", "elementwise", qkv, 2, 2 * qkv * db + rows),
            Kernel("flash_attention_bwd", "attention", 10.0 * scores * d,
                   float(4 * qkv * db + tiles * (2 * qkv * db + 2 * qkv * STAT_BYTES + 2 * rows))),
            mem("flash_attention_dq_convert", "elementwise", qkv, 0, qkv * (STAT_BYTES + db)),
            in_copy,
        ]
    fused = fused_softmax_available(b, ap, s, db)
    if not backward:
        softmax = [mem("scale_mask_softmax", "softmax", scores, SOFTMAX_FLOPS, 2 * scores * db)] if fused else \
            _unfused_softmax(scores, s, db, False)
        return [
            gemm("attention_scores", s, s, d, db, batch=heads),  # Q·Kᵀ per head
            *softmax,
            mem("attention_dropout", "dropout", scores, DROPOUT_FLOPS, 2 * scores * db + scores * MASK_BYTES),
            gemm("attention_over_values", s, d, s, db, batch=heads),  # P·V per head
            context_copy,
        ]
    return [
        context_copy,
        gemm("attention_over_values_dgrad", s, s, d, db, batch=heads),  # dP = dO·Vᵀ
        gemm("attention_over_values_vgrad", s, d, s, db, batch=heads),  # dV = Pᵀ·dO
        mem("attention_dropout_bwd", "dropout", scores, DROPOUT_FLOPS, 2 * scores * db + scores * MASK_BYTES),
        # reads dY and the saved softmax output Y, writes dX = Y ⊙ (dY − Σ dY ⊙ Y)
        *([mem("scale_mask_softmax_bwd", "softmax", scores, SOFTMAX_FLOPS, 3 * scores * db)] if fused else
          _unfused_softmax(scores, s, db, True)),
        gemm("attention_scores_qgrad", s, d, s, db, batch=heads),  # dQ = dS·K
        gemm("attention_scores_kgrad", s, d, s, db, batch=heads),  # dK = dSᵀ·Q
    ]
