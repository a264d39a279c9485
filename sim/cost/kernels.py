"""The kernels one GPT layer shard really runs: each with its FLOPs, bytes moved and (for GEMMs) its M, N, K.

An inventory, not a cost (:mod:`sim.cost.gpu_time` costs it): for one tensor-parallel rank of a Megatron-LM GPT
model, the forward and backward kernels of the embedding, a decoder block and the head, in execution order.
Communication is not listed: :mod:`sim.cost.collectives` costs it.

Sources:

* Megatron-LM (``megatron/model/transformer.py``, ``ParallelAttention``/``ParallelMLP``/``ParallelTransformerLayer``;
  ``megatron/mpu/layers.py`` for column- and row-parallel linears and the vocab-parallel embedding;
  ``megatron/mpu/cross_entropy.py``; ``megatron/core/tensor_parallel/`` in later versions): a pre-LN block:
  LN → QKV GEMM (column-parallel) → QKᵀ batched GEMM → fused
  scale+causal-mask+softmax (``ScaledUpperTriangMaskedSoftmax``, one kernel, the mask generated not read) → dropout
  → attention over V batched GEMM → output projection GEMM (row-parallel) → fused bias+dropout+residual add → LN →
  MLP up GEMM (column-parallel, 4h) → fused bias+GELU → MLP down GEMM (row-parallel) → bias+dropout+residual add.
  Logits are cast to fp32 before the vocab-parallel cross entropy (``fp16_lm_cross_entropy`` off, the default).
* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21
  (arXiv 2104.04473) §5.1: a block's forward GEMMs are 24·b·s·h² + 4·b·s²·h FLOPs, the logit GEMM 2·b·s·h·V, and
  the backward pass twice the forward.
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198) §4: which
  tensors exist (softmax output and dropout mask of b·a·s², 1-byte dropout masks, LayerNorm and dropout on the
  full b·s·h on every tensor-parallel rank unless sequence parallel splits them by t, §4.2.2) and §5 (selective
  recomputation re-runs QKᵀ, softmax, softmax dropout and attention over V).
* Dao et al., FlashAttention (arXiv 2205.14135) §3 and FlashAttention-2 (arXiv 2307.08691) §3, Algorithms 1-2:
  one fused kernel that never writes the b·a·s² score matrix, keeps a per-row log-sum-exp (fp32) for the backward,
  regenerates the dropout mask from the RNG state and streams K, V once per 128-row query tile (§3.3's block
  sizes); its backward streams Q, dO and an fp32 dQ accumulator once per key tile and recomputes the scores:
  5 matmuls against the forward's 2, 2.5× its FLOPs. HBM traffic as the algorithms state it (L2 may serve re-reads).

Conventions: ``bytes`` counts every tensor a kernel reads plus every tensor it writes, once, in the training dtype
(``dtype_bytes``) unless stated (1-byte dropout masks, fp32 LayerNorm statistics, 8-byte token ids, fp32 loss).
The softmax is Megatron's fused kernel where :func:`fused_softmax_available` says so, else PyTorch's five kernels.
Attention FLOPs count the full s×s score matrix, as Megatron's unfused kernels compute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.core.errors import SpecError

__all__ = ["Kernel", "KINDS", "fused_softmax_available", "block_kernels", "block_parameters", "embedding_kernels",
           "head_kernels", "layer_step_kernels", "optimizer_kernels", "RECOMPUTE_MODES", "FLASH_QUERY_TILE",
           "MASK_BYTES", "STAT_BYTES", "TOKEN_ID_BYTES"]

#: Kernel kinds: how a cost model should treat one.
KINDS = ("gemm", "attention", "elementwise", "norm", "softmax", "dropout", "loss", "optimizer")
#: Bytes per dropout-mask element (Korthikanti §4.1: "a mask of size ... 1 byte").
MASK_BYTES = 1
#: Bytes per LayerNorm statistic (mean, 1/σ) and per log-sum-exp value: kept in fp32 by apex's fused LayerNorm
#: and by FlashAttention.
STAT_BYTES = 4
#: Bytes per token id (int64 in Megatron's data loader).
TOKEN_ID_BYTES = 8
#: Query rows per FlashAttention tile (FlashAttention-2 §3.3: block sizes of 64 or 128; 128 for head dims ≤ 128).
FLASH_QUERY_TILE = 128

# Approximate FLOPs per element of the memory-bound kernels (costed by their bytes).
_LN_FLOPS, _SOFTMAX_FLOPS, _DROPOUT_FLOPS, _GELU_FLOPS, _ADD_FLOPS = 8, 5, 2, 8, 1


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: ``flops`` (FLOP), ``bytes`` (bytes read + written in device memory), and for GEMMs the
    shape ``gemm = (M, N, K)`` of each of ``batch`` independent products (FLOPs = 2·batch·M·N·K)."""

    name: str
    kind: str
    flops: float
    bytes: float
    gemm: tuple[int, int, int] | None = None
    batch: int = 1


