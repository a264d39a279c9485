"""The kernels of a Llama-family model on one tensor-parallel rank, as torchtitan and HuggingFace's Llama run it in
eager mode: a pre-norm block (RMSNorm → separate q, k, v GEMMs → rotary embeddings → one causal FlashAttention
kernel over grouped key/value heads → o GEMM → residual add → RMSNorm → gate and up GEMMs → SiLU × up → down GEMM
→ residual add), the token embedding and the head (final RMSNorm, logit GEMM, fp32 cross entropy).

Sources: torchtitan ``models/llama3/model.py`` (``Attention``: ``wq``, ``wk``, ``wv``, ``wo`` without bias, rotary
``apply_rotary_emb``, ``scaled_dot_product_attention(is_causal=True)``; ``FeedForward``: ``w2(silu(w1(x)) * w3(x))``;
``RMSNorm``), HuggingFace ``modeling_llama.py`` / ``modeling_qwen2.py`` / ``modeling_qwen3.py`` (q, k, v biases in Qwen
2; ``q_norm``, ``k_norm`` over the head dimension in Qwen 3). FlashAttention-2 (Dao, arXiv 2307.08691) §3.1-3.2 and
Algorithms 1-2 for the attention kernel: with causal masking it skips the key tiles above the diagonal, so of the
T × T tile pairs (T = ⌈s/128⌉) it computes T(T + 1)/2, and under a sliding window only those within it
(:func:`attention_fraction`); the model's FLOPs (``sim.models.llama``) still count the whole s × s, as MFU does.

Conventions as in :mod:`sim.cost.kernels` (bytes read plus written, in the training dtype unless stated). Tensor
parallelism splits the heads (query and key/value) and the SwiGLU's width; the norms, the residual adds and the
rotary work on what the rank holds. No dropout: these models train without it.
"""

from __future__ import annotations

import math

from sim.core.errors import SpecError
from sim.cost.kernels.attention import FLASH_QUERY_TILE
from sim.cost.kernels.block import linear_kernels
from sim.cost.kernels.elementwise import residual_grad_add, rms_norm
from sim.cost.kernels.record import ADD_FLOPS, STAT_BYTES, TOKEN_ID_BYTES, Kernel, check, mem

__all__ = ["LlamaBlockShape", "attention_fraction", "llama_block_kernels", "llama_embedding_kernels",
           "llama_head_kernels", "LLAMA_COLLECTIVE_AFTER"]

#: Kernels after which a tensor-parallel block calls its collective: the row-parallel o and down projections in the
#: forward, the last column-parallel input gradients of the attention and of the MLP in the backward.
LLAMA_COLLECTIVE_AFTER = frozenset({"wo", "w2", "wq_wgrad", "w1_wgrad"})

#: FLOPs per element of the rotary embedding (two multiplies and an add per rotated value) and of SiLU × up.
ROPE_FLOPS, SILU_MUL_FLOPS = 3, 5


class LlamaBlockShape:
    """One block's shape on one tensor-parallel rank: ``b`` samples of ``s`` tokens, hidden ``h``, ``a`` query and
    ``g`` key/value heads of dimension ``d``, SwiGLU width ``f``, split ``t`` ways; q/k/v biases, QK-norm, a
    sliding ``window`` (0: none)."""

    def __init__(self, b: int, s: int, h: int, a: int, g: int, d: int, f: int, t: int, *, qkv_bias: bool = False,
                 qk_norm: bool = False, window: int = 0) -> None:
        check(b=b, s=s, h=h, a=a, g=g, d=d, f=f, t=t)
        if a % t or g % t or f % t:
            raise SpecError(f"tensor-parallel degree {t} must divide the {a} query heads, the {g} key/value heads and "
                            f"the SwiGLU width {f}")
        self.b, self.s, self.h, self.d, self.t = b, s, h, d, t
        self.tokens = b * s
        self.q_heads, self.kv_heads, self.ffn = a // t, g // t, f // t
        self.qkv_bias, self.qk_norm, self.window = qkv_bias, qk_norm, window


