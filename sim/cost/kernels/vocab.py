"""The vocabulary-parallel ends of the model on one tensor-parallel rank: the input embedding (word and position
lookups, their sum, the transpose, dropout) and the head (final LayerNorm, the logit GEMM against the tied
embedding, the fp32 cast and Megatron's vocab-parallel cross entropy)."""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.cost.kernels.elementwise import layer_norm
from sim.cost.kernels.record import (
    ADD_FLOPS,
    DROPOUT_FLOPS,
    MASK_BYTES,
    STAT_BYTES,
    TOKEN_ID_BYTES,
    Kernel,
    check,
    gemm,
    mem,
)

__all__ = ["embedding_kernels", "head_kernels"]


def _vocab_shard(b: int, s: int, h: int, vocab: int, t: int, sequence_parallel: bool,
                 dtype_bytes: int) -> tuple[int, int, int]:
    """``(tokens, tokens the dropout or LayerNorm sees, vocabulary rows on this rank)``; the sizes checked (t divides
    the vocabulary, and the sequence under sequence parallelism)."""
    check(b=b, s=s, h=h, vocab=vocab, t=t, dtype_bytes=dtype_bytes)
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
    dropout = mem("embedding_dropout", "dropout", drop_tokens * h, DROPOUT_FLOPS,
                   2 * drop_tokens * h * db + drop_tokens * h * MASK_BYTES)
    if not backward:
        kernels = [mem("word_embedding_lookup", "elementwise", bsh, 0, ids + 2 * bsh * db)]
        if t > 1:
            kernels.append(mem("word_embedding_mask", "elementwise", bsh, 0, tokens + bsh * (t - 1) // t * db))
        return tuple(kernels + [
            mem("position_embedding_lookup", "elementwise", bsh, 0, ids + 2 * bsh * db),
            mem("embedding_add", "elementwise", bsh, ADD_FLOPS, 3 * bsh * db),
            mem("embedding_transpose", "elementwise", bsh, 0, 2 * bsh * db),
            dropout,
        ])
    return (
        Kernel("embedding_dropout_bwd", "dropout", dropout.flops, dropout.bytes),
        mem("embedding_transpose_bwd", "elementwise", bsh, 0, 2 * bsh * db),
        mem("position_embedding_grad", "elementwise", bsh, ADD_FLOPS, ids + (bsh + 2 * s * h) * db),
        mem("word_embedding_grad", "elementwise", bsh, ADD_FLOPS, ids + (bsh + 2 * vp * h) * db),
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
            layer_norm("final_layernorm", norm_tokens, h, db, False),
            gemm("logits", tokens, vp, h, db),
            mem("logits_to_fp32", "elementwise", logits, 0, logits * (db + STAT_BYTES)),
            # Megatron's _VocabParallelCrossEntropy on the fp32 logits L: max, subtract it, exp in place, sum,
            # divide in place (the softmax kept for the backward); the target masking and gather are O(b·s)
            mem("cross_entropy_max", "loss", logits, 1, logits * STAT_BYTES),
            mem("cross_entropy_subtract_max", "loss", logits, 1, 2 * logits * STAT_BYTES),
            mem("cross_entropy_target_logit", "loss", tokens, 1, tokens * (2 * TOKEN_ID_BYTES + 2 * STAT_BYTES)),
            mem("cross_entropy_exp", "loss", logits, 1, 2 * logits * STAT_BYTES),
            mem("cross_entropy_sum", "loss", logits, 1, logits * STAT_BYTES),
            mem("cross_entropy_normalise", "loss", logits, 1, 2 * logits * STAT_BYTES),
        )
    return (
        # the saved softmax minus one at each owned target (O(b·s)), then scaled by the loss gradient in place
        mem("cross_entropy_target_grad", "loss", tokens, 1, tokens * (TOKEN_ID_BYTES + 2 * STAT_BYTES)),
        mem("cross_entropy_bwd", "loss", logits, 1, 2 * logits * STAT_BYTES),
        mem("logits_to_fp32_bwd", "elementwise", logits, 0, logits * (db + STAT_BYTES)),
        gemm("logits_dgrad", tokens, h, vp, db),
        gemm("logits_wgrad", vp, h, tokens, db),
        layer_norm("final_layernorm", norm_tokens, h, db, True),
    )
