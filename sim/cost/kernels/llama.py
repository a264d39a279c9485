"""The kernels of a Llama-family model on one tensor-parallel rank, as torchtitan runs it: a pre-norm block (RMSNorm →
separate q, k, v GEMMs → rotary embeddings → ``repeat_kv`` → one causal FlashAttention kernel → o GEMM → residual
add → RMSNorm → gate and up GEMMs → SiLU × up → down GEMM → residual add), eager or under ``torch.compile`` (the
memory-bound work between the GEMMs in :mod:`sim.cost.kernels.pointwise`), with torchtitan's per-op selective
activation checkpointing where asked; the token embedding and the head (final RMSNorm, logit GEMM, fp32 cross
entropy), which torchtitan leaves eager.

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
from sim.cost.kernels.pointwise import (
    add_kernel,
    grad_sum_kernels,
    norm_backward_kernels,
    norm_kernels,
    rotary_kernels,
    swiglu_kernels,
)
from sim.cost.kernels.record import ADD_FLOPS, STAT_BYTES, TOKEN_ID_BYTES, Kernel, Narrow, check, mem
from sim.models.llama import sac_saved_linears

__all__ = ["LlamaBlockShape", "attention_fraction", "llama_block_kernels", "llama_embedding_kernels",
           "llama_head_kernels", "flash_attention_kernels", "attention_forward", "attention_backward",
           "swiglu_forward", "swiglu_backward", "norm_backward", "LLAMA_COLLECTIVE_AFTER", "SAC_NOT_NEEDED"]

#: Kernels after which a tensor-parallel block calls its collective: the row-parallel o and down projections in the
#: forward, the last column-parallel input gradients of the attention and of the MLP in the backward.
LLAMA_COLLECTIVE_AFTER = frozenset({"wo", "w2", "wq_wgrad", "w1_wgrad"})


class LlamaBlockShape:
    """One block's shape on one tensor-parallel rank: ``b`` samples of ``s`` tokens, hidden ``h``, ``a`` query and
    ``g`` key/value heads of dimension ``d``, SwiGLU width ``f``, split ``t`` ways; q/k/v biases, QK-norm, a
    sliding ``window`` (0: none); each sequence split over ``cp`` context-parallel ranks, this one holding ``s / cp``
    of its tokens (two chunks of ``s / 2cp``, :mod:`sim.cost.context_parallel`), ``s`` being the local length;
    ``sequence_parallel``: the norms and residual adds between the tensor-parallel regions run on ``1/t`` of the
    tokens (Korthikanti et al. §4.2.2, torchtitan's TP plan: ``SequenceParallel`` norms), ``norm_tokens``;
    ``o_bias``: a bias on the output projection (GPT-OSS); ``value_dim``: a value head's dimension where it is not
    ``d`` (latent attention: d is then the query/key head's)."""

    def __init__(self, b: int, s: int, h: int, a: int, g: int, d: int, f: int, t: int, *, qkv_bias: bool = False,
                 qk_norm: bool = False, window: int = 0, cp: int = 1, sequence_parallel: bool = False,
                 o_bias: bool = False, value_dim: int = 0) -> None:
        check(b=b, s=s, h=h, a=a, g=g, d=d, f=f, t=t, cp=cp)
        if a % t or g % t or f % t:
            raise SpecError(f"tensor-parallel degree {t} must divide the {a} query heads, the {g} key/value heads and "
                            f"the SwiGLU width {f}")
        if cp > 1 and (s % (2 * cp) or window):
            raise SpecError(f"context parallelism splits each sequence into 2·cp = {2 * cp} chunks: sequence {s} must "
                            f"be a multiple of {2 * cp}" + (", without a sliding window" if window else ""))
        self.b, self.h, self.d, self.t, self.cp = b, h, d, t, cp
        self.s = s // cp
        self.tokens = b * self.s
        if sequence_parallel and self.tokens % t:
            raise SpecError(f"sequence parallelism splits the {self.tokens} tokens of a microbatch over tp={t}")
        self.norm_tokens = self.tokens // t if sequence_parallel else self.tokens
        self.q_heads, self.kv_heads, self.ffn = a // t, g // t, f // t
        self.qkv_bias, self.qk_norm, self.window = qkv_bias, qk_norm, window
        self.o_bias = o_bias
        self.dv = value_dim or d  # a value head's dimension (latent attention's differs from the query/key's d)


def attention_fraction(s: int, window: int = 0, tile: int = FLASH_QUERY_TILE) -> float:
    """The share of the s × s (query, key) tile pairs a causal FlashAttention kernel computes: for query tile i the
    key tiles from the window's first to the diagonal, T(T + 1)/2 of T² without a window."""
    tiles = math.ceil(s / tile)
    reach = tiles if not window else math.ceil(window / tile) + 1  # key tiles a query tile can touch
    computed = sum(min(i + 1, reach) for i in range(tiles))
    return computed / (tiles * tiles)


def flash_attention_kernels(shape: LlamaBlockShape, db: int, backward: bool) -> list[Kernel]:
    """The attention of this rank's queries: one causal FlashAttention call, or under context parallelism C calls,
    one per key/value shard (:mod:`sim.cost.context_parallel`): the rank's own shard causally, then for each other
    shard the half of the (query, key) pairs the causal mask leaves (queries s × keys s/2, unmasked), each followed
    in the forward by the merge of its partial output into the running one (PyTorch's ``_SDPAMerger``, in fp32:
    ``out − sigmoid(lse_block − lse)·(out − out_block)``, three passes over the output, 30 bytes per value) and in
    the backward by the sums of its query and key/value gradients into fp32 accumulators (a read of each, the new
    gradient read, the sum written); the forward's output is cast back to the training dtype at the end."""
    s = shape.s
    kernels = _flash("", shape, db, backward, s, s, causal=True)
    q = shape.b * shape.q_heads * s * shape.d
    out = shape.b * shape.q_heads * s * shape.dv
    for step in range(1, shape.cp):
        kernels += _flash(f"_cp{step}", shape, db, backward, s, s // 2, causal=False)
        kv = shape.b * shape.kv_heads * s // 2 * (shape.d + shape.dv)  # K and V
        kernels.append(mem(f"cp_grad_accumulate{step}", "elementwise", q + kv, ADD_FLOPS,
                           (q + kv) * (2 * STAT_BYTES + db)) if backward else
                       mem(f"cp_merge{step}", "elementwise", out, 6, out * (7 * STAT_BYTES + db)))
    if shape.cp > 1 and not backward:
        kernels.append(mem("cp_merge_to_dtype", "elementwise", out, 0, out * (STAT_BYTES + db)))
    return kernels


def _flash(tag: str, shape: LlamaBlockShape, db: int, backward: bool, sq: int, sk: int, causal: bool) -> list[Kernel]:
    """FlashAttention-2 of ``sq`` queries against ``sk`` keys over this rank's query heads, each group sharing a
    key/value head (GQA): the forward reads Q and writes O and the log-sum-exp once and reads K, V once per
    computed query tile; the backward reads Q, dO, the statistics and the fp32 dQ accumulator once per computed key
    tile and K, V, dK, dV once, recomputing the scores (5 matmuls against the forward's 2). ``causal``: the masked
    tiles skipped (:func:`attention_fraction`; ``sq = sk``)."""
    d, dv, b = shape.d, shape.dv, shape.b
    fraction = attention_fraction(sq, shape.window) if causal else 1.0
    tiles = math.ceil(sk / FLASH_QUERY_TILE) * fraction  # key tiles each query tile meets, on average
    if d == dv:
        q = b * shape.q_heads * sq * d  # elements of Q (and of O)
        kv = b * shape.kv_heads * sk * d  # elements of K (and of V)
        scores = b * shape.q_heads * sq * sk
        rows = b * shape.q_heads * sq * STAT_BYTES
        if not backward:
            return [Kernel("flash_attention" + tag, "attention", 4.0 * scores * d * fraction,
                           float((2 * q + 2 * kv * tiles) * db + rows))]
        return [
            mem(f"flash_attention{tag}_bwd_preprocess", "elementwise", q, 2, 2 * q * db + rows),
            Kernel(f"flash_attention{tag}_bwd", "attention", 10.0 * scores * d * fraction,
                   float(4 * kv * db + tiles * (2 * q * db + 2 * q * STAT_BYTES + 2 * rows))),
            mem(f"flash_attention{tag}_dq_convert", "elementwise", q, 0, q * (STAT_BYTES + db)),
        ]
    # Query/key heads of d and value heads of dv (latent attention): the same passes, each tensor at its own width;
    # the score matmuls (QKᵀ, and dS·K, dSᵀ·Q, recomputed QKᵀ backward) run over d, those with V (PV, dP = dO·Vᵀ,
    # dV = Pᵀ·dO) over dv.
    q, o = b * shape.q_heads * sq * d, b * shape.q_heads * sq * dv
    k, v = b * shape.kv_heads * sk * d, b * shape.kv_heads * sk * dv
    scores = b * shape.q_heads * sq * sk
    rows = b * shape.q_heads * sq * STAT_BYTES
    if not backward:
        return [Kernel("flash_attention" + tag, "attention", 2.0 * scores * (d + dv) * fraction,
                       float((q + o + (k + v) * tiles) * db + rows))]
    return [
        mem(f"flash_attention{tag}_bwd_preprocess", "elementwise", o, 2, 2 * o * db + rows),
        Kernel(f"flash_attention{tag}_bwd", "attention", 2.0 * scores * (3 * d + 2 * dv) * fraction,
               float(2 * (k + v) * db + tiles * ((q + o) * db + 2 * q * STAT_BYTES + 2 * rows))),
        mem(f"flash_attention{tag}_dq_convert", "elementwise", q, 0, q * (STAT_BYTES + db)),
    ]


#: The forward kernels whose results a block's backward does not read (the down projection's output and the residual
#: add after it) or that per-op selective checkpointing keeps whatever the precision (SDPA's, and under context
#: parallelism its merges): never recomputed.
SAC_NOT_NEEDED = frozenset({"w2", "ffn_residual_add"})
SAC_KEPT_PREFIXES = ("flash_attention", "cp_merge")


def llama_block_kernels(shape: LlamaBlockShape, *, backward: bool, dtype_bytes: int = 2,
                        narrow: Narrow | None = None, compiled: bool = False,
                        selective_recompute: bool = False) -> tuple[Kernel, ...]:
    """One block's kernels on one tensor-parallel rank, in execution order (forward, or backward: the reverse, each
    GEMM's dgrad then wgrad). With ``narrow`` every linear runs on low-precision operands
    (:func:`sim.cost.kernels.block.linear_kernels`: tensorwise FP8 as torchao's Float8Linear, or a block-scaled
    format); the attention stays in the training dtype, as torchtitan's float8 converter leaves SDPA alone.
    ``compiled``: the block under ``torch.compile``, its memory-bound work fused (:mod:`sim.cost.kernels.pointwise`);
    eager otherwise, one kernel per aten op. ``selective_recompute``: the backward starts by recomputing what
    torchtitan's per-op selective checkpointing did not keep (:data:`SAC_NOT_NEEDED`,
    :func:`sim.models.llama.sac_saved_linears`; with narrow linears every linear's GEMM and casts but the down
    projection's GEMM)."""
    check(dtype_bytes=dtype_bytes)
    if not backward:
        return tuple(_forward(shape, dtype_bytes, narrow, compiled))
    kernels = _backward(shape, dtype_bytes, narrow, compiled)
    if selective_recompute:
        skip = SAC_NOT_NEEDED | set(sac_saved_linears(shape.qkv_bias, narrow is not None))
        again = [k for k in _forward(shape, dtype_bytes, narrow, compiled)
                 if k.name not in skip and not k.name.startswith(SAC_KEPT_PREFIXES)]
        kernels = [Kernel("recompute_" + k.name, k.kind, k.flops, k.bytes, k.gemm, k.batch, k.narrow)
                   for k in again] + kernels
    return tuple(kernels)


def _forward(shape: LlamaBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    ffn = [*norm_kernels("ffn_norm", shape.norm_tokens, shape.h, db, compiled=compiled, residual=True),
           *swiglu_forward("", shape.tokens, shape.h, shape.ffn, db, narrow, compiled),
           add_kernel("ffn_residual_add", shape.norm_tokens * shape.h, db)]
    return attention_forward(shape, db, narrow, compiled) + ffn


def _backward(shape: LlamaBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    return [*swiglu_backward("", shape.tokens, shape.h, shape.ffn, db, narrow, compiled),
            *norm_backward("ffn_norm", shape, db, compiled, 2),
            *attention_backward(shape, db, narrow, compiled)]


def attention_forward(shape: LlamaBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    """The attention half of a block's forward, from its input norm to the output projection (:func:`
    llama_block_kernels`' order)."""
    tokens, h, d = shape.tokens, shape.h, shape.d
    q_width, kv_width = shape.q_heads * d, shape.kv_heads * d
    bias = shape.qkv_bias

    def linear(name: str, n_in: int, n_out: int, fused_bias: bool = False) -> list[Kernel]:
        shared = compiled and name in ("wk", "wv")  # their input's FP8 cast is wq's: one under compile
        return linear_kernels(name, tokens, n_in, n_out, db, False, fused_bias, bias_grad=fused_bias, narrow=narrow,
                              compiled=compiled, cast_input=not shared)

    qk_norms: list[Kernel] = []
    if shape.qk_norm:
        qk_norms = [*norm_kernels("q_norm", tokens * shape.q_heads, d, db, compiled=compiled),
                    *norm_kernels("k_norm", tokens * shape.kv_heads, d, db, compiled=compiled)]
    return [
        *norm_kernels("attention_norm", shape.norm_tokens, h, db, compiled=compiled),
        *linear("wq", h, q_width, bias), *linear("wk", h, kv_width, bias), *linear("wv", h, kv_width, bias),
        *qk_norms,
        *rotary_kernels(tokens, shape.s, shape.q_heads, shape.kv_heads, d, db, backward=False, compiled=compiled),
        *flash_attention_kernels(shape, db, False),
        *linear("wo", q_width, h, shape.o_bias),
    ]


def attention_backward(shape: LlamaBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    """The attention half of a block's backward, from the output projection to its input norm (the input gradient
    arriving from the feed-forward half's norm)."""
    tokens, h, d = shape.tokens, shape.h, shape.d
    q_width, kv_width = shape.q_heads * d, shape.kv_heads * d
    bias = shape.qkv_bias

    def linear(name: str, n_in: int, n_out: int, fused_bias: bool = False) -> list[Kernel]:
        return linear_kernels(name, tokens, n_in, n_out, db, True, fused_bias, bias_grad=fused_bias, narrow=narrow,
                              compiled=compiled)

    qk_norms: list[Kernel] = []
    if shape.qk_norm:
        qk_norms = [*norm_backward_kernels("k_norm", tokens * shape.kv_heads, d, db, compiled=compiled, skip=False),
                    *norm_backward_kernels("q_norm", tokens * shape.q_heads, d, db, compiled=compiled, skip=False)]
    return [
        *linear("wo", q_width, h, shape.o_bias),
        *flash_attention_kernels(shape, db, True),
        *rotary_kernels(tokens, shape.s, shape.q_heads, shape.kv_heads, d, db, backward=True, compiled=compiled),
        *qk_norms,
        *linear("wv", h, kv_width, bias), *linear("wk", h, kv_width, bias), *linear("wq", h, q_width, bias),
        *norm_backward("attention_norm", shape, db, compiled, 3),
    ]


def swiglu_forward(prefix: str, tokens: int, h: int, f: int, db: int, narrow: Narrow | None,
                   compiled: bool) -> list[Kernel]:
    """A SwiGLU's forward over ``tokens`` tokens of width ``f`` on this rank: the gate GEMM ``w1``, the up GEMM
    ``w3``, SiLU × up, the down GEMM ``w2`` (names after ``prefix``: a dense block's, or its shared experts')."""
    def linear(name: str, n_in: int, n_out: int) -> list[Kernel]:
        shared = compiled and name == "w3"  # its input's FP8 cast is the gate's: one under compile
        return linear_kernels(prefix + name, tokens, n_in, n_out, db, False, False, bias_grad=False, narrow=narrow,
                              compiled=compiled, cast_input=not shared)

    silu, product = swiglu_kernels(tokens * f, db, backward=False, compiled=compiled), []
    if not compiled:  # eagerly SiLU runs right after the gate GEMM, the product after the up GEMM
        silu, product = silu[:1], silu[1:]
    return [*linear("w1", h, f), *(silu if not compiled else []), *linear("w3", h, f),
            *(product if not compiled else silu), *linear("w2", f, h)]


def swiglu_backward(prefix: str, tokens: int, h: int, f: int, db: int, narrow: Narrow | None,
                    compiled: bool) -> list[Kernel]:
    """:func:`swiglu_forward`'s backward: down, the product's and SiLU's gradients, up, gate."""
    def linear(name: str, n_in: int, n_out: int) -> list[Kernel]:
        return linear_kernels(prefix + name, tokens, n_in, n_out, db, True, False, bias_grad=False, narrow=narrow,
                              compiled=compiled)

    swiglu = swiglu_kernels(tokens * f, db, backward=True, compiled=compiled)
    gate_grads, silu_grad = (swiglu, []) if compiled else (swiglu[:2], swiglu[2:])  # eager: SiLU's after w3's
    return [*linear("w2", f, h), *gate_grads, *linear("w3", h, f), *silu_grad, *linear("w1", h, f)]


def norm_backward(name: str, shape: LlamaBlockShape, db: int, compiled: bool, grads: int) -> list[Kernel]:
    """A residual-stream norm's backward reached by the input gradients of ``grads`` linears: summed inside it, or,
    under sequence parallelism, summed over all tokens first (the sum is what is reduce-scattered) and the norm's
    backward then run on the rank's ``1/t``."""
    if shape.norm_tokens == shape.tokens:
        return norm_backward_kernels(name, shape.tokens, shape.h, db, compiled=compiled, summed_grads=grads)
    return [*grad_sum_kernels(name + "_input_grad_add", shape.tokens * shape.h, grads, db, compiled=compiled),
            *norm_backward_kernels(name, shape.norm_tokens, shape.h, db, compiled=compiled)]


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


def llama_head_kernels(b: int, s: int, h: int, vocab: int, t: int, *, backward: bool, dtype_bytes: int = 2,
                       sequence_parallel: bool = False) -> tuple[Kernel, ...]:
    """The head on one tensor-parallel rank: the final RMSNorm (on ``1/t`` of the tokens under sequence
    parallelism, which all-gathers its output for the LM head), then the logit GEMM and the fp32 cross entropy of
    :func:`sim.cost.kernels.vocab.head_kernels` (the same passes over the logits)."""
    from sim.cost.kernels.vocab import head_kernels

    rest = head_kernels(b, s, h, vocab, t, sequence_parallel=False, backward=backward, dtype_bytes=dtype_bytes)
    rows = b * s // t if sequence_parallel else b * s
    # head_kernels begins (forward) or ends (backward) with its LayerNorm: the RMSNorm takes its place, eager even
    # under --compile (torchtitan compiles the blocks only), its input the last block's output (no skip path).
    if not backward:
        return (*norm_kernels("final_norm", rows, h, dtype_bytes, compiled=False), *rest[1:])
    return (*rest[:-1], *norm_backward_kernels("final_norm", rows, h, dtype_bytes, compiled=False, skip=False))