def attention_fraction(s: int, window: int = 0, tile: int = FLASH_QUERY_TILE) -> float:
    """The share of the s × s (query, key) tile pairs a causal FlashAttention kernel computes: for query tile i the
    key tiles from the window's first to the diagonal, T(T + 1)/2 of T² without a window."""
    tiles = math.ceil(s / tile)
    reach = tiles if not window else math.ceil(window / tile) + 1  # key tiles a query tile can touch
    computed = sum(min(i + 1, reach) for i in range(tiles))
    return computed / (tiles * tiles)


def _attention(shape: LlamaBlockShape, db: int, backward: bool) -> list[Kernel]:
    """FlashAttention-2 over this rank's query heads, each group sharing a key/value head (GQA): the forward reads Q
    and writes O and the log-sum-exp once and reads K, V once per computed query tile; the backward reads Q, dO,
    the statistics and the fp32 dQ accumulator once per computed key tile and K, V, dK, dV once, recomputing the
    scores (5 matmuls against the forward's 2)."""
    s, d, b = shape.s, shape.d, shape.b
    fraction = attention_fraction(s, shape.window)
    tiles = math.ceil(s / FLASH_QUERY_TILE) * fraction  # key (or query) tiles each tile meets, on average
    q = b * shape.q_heads * s * d  # elements of Q (and of O)
    kv = b * shape.kv_heads * s * d  # elements of K (and of V)
    scores = b * shape.q_heads * s * s
    rows = b * shape.q_heads * s * STAT_BYTES
    if not backward:
        return [Kernel("flash_attention", "attention", 4.0 * scores * d * fraction,
                       float((2 * q + 2 * kv * tiles) * db + rows))]
    return [
        mem("flash_attention_bwd_preprocess", "elementwise", q, 2, 2 * q * db + rows),
        Kernel("flash_attention_bwd", "attention", 10.0 * scores * d * fraction,
               float(4 * kv * db + tiles * (2 * q * db + 2 * q * STAT_BYTES + 2 * rows))),
        mem("flash_attention_dq_convert", "elementwise", q, 0, q * (STAT_BYTES + db)),
    ]


