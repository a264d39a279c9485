"""``llama``: the dense decoder of Llama 2/3, Mistral, Qwen 2/2.5 and Qwen 3, from explicit shapes.

Layers, in order: ``embed`` (token embeddings, no position table: positions are rotary), ``block0 .. block{L-1}``
(pre-norm decoder blocks), ``head`` (final RMSNorm, LM head Linear without bias, cross-entropy loss). Training is
bf16 (``dtype_bytes = 2``); there is no dropout. The configs people train ship as presets
(:mod:`sim.models.hf_config`), which read a HuggingFace ``config.json`` into these keys.

Notation (per sample, microbatch size b = 1): s = sequence length, h = hidden size, a = query heads, g = key/value
heads (grouped-query attention; g = a is multi-head, g = 1 multi-query), d = head dimension (``head_dim``; h / a when
not given), f = the SwiGLU's inner width (``intermediate_size``), V = vocabulary.

Parameters (exact: the HuggingFace modules' counts, held against the published totals in the tests):

* block = input RMSNorm h + q (h·a·d) + k, v (h·g·d each) + o (a·d·h) [+ q, k, v biases a·d + 2g·d where the family
  has them: Qwen 2/2.5] [+ Qwen 3's QK-norm: two RMSNorms of d] + post-attention RMSNorm h + gate, up (h·f each) +
  down (f·h)
* embed = V·h
* head = final RMSNorm h + LM head V·h, or h alone when the embeddings are tied (the LM head reuses the token table,
  which ``embed`` counts; on a pipeline whose last stage does not hold the embedding, frameworks keep a copy there
  and all-reduce its gradient, which is not modelled)

FLOPs (forward, per sample; one multiply-add = 2): each weight matrix of a block 2·s·(its size); the attention
scores and the attention over values 2·s·k·a·d each, k being the keys each query may see, counted over the whole
sequence (k = s) as Megatron-LM's and torchtitan's MFU formulas count them, or the window under sliding-window
attention (k = min(s, window)). Norms, rotary embeddings, the SwiGLU's SiLU and product, and residual adds are
elementwise and not counted, as in those formulas; FlashAttention's skipping of the masked half is the kernel's
matter, not the model's FLOPs. The backward is twice the forward (input and weight gradients).

Saved activations (per sample, bf16, FlashAttention, no recomputation), each the tensor autograd keeps for the
backward, counted once: the block's output 2sh (by ``sim.models.graph``'s convention a layer counts its output, not
its input), the input norm's output 2sh, the attention's q 2s·a·d, k and v 2s·g·d each, its output 2s·a·d (also the
o projection's input) and its fp32 log-sum-exp 4s·a, the residual sum 2sh and the post-attention norm's output 2sh,
the gate and up outputs 2sf each, the SiLU's output 2sf and the product (the down projection's input) 2sf, and each
RMSNorm's fp32 reciprocal root-mean-square 4s; with QK-norm also the norms' inputs 2s·a·d + 2s·g·d and their fp32
statistics 4s(a + g). That is 8sh + 4s·a·d + 4s·g·d + 4sa + 8sf + 8s [+ 2s(a + g)d + 4s(a + g)]. Megatron-Core's
Transformer Engine blocks (``--blocks transformer-engine``, :mod:`sim.models.blocks`) keep the two norms' outputs at w
bytes per element (the quantized input of the linear they feed), the fused SwiGLU's fc1 output 4sf and the down
projection's input w·sf, and under a narrow precision the o projection's quantized input w·s·a·d beside the attention's
output: 4sh + 2w·sh + 4s·a·d + 4s·g·d + 4sa + (4 + w)sf + 8s [+ w·s·a·d] [+ the QK-norm's].

Tensor-parallel shard (Megatron-LM §3, as for ``gpt``): q, k, v, gate and up are column-parallel (split by heads, the
key/value heads too, and by f), o and down row-parallel, the norms replicated; two all-reduces of 2sh per block in
each pass. t must divide a and g (Megatron also replicates key/value heads when t > g: not modelled). The token table
and the LM head are vocabulary-parallel. Under sequence parallelism (Korthikanti et al. §4.2.2; torchtitan's TP plan,
``SequenceParallel`` norms) the norms, residual adds and what they save run on s/t of the sequence, and each
all-reduce becomes a reduce-scatter and an all-gather of the same bytes (kept as all-reduce equivalents).

Selective recomputation is torchtitan's per-op selective activation checkpointing (``selective_ac_option = "op"``,
its presets' setting; ``_apply_ac_to_transformer_block`` in ``parallelize_llama.py``, the same from 9dec370 to
e7c0cae): of the ops a block's forward runs it keeps the outputs of ``aten.mm`` except every second one, of SDPA and
of ``max``, and recomputes everything else its backward needs (:func:`sac_saved_linears`). A block then keeps its
output 2sh (the next block's checkpointed input), the saved linears' outputs (q 2s·a·d, v 2s·g·d, gate 2sf and down
2sh for a bias-free block), SDPA's output 2s·a·d and its fp32 log-sum-exp 4sa. Under FP8 no linear's output is kept
(an FP8 linear is ``_scaled_mm``, which the policy does not list); the ledger counts the bf16 policy's set, an
upper bound there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.blocks import EAGER, TRANSFORMER_ENGINE
from sim.models.graph import LayerGraph, TransformerPart, canonical_spec
from sim.models.loss import loss_bytes
from sim.models.sharding import NO_SHARDING, Collectives, Sharding, all_reduce, collective_layer, padded_vocab

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "DecoderShape", "build", "block_params", "block_flops_fwd",
           "block_saved_bytes", "embed_params", "head_params", "total_params"]

NAME = "llama"
DESCRIPTION = ("Llama-family decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU), bf16; head_dim=0 "
               "means hidden/heads, window=0 full attention; defaults = Llama 3.1 8B at seq 8192")
DEFAULTS: dict[str, int | float] = {
    "layers": 32,  # Llama 3.1 8B (configs/llama3.1-8b.json)
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 0,  # 0: hidden / heads
    "ffn": 14336,
    "vocab": 128256,
    "seq": 8192,  # torchtitan's default training sequence
    "qkv_bias": 0,  # 1: biases on q, k and v (Qwen 2/2.5)
    "qk_norm": 0,  # 1: RMSNorm on each head's q and k (Qwen 3)
    "tied": 0,  # 1: the LM head reuses the token table
    "window": 0,  # sliding-window attention's window in tokens; 0: full causal attention
}

DTYPE_BYTES = 2  # bf16 weights and activations
TOKEN_ID_BYTES = 8  # int64 token ids
FP32_BYTES = 4


@dataclass(frozen=True)
class DecoderShape:
    """The shapes of a Llama-family decoder (module docstring's notation).

    Attributes:
        layers: decoder blocks L.
        hidden: h.
        heads: query heads a.
        kv_heads: key/value heads g (g divides a).
        head_dim: d.
        ffn: the SwiGLU's inner width f.
        vocab: V.
        seq: training sequence length s, tokens.
        qkv_bias: biases on q, k and v.
        qk_norm: an RMSNorm of d on each head's q and k.
        tied: the LM head reuses the token table.
        window: sliding-window attention's window in tokens, 0 for full attention.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    seq: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    window: int = 0

    @property
    def keys_seen(self) -> int:
        """Keys each query's FLOPs are counted over: s, or the window under sliding-window attention."""
        return min(self.seq, self.window) if self.window else self.seq


def block_params(shape: DecoderShape, tp: int = 1) -> int:
    """Exact parameters of one block's shard at tensor-parallel degree ``tp`` (module docstring; ``tp`` divides the
    heads and key/value heads): the split weights and biases over ``tp``, the norms whole."""
    h, d, f = shape.hidden, shape.head_dim, shape.ffn
    q, kv = shape.heads * d, shape.kv_heads * d
    split = h * q + 2 * h * kv + q * h + 3 * h * f + ((q + 2 * kv) if shape.qkv_bias else 0)
    replicated = 2 * h + (2 * d if shape.qk_norm else 0)
    return split // tp + replicated


def embed_params(shape: DecoderShape, tp: int = 1) -> int:
    """The token table's shard: V (padded to a multiple of ``tp``) / ``tp`` rows of h."""
    return padded_vocab(shape.vocab, tp) // tp * shape.hidden


def head_params(shape: DecoderShape, tp: int = 1) -> int:
    """The final RMSNorm, and the LM head's shard unless it is tied to the token table."""
    return shape.hidden + (0 if shape.tied else embed_params(shape, tp))


def total_params(shape: DecoderShape) -> int:
    """The model's parameters, each tied matrix once."""
    return embed_params(shape) + shape.layers * block_params(shape) + head_params(shape)


def block_flops_fwd(shape: DecoderShape) -> int:
    """Forward FLOPs of one block per sample (module docstring): 2s·(weights of the GEMMs) + 4s·k·a·d."""
    h, d, f, s = shape.hidden, shape.head_dim, shape.ffn, shape.seq
    q, kv = shape.heads * d, shape.kv_heads * d
    gemm_weights = h * q + 2 * h * kv + q * h + 3 * h * f
    return 2 * s * gemm_weights + 4 * s * shape.keys_seen * q


#: A block's linears in the order its forward runs them (torchtitan's names: q, k, v, o; gate w1, up w3, down w2).
LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def sac_saved_linears(qkv_bias: bool, fp8: bool = False) -> tuple[str, ...]:
    """The linears whose outputs torchtitan's per-op selective checkpointing keeps (module docstring): the 1st,
    3rd, … ``aten.mm`` of the forward. A biased linear is an ``addmm``, neither kept nor counted; under ``fp8``
    every linear is a ``_scaled_mm`` and none is kept."""
    if fp8:
        return ()
    plain = [name for name in LINEARS if not (qkv_bias and name in ("wq", "wk", "wv"))]
    return tuple(plain[0::2])


def sac_recompute_flops(shape: DecoderShape, tp: int = 1) -> int:
    """FLOPs per sample of the GEMMs one block's shard re-runs under per-op selective checkpointing (bf16: the
    linears :func:`sac_saved_linears` does not keep, other than down, whose output the backward does not need)."""
    h, d, f, s = shape.hidden, shape.head_dim, shape.ffn, shape.seq
    q, kv = shape.heads * d, shape.kv_heads * d
    weights = {"wq": h * q, "wk": h * kv, "wv": h * kv, "wo": q * h, "w1": h * f, "w3": h * f, "w2": 0}
    kept = set(sac_saved_linears(shape.qkv_bias))
    return 2 * s * sum(size for name, size in weights.items() if name not in kept) // tp


def block_saved_bytes(shape: DecoderShape, tp: int = 1, selective_recompute: bool = False,
                      sequence_parallel: bool = False, *, blocks: str = EAGER,
                      saved_input_bytes: float = DTYPE_BYTES) -> int:
    """Bytes one block's shard keeps for its backward per sample (module docstring): what lies between the
    tensor-parallel regions (the output, the norms' outputs, the residual sum, their fp32 statistics) is replicated,
    or split by ``tp`` too under ``sequence_parallel``, the rest is split by ``tp``; under ``selective_recompute``
    what torchtitan's per-op policy keeps. ``transformer-engine`` ``blocks`` keep what Megatron-Core's Transformer
    Engine block keeps (:mod:`sim.models.blocks`): the norms' outputs and the o and down projections' inputs at
    ``saved_input_bytes`` per element (the o projection's beside the attention's bf16 output when narrower), and the
    fused SwiGLU's fc1 output 4f instead of the eager SwiGLU's four tensors."""
    h, d, f, s = shape.hidden, shape.head_dim, shape.ffn, shape.seq
    q, kv = shape.heads * d, shape.kv_heads * d
    between = tp if sequence_parallel else 1  # how many ways the tensors between the TP regions are split
    if selective_recompute:
        if blocks == TRANSFORMER_ENGINE:
            raise SpecError("the llama family's selective recomputation is torchtitan's per-op policy; with "
                            "transformer-engine blocks it is not modelled (use --recompute none or full)")
        # o and down are row-parallel: each rank's mm output is a whole-width partial sum
        width = {"wq": q // tp, "wk": kv // tp, "wv": kv // tp, "wo": h, "w1": f // tp, "w3": f // tp, "w2": h}
        kept = sum(width[name] for name in sac_saved_linears(shape.qkv_bias)) + q // tp
        return DTYPE_BYTES * s * (kept + h // between) + FP32_BYTES * s * (shape.heads // tp)
    w = saved_input_bytes  # 2 but in a transformer-engine block under a narrow precision
    quantized_copy = w if w < DTYPE_BYTES else 0  # in bf16 the o projection keeps the attention's own output
    # eager: gate, up, SiLU and product; Megatron's fused bias-SwiGLU: fc1's output (gate and up), and fc2 its input
    swiglu = DTYPE_BYTES * 4 * s * f if blocks == EAGER else 2 * DTYPE_BYTES * s * f + w * s * f
    replicated = (DTYPE_BYTES * 2 * s * h + w * 2 * s * h + FP32_BYTES * 2 * s) // between
    split = (DTYPE_BYTES * (2 * s * q + 2 * s * kv) + FP32_BYTES * s * shape.heads + quantized_copy * s * q
             + swiglu)
    if shape.qk_norm:
        split += DTYPE_BYTES * s * (q + kv) + FP32_BYTES * s * (shape.heads + shape.kv_heads)
    return int(replicated + split // tp)


def _shape(values: dict[str, int], spec: str) -> DecoderShape:
    """The shape the spec's values describe, checked; SpecError naming the spec otherwise."""
    h, a, g = values["hidden"], values["heads"], values["kv_heads"]
    if a % g:
        raise SpecError(f"kv_heads ({g}) must divide heads ({a}) in {spec!r}")
    d = values["head_dim"] or h // a
    if not values["head_dim"] and h % a:
        raise SpecError(f"heads ({a}) must divide hidden ({h}) when head_dim is not given, in {spec!r}")
    for flag in ("qkv_bias", "qk_norm", "tied"):
        if values[flag] not in (0, 1):
            raise SpecError(f"{flag} must be 0 or 1, got {values[flag]} in {spec!r}")
    return DecoderShape(values["layers"], h, a, g, d, values["ffn"], values["vocab"], values["seq"],
                        bool(values["qkv_bias"]), bool(values["qk_norm"]), bool(values["tied"]), values["window"])


def build(params: SpecParams, sharding: Sharding = NO_SHARDING) -> LayerGraph:
    """Build ``llama:layers=..,hidden=..,heads=..,kv_heads=..,ffn=..,vocab=..,seq=..``, or one device's shard of it.

    Raises:
        SpecError: a size below 1 (``head_dim`` and ``window`` may be 0), kv_heads not dividing heads, heads not
            dividing hidden without an explicit head_dim, a flag other than 0 or 1, an unknown key; ``tp`` not
            dividing the heads or the key/value heads.
    """
    values = {key: params.int(key, int(default), minimum=0 if key in ("head_dim", "window", "qkv_bias", "qk_norm",
                                                                        "tied") else 1)
              for key, default in DEFAULTS.items()}
    params.finish()
    spec = canonical_spec(NAME, values)
    shape = _shape(values, spec)
    t = sharding.tp
    sp = sharding.sequence_parallel and t > 1
    if shape.heads % t or shape.kv_heads % t:
        raise SpecError(f"tensor parallelism splits the query and key/value heads: tp={t} must divide heads="
                        f"{shape.heads} and kv_heads={shape.kv_heads} in {spec!r}")
    c = sharding.cp
    if c > 1 and (shape.seq % (2 * c) or shape.window):
        raise SpecError(f"context parallelism splits each sequence into 2·cp = {2 * c} chunks: seq={shape.seq} must "
                        f"be a multiple of {2 * c}{' and there must be no sliding window' if shape.window else ''}, "
                        f"in {spec!r}")
    # What one device holds of each sequence: 1/C of its tokens (its attention FLOPs are 1/C of the whole too, the
    # causal load balance of sim.cost.context_parallel).
    local = replace(shape, seq=shape.seq // c)
    s, h = local.seq, shape.hidden
    vt = padded_vocab(shape.vocab, t) // t
    loss = loss_bytes(sharding.loss, s, vt, vocab_parallel=t > 1)
    # What each layer is, for the GPU kernel model (sim.cost.kernels.llama).
    dims = dict(seq=shape.seq, hidden=h, heads=shape.heads, vocab=vt * t, tp=t, family="llama",
                kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn=shape.ffn, qkv_bias=shape.qkv_bias,
                qk_norm=shape.qk_norm, window=shape.window, cp=c, sequence_parallel=sp)
    full = DTYPE_BYTES * s * h  # one bf16 s × h tensor
    # What crosses every layer and stage boundary: the residual stream, split along the sequence under SP.
    boundary = full // t if sp else full
    none = Collectives()
    embed = collective_layer(name="embed", kind="embedding", flops_fwd=0.0, flops_bwd=0.0,  # a table lookup: no matmul
                   param_bytes=DTYPE_BYTES * embed_params(shape, t), activation_bytes=boundary, saved_bytes=boundary,
                   fwd=all_reduce(full) if t > 1 else none, bwd=none,
                   transformer=TransformerPart("embedding", **dims))
    flops = block_flops_fwd(shape) // (t * c)
    comm = all_reduce(full, times=2) if t > 1 else none
    recompute = float(sac_recompute_flops(local, t)) if sharding.selective_recompute else 0.0
    blocks = [collective_layer(name=f"block{i}", kind="decoder", flops_fwd=float(flops), flops_bwd=float(2 * flops),
                     param_bytes=DTYPE_BYTES * block_params(shape, t), activation_bytes=boundary,
                     saved_bytes=block_saved_bytes(local, t, sharding.selective_recompute, sp, blocks=sharding.blocks,
                                                   saved_input_bytes=sharding.saved_input_bytes),
                     recompute_flops=recompute,
                     fwd=comm, bwd=comm,
                     transformer=TransformerPart("block", **dims))
              for i in range(shape.layers)]
    head = collective_layer(
        name="head",
        kind="head",
        # LM head 2shV forward, 4shV backward, V/t columns per shard; the norm and the loss are elementwise.
        flops_fwd=float(2 * s * h * vt),
        flops_bwd=float(4 * s * h * vt),
        param_bytes=DTYPE_BYTES * head_params(shape, t),
        activation_bytes=FP32_BYTES,  # the fp32 loss; nothing leaves the last layer
        # The norm's output (the LM head's input) 2sh and its fp32 statistics, and what the cross entropy over this
        # shard's logits keeps and holds (sim.models.loss; the last block's output, the norm's input, is counted there).
        saved_bytes=full + FP32_BYTES * s + loss.saved,
        workspace_bytes=loss.forward_transient,
        backward_workspace_bytes=loss.backward_transient,
        fwd=all_reduce(FP32_BYTES * s, times=3) if t > 1 else none,  # vocab-parallel cross entropy
        bwd=all_reduce(full) if t > 1 else none,  # the shards' gradients of the replicated LM head input
        transformer=TransformerPart("head", **dims),
    )
    return LayerGraph(spec, [embed, *blocks, head], dtype_bytes=DTYPE_BYTES, input_bytes=TOKEN_ID_BYTES * s)