def _gemm(name: str, m: int, n: int, k: int, db: int, *, batch: int = 1, bias: bool = False) -> Kernel:
    """C[M×N] = A[M×K]·B[K×N] (``batch`` times): reads A and B, writes C; a fused bias reads N more values."""
    return Kernel(name, "gemm", 2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * db + bias * n * db),
                  (m, n, k), batch)


def _mem(name: str, kind: str, elements: int, flops_per_element: int, nbytes: float) -> Kernel:
    return Kernel(name, kind, float(flops_per_element * elements), float(nbytes))


def _check(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{key} must be a positive integer, got {value!r}")


def _layer_norm(name: str, tokens: int, h: int, db: int, backward: bool) -> Kernel:
    """Fused LayerNorm over ``tokens`` rows of h. Forward reads x and γ, β; writes y and fp32 mean, 1/σ. Backward
    reads dy, x, the statistics and γ; writes dx and dγ, dβ."""
    stats = 2 * tokens * STAT_BYTES
    if not backward:
        return _mem(name, "norm", tokens * h, _LN_FLOPS, (2 * tokens * h + 2 * h) * db + stats)
    return _mem(name + "_bwd", "norm", tokens * h, 2 * _LN_FLOPS, (3 * tokens * h + 3 * h) * db + stats)


def _dropout_add(name: str, tokens: int, h: int, db: int, backward: bool) -> Kernel:
    """Megatron's fused bias + dropout + residual add. Forward reads x, the bias and the residual; writes the sum
    and the mask. Backward reads dy and the mask, writes dx (the residual's gradient is dy itself, no kernel)."""
    if not backward:
        return _mem(name, "dropout", tokens * h, _DROPOUT_FLOPS + 2 * _ADD_FLOPS,
                    (3 * tokens * h + h) * db + tokens * h * MASK_BYTES)
    return _mem(name + "_bwd", "dropout", tokens * h, _DROPOUT_FLOPS, 2 * tokens * h * db + tokens * h * MASK_BYTES)


def _residual_grad_add(name: str, tokens: int, h: int, db: int) -> Kernel:
    """Autograd's sum of the two gradients reaching a residual stream (the skip path and the LayerNorm's)."""
    return _mem(name, "elementwise", tokens * h, _ADD_FLOPS, 3 * tokens * h * db)


def fused_softmax_available(b: int, heads: int, s: int, dtype_bytes: int = 2) -> bool:
    """Whether Megatron's fused causal softmax runs (``FusedScaleMaskSoftmax.is_kernel_available``): 16-bit input,
    16 < s ≤ 4096, 4 | s, and b·heads (this rank's) divisible by 4 and by ``get_batch_per_block`` (128 threads in warps
    of min(2^⌈log₂ s⌉, 32) lanes, 2 rows a warp when 2^⌈log₂ s⌉ ≤ 128). Else PyTorch's five kernels run instead."""
    if dtype_bytes != 2 or not 16 < s <= 4096 or s % 4:
        return False
    pow2 = 1 << (s - 1).bit_length()
    warp = min(pow2, 32)
    per_block = (128 // warp) * (2 if pow2 <= 128 else 1)
    return (b * heads) % 4 == 0 and (b * heads) % per_block == 0


def _unfused_softmax(scores: int, s: int, db: int, backward: bool) -> list[Kernel]:
    """Megatron's fallback (``forward_torch_softmax``) over ``scores`` elements, in fp32 (query-key layer scaling on,
    the default): cast up, scale, ``masked_fill`` with the s × s causal mask, softmax, cast down; and gradients."""
    f32 = STAT_BYTES
    if not backward:
        return [
            _mem("softmax_cast_fp32", "elementwise", scores, 0, scores * (db + f32)),
            _mem("softmax_scale", "elementwise", scores, 1, 2 * scores * f32),
            _mem("softmax_mask_fill", "elementwise", scores, 1, 2 * scores * f32 + s * s),
            _mem("softmax_fp32", "softmax", scores, _SOFTMAX_FLOPS, 2 * scores * f32),
            _mem("softmax_cast_half", "elementwise", scores, 0, scores * (f32 + db)),
        ]
    return [
        _mem("softmax_cast_half_bwd", "elementwise", scores, 0, scores * (db + f32)),
        _mem("softmax_fp32_bwd", "softmax", scores, _SOFTMAX_FLOPS, 3 * scores * f32),
        _mem("softmax_mask_fill_bwd", "elementwise", scores, 1, 2 * scores * f32 + s * s),
        _mem("softmax_scale_bwd", "elementwise", scores, 1, 2 * scores * f32),
        _mem("softmax_cast_fp32_bwd", "elementwise", scores, 0, scores * (f32 + db)),
    ]


def _attention_core(b: int, s: int, hp: int, ap: int, db: int, flash: bool, backward: bool) -> list[Kernel]:
    """Attention over this rank's ``ap`` heads of size d = hp/ap, in execution order (forward or backward), with
    the layout copies Megatron makes around it: the context's [b, heads, s, d] → [s, b, heads·d] permute (one
    ``contiguous()`` copy) after the unfused core; [s, b, …] → [b, s, …] copies of Q, K, V before a flash kernel
    and of its output after it. Each copy's backward is the inverse copy."""
    d = hp // ap
    heads = b * ap
    scores = heads * s * s  # elements of one b·a·s² tensor on this rank
    qkv = heads * s * d  # elements of one of Q, K, V, O
    context_copy = _mem("attention_context_transpose" + "_bwd" * backward, "elementwise", qkv, 0, 2 * qkv * db)
    if flash:
        tiles = math.ceil(s / FLASH_QUERY_TILE)
        rows = heads * s * STAT_BYTES  # one fp32 value per query row: log-sum-exp L, or D = rowsum(dO ⊙ O)
        in_copy = _mem("flash_qkv_transpose" + "_bwd" * backward, "elementwise", 3 * qkv, 0, 6 * qkv * db)
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
            _mem("flash_attention_bwd_preprocess", "elementwise", qkv, 2, 2 * qkv * db + rows),
            Kernel("flash_attention_bwd", "attention", 10.0 * scores * d,
                   float(4 * qkv * db + tiles * (2 * qkv * db + 2 * qkv * STAT_BYTES + 2 * rows))),
            _mem("flash_attention_dq_convert", "elementwise", qkv, 0, qkv * (STAT_BYTES + db)),
            in_copy,
        ]
    fused = fused_softmax_available(b, ap, s, db)
    if not backward:
        softmax = [_mem("scale_mask_softmax", "softmax", scores, _SOFTMAX_FLOPS, 2 * scores * db)] if fused else \
            _unfused_softmax(scores, s, db, False)
        return [
            _gemm("attention_scores", s, s, d, db, batch=heads),  # Q·Kᵀ per head
            *softmax,
            _mem("attention_dropout", "dropout", scores, _DROPOUT_FLOPS, 2 * scores * db + scores * MASK_BYTES),
            _gemm("attention_over_values", s, d, s, db, batch=heads),  # P·V per head
            context_copy,
        ]
    return [
        context_copy,
        _gemm("attention_over_values_dgrad", s, s, d, db, batch=heads),  # dP = dO·Vᵀ
        _gemm("attention_over_values_vgrad", s, d, s, db, batch=heads),  # dV = Pᵀ·dO
        _mem("attention_dropout_bwd", "dropout", scores, _DROPOUT_FLOPS, 2 * scores * db + scores * MASK_BYTES),
        # reads dY and the saved softmax output Y, writes dX = Y ⊙ (dY − Σ dY ⊙ Y)
        *([_mem("scale_mask_softmax_bwd", "softmax", scores, _SOFTMAX_FLOPS, 3 * scores * db)] if fused else
          _unfused_softmax(scores, s, db, True)),
        _gemm("attention_scores_qgrad", s, d, s, db, batch=heads),  # dQ = dS·K
        _gemm("attention_scores_kgrad", s, d, s, db, batch=heads),  # dK = dSᵀ·Q
    ]


def _linear(name: str, tokens: int, n_in: int, n_out: int, db: int, backward: bool, fused_bias: bool) -> list[Kernel]:
    """Y[T×out] = X[T×in]·W[in×out]; backward: dgrad dX = dY·Wᵀ, wgrad dW = Xᵀ·dY, and the bias gradient, a column
    sum of dY. Only the QKV linear adds its bias in the GEMM (``fused_bias``); the others are built with
    ``skip_bias_add`` and leave it to the fused bias+GELU and bias+dropout+add kernels, whose backward yields the same
    column sum. The wgrad writes dW in the training dtype; Megatron's gradient-accumulation fusion would instead read
    and write an fp32 main gradient (not modelled here)."""
    if not backward:
        return [_gemm(name, tokens, n_out, n_in, db, bias=fused_bias)]
    kernels = [_gemm(name + "_dgrad", tokens, n_in, n_out, db), _gemm(name + "_wgrad", n_in, n_out, tokens, db)]
    kernels.append(_mem(name + "_bias_grad", "elementwise", tokens * n_out, _ADD_FLOPS, (tokens * n_out + n_out) * db))
    return kernels


def _shard(b: int, s: int, h: int, a: int, t: int, sequence_parallel: bool) -> tuple[int, int, int]:
    _check(b=b, s=s, h=h, a=a, t=t)
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
    _check(dtype_bytes=dtype_bytes)
    tokens, norm_tokens, hp = _shard(b, s, h, a, t, sequence_parallel)
    db, ap, ffn = dtype_bytes, a // t, 4 * h // t
    attention = _attention_core(b, s, hp, ap, db, flash, backward)
    if not backward:
        return tuple([
            _layer_norm("input_layernorm", norm_tokens, h, db, False),
            *_linear("qkv", tokens, h, 3 * hp, db, False, True),
            *attention,
            *_linear("attention_output", tokens, hp, h, db, False, False),
            _dropout_add("attention_dropout_add", norm_tokens, h, db, False),
            _layer_norm("post_attention_layernorm", norm_tokens, h, db, False),
            *_linear("mlp_up", tokens, h, ffn, db, False, False),
            _mem("bias_gelu", "elementwise", tokens * ffn, _GELU_FLOPS, (2 * tokens * ffn + ffn) * db),
            *_linear("mlp_down", tokens, ffn, h, db, False, False),
            _dropout_add("mlp_dropout_add", norm_tokens, h, db, False),
        ])
    return tuple([
        _dropout_add("mlp_dropout_add", norm_tokens, h, db, True),
        *_linear("mlp_down", tokens, ffn, h, db, True, False),
        # reads dY and the saved GELU input, writes dX
        _mem("bias_gelu_bwd", "elementwise", tokens * ffn, 2 * _GELU_FLOPS, 3 * tokens * ffn * db),
        *_linear("mlp_up", tokens, h, ffn, db, True, False),
        _layer_norm("post_attention_layernorm", norm_tokens, h, db, True),
        _residual_grad_add("attention_residual_grad_add", norm_tokens, h, db),
        _dropout_add("attention_dropout_add", norm_tokens, h, db, True),
        *_linear("attention_output", tokens, hp, h, db, True, False),
        *attention,
        *_linear("qkv", tokens, h, 3 * hp, db, True, True),
        _layer_norm("input_layernorm", norm_tokens, h, db, True),
        _residual_grad_add("input_residual_grad_add", norm_tokens, h, db),
    ])


RECOMPUTE_MODES = ("none", "selective", "full")


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
        again = tuple(_attention_core(b, s, h // t, a // t, dtype_bytes, False, False))
    else:
        again = ()
    return forward, tuple(Kernel("recompute_" + k.name, k.kind, k.flops, k.bytes, k.gemm, k.batch) for k in again) \
        + backward


def _vocab_shard(b: int, s: int, h: int, vocab: int, t: int, sequence_parallel: bool, dtype_bytes: int):
    _check(b=b, s=s, h=h, vocab=vocab, t=t, dtype_bytes=dtype_bytes)
    if vocab % t:
        raise SpecError(f"vocabulary {vocab} is not divisible by tensor-parallel degree {t} (pad it, as Megatron "
                        f"does, to a multiple of t)")
    if sequence_parallel and s % t:
        raise SpecError(f"sequence length {s} is not divisible by tensor-parallel degree {t} (sequence parallel)")
    tokens = b * s
    return tokens, tokens // t if sequence_parallel else tokens, vocab // t


def embedding_kernels(b: int, s: int, h: int, vocab: int, t: int, *, sequence_parallel: bool, backward: bool,
                      dtype_bytes: int = 2) -> tuple[Kernel, ...]:
    """The input embedding on one tensor-parallel rank, as Megatron's ``Embedding.forward`` runs it: the
    vocab-parallel word-embedding lookup (each rank holds vocab/t rows and looks up every token), with t > 1 the
    zeroing of the tokens another rank owns (the all-reduce follows), the learned position-embedding lookup, their
    sum, the [b, s, h] → [s, b, h] transpose (a copy), and the embedding dropout (on s/t of the sequence under
    sequence parallelism). Backward: dropout backward, the transpose's, the position embedding's gradient (dense,
    s × h, from b·s rows) and the word embedding's (dense vocab/t × h, zeroed then scatter-added). The zeroed rows
    are counted as (t − 1)/t of the tokens, as if token ids were spread evenly over the ranks' vocabulary shards."""
    tokens, drop_tokens, vp = _vocab_shard(b, s, h, vocab, t, sequence_parallel, dtype_bytes)
    db, bsh = dtype_bytes, tokens * h
    ids = tokens * TOKEN_ID_BYTES
    dropout = _mem("embedding_dropout", "dropout", drop_tokens * h, _DROPOUT_FLOPS,
                   2 * drop_tokens * h * db + drop_tokens * h * MASK_BYTES)
    if not backward:
        kernels = [_mem("word_embedding_lookup", "elementwise", bsh, 0, ids + 2 * bsh * db)]
        if t > 1:
            kernels.append(_mem("word_embedding_mask", "elementwise", bsh, 0, tokens + bsh * (t - 1) // t * db))
        return tuple(kernels + [
            _mem("position_embedding_lookup", "elementwise", bsh, 0, ids + 2 * bsh * db),
            _mem("embedding_add", "elementwise", bsh, _ADD_FLOPS, 3 * bsh * db),
            _mem("embedding_transpose", "elementwise", bsh, 0, 2 * bsh * db),
            dropout,
        ])
    return (
        Kernel("embedding_dropout_bwd", "dropout", dropout.flops, dropout.bytes),
        _mem("embedding_transpose_bwd", "elementwise", bsh, 0, 2 * bsh * db),
        _mem("position_embedding_grad", "elementwise", bsh, _ADD_FLOPS, ids + (bsh + 2 * s * h) * db),
        _mem("word_embedding_grad", "elementwise", bsh, _ADD_FLOPS, ids + (bsh + 2 * vp * h) * db),
    )


def head_kernels(b: int, s: int, h: int, vocab: int, t: int, *, sequence_parallel: bool, backward: bool,
                 dtype_bytes: int = 2) -> tuple[Kernel, ...]:
    """The head on one tensor-parallel rank: final LayerNorm, the logit GEMM against the tied vocab-parallel
    embedding (M = b·s, N = vocab/t, K = h), the cast of the logits to fp32 and Megatron's vocab-parallel cross
    entropy (``megatron/core/tensor_parallel/cross_entropy.py``: five passes over the logits, the all-reduces of the
    max, the target logit and the sum between them). Backward: softmax − one-hot in place (fp32), the cast back, the
    logit GEMM's dgrad and wgrad (into the embedding's gradient), the final LayerNorm's backward."""
    tokens, norm_tokens, vp = _vocab_shard(b, s, h, vocab, t, sequence_parallel, dtype_bytes)
    db, logits = dtype_bytes, tokens * vp
    if not backward:
        return (
            _layer_norm("final_layernorm", norm_tokens, h, db, False),
            _gemm("logits", tokens, vp, h, db),
            _mem("logits_to_fp32", "elementwise", logits, 0, logits * (db + STAT_BYTES)),
            # Megatron's _VocabParallelCrossEntropy on the fp32 logits L: max, subtract it, exp in place, sum,
            # divide in place (the softmax kept for the backward); the target masking and gather are O(b·s)
            _mem("cross_entropy_max", "loss", logits, 1, logits * STAT_BYTES),
            _mem("cross_entropy_subtract_max", "loss", logits, 1, 2 * logits * STAT_BYTES),
            _mem("cross_entropy_target_logit", "loss", tokens, 1, tokens * (2 * TOKEN_ID_BYTES + 2 * STAT_BYTES)),
            _mem("cross_entropy_exp", "loss", logits, 1, 2 * logits * STAT_BYTES),
            _mem("cross_entropy_sum", "loss", logits, 1, logits * STAT_BYTES),
            _mem("cross_entropy_normalise", "loss", logits, 1, 2 * logits * STAT_BYTES),
        )
    return (
        # the saved softmax minus one at each owned target (O(b·s)), then scaled by the loss gradient in place
        _mem("cross_entropy_target_grad", "loss", tokens, 1, tokens * (TOKEN_ID_BYTES + 2 * STAT_BYTES)),
        _mem("cross_entropy_bwd", "loss", logits, 1, 2 * logits * STAT_BYTES),
        _mem("logits_to_fp32_bwd", "elementwise", logits, 0, logits * (db + STAT_BYTES)),
        _gemm("logits_dgrad", tokens, h, vp, db),
        _gemm("logits_wgrad", vp, h, tokens, db),
        _layer_norm("final_layernorm", norm_tokens, h, db, True),
    )


def block_parameters(h: int, t: int) -> int:
    """Parameters of one decoder block on one of ``t`` tensor-parallel ranks: the split QKV (3h·h/t + 3h/t), output
    projection (h·h/t + h), MLP up (4h·h/t + 4h/t) and down (4h·h/t + h) weights and biases (row-parallel biases
    are whole on every rank), and the two LayerNorms' γ and β (4h)."""
    _check(h=h, t=t)
    if h % t:
        raise SpecError(f"hidden size {h} is not divisible by tensor-parallel degree {t}")
    return 12 * h * h // t + 7 * h // t + 2 * h + 4 * h


def optimizer_kernels(params: int, *, dtype_bytes: int = 2, loss_scaling: bool = True) -> tuple[Kernel, ...]:
    """The mixed-precision Adam step over ``params`` parameters (Megatron's ``Float16OptimizerWithFloat16Params``
    with apex's multi-tensor FusedAdam; the states of ZeRO §3.1): with fp16 loss scaling, an unscale-and-inf-check
    pass over the fp32 gradients (read and written); the Adam update (reads the fp32 gradient, master weight, m and
    v, writes the master weight, m and v); the copy of the master weights into the training-dtype weights. In fp32
    (``dtype_bytes`` 4) there is no master copy and no loss scaling."""
    _check(params=params, dtype_bytes=dtype_bytes)
    f32 = STAT_BYTES
    kernels = []
    if loss_scaling and dtype_bytes < f32:
        kernels.append(_mem("grad_unscale_inf_check", "optimizer", params, 2, 2 * params * f32))
    kernels.append(_mem("adam", "optimizer", params, 12, 7 * params * f32))
    if dtype_bytes < f32:
        kernels.append(_mem("master_to_model_copy", "optimizer", params, 0, params * (f32 + dtype_bytes)))
    return tuple(kernels)