def llama_block_kernels(shape: LlamaBlockShape, *, backward: bool, dtype_bytes: int = 2,
                        fp8: bool = False) -> tuple[Kernel, ...]:
    """One block's kernels on one tensor-parallel rank, in execution order (forward, or backward: the reverse, each
    GEMM's dgrad then wgrad). With ``fp8`` every linear runs as torchao's Float8Linear
    (:func:`sim.cost.kernels.block.linear_kernels`); the attention stays in the training dtype, as torchtitan's
    float8 converter leaves SDPA alone."""
    check(dtype_bytes=dtype_bytes)
    db, tokens, h, d = dtype_bytes, shape.tokens, shape.h, shape.d
    q_width, kv_width, f = shape.q_heads * d, shape.kv_heads * d, shape.ffn
    rotated = tokens * (q_width + kv_width)  # the q and k values the rotary embedding rotates
    bias = shape.qkv_bias

    def linear(name: str, n_in: int, n_out: int, fused_bias: bool = False) -> list[Kernel]:
        return linear_kernels(name, tokens, n_in, n_out, db, backward, fused_bias, bias_grad=fused_bias, fp8=fp8)

    qk_norms: list[Kernel] = []
    if shape.qk_norm:
        qk_norms = [rms_norm("q_norm", tokens * shape.q_heads, d, db, backward),
                    rms_norm("k_norm", tokens * shape.kv_heads, d, db, backward)]
    if not backward:
        return tuple([
            rms_norm("attention_norm", tokens, h, db, False),
            *linear("wq", h, q_width, bias), *linear("wk", h, kv_width, bias), *linear("wv", h, kv_width, bias),
            *qk_norms,
            mem("rotary", "elementwise", rotated, ROPE_FLOPS, 2 * rotated * db + 2 * shape.s * d * STAT_BYTES),
            *_attention(shape, db, False),
            *linear("wo", q_width, h),
            mem("attention_residual_add", "elementwise", tokens * h, ADD_FLOPS, 3 * tokens * h * db),
            rms_norm("ffn_norm", tokens, h, db, False),
            *linear("w1", h, f), *linear("w3", h, f),
            mem("silu_mul", "elementwise", tokens * f, SILU_MUL_FLOPS, 3 * tokens * f * db),
            *linear("w2", f, h),
            mem("ffn_residual_add", "elementwise", tokens * h, ADD_FLOPS, 3 * tokens * h * db),
        ])
    return tuple([
        *linear("w2", f, h),
        # reads dY, the gate and up outputs, writes their gradients
        mem("silu_mul_bwd", "elementwise", tokens * f, 2 * SILU_MUL_FLOPS, 5 * tokens * f * db),
        *linear("w3", h, f), *linear("w1", h, f),
        mem("ffn_input_grad_add", "elementwise", tokens * h, ADD_FLOPS, 3 * tokens * h * db),  # w1's + w3's dX
        rms_norm("ffn_norm", tokens, h, db, True),
        residual_grad_add("ffn_residual_grad_add", tokens, h, db),
        *linear("wo", q_width, h),
        *_attention(shape, db, True),
        mem("rotary_bwd", "elementwise", rotated, ROPE_FLOPS, 2 * rotated * db + 2 * shape.s * d * STAT_BYTES),
        *reversed(qk_norms),
        *linear("wv", h, kv_width, bias), *linear("wk", h, kv_width, bias), *linear("wq", h, q_width, bias),
        mem("attention_input_grad_add", "elementwise", tokens * h, 2 * ADD_FLOPS, 4 * tokens * h * db),  # 3 dX
        rms_norm("attention_norm", tokens, h, db, True),
        residual_grad_add("attention_residual_grad_add", tokens, h, db),
    ])


def llama_embedding_kernels(b: int, s: int, h: int, vocab: int, t: int, *, backward: bool,
                            dtype_bytes: int = 2) -> tuple[Kernel, ...]:
    """The token embedding on one tensor-parallel rank (vocab/t rows each; with t > 1 the tokens another rank owns
    are zeroed before the all-reduce): a lookup forward; the dense gradient of the rank's rows backward (zeroed, then
    scatter-added). No position table, no dropout."""
    check(b=b, s=s, h=h, vocab=vocab, t=t, dtype_bytes=dtype_bytes)
    db, tokens = dtype_bytes, b * s
    bsh, ids, rows = tokens * h, tokens * TOKEN_ID_BYTES, vocab // t
    if not backward:
        kernels = [mem("token_embedding_lookup", "elementwise", bsh, 0, ids + 2 * bsh * db)]
        if t > 1:
            kernels.append(mem("token_embedding_mask", "elementwise", bsh, 0, tokens + bsh * (t - 1) // t * db))
        return tuple(kernels)
    return (mem("token_embedding_grad", "elementwise", bsh, ADD_FLOPS, ids + (bsh + 2 * rows * h) * db),)


def llama_head_kernels(b: int, s: int, h: int, vocab: int, t: int, *, backward: bool,
                       dtype_bytes: int = 2) -> tuple[Kernel, ...]:
    """The head on one tensor-parallel rank: the final RMSNorm, then the logit GEMM and the fp32 cross entropy of
    :func:`sim.cost.kernels.vocab.head_kernels` (the same passes over the logits)."""
    from sim.cost.kernels.vocab import head_kernels

    rest = head_kernels(b, s, h, vocab, t, sequence_parallel=False, backward=backward, dtype_bytes=dtype_bytes)
    norm = rms_norm("final_norm", b * s, h, dtype_bytes, backward)
    # head_kernels begins (forward) or ends (backward) with its LayerNorm: the RMSNorm takes its place.
    return (norm, *rest[1:]) if not backward else (*rest[:-1], norm)
