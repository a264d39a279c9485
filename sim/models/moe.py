"""``moe``: mixture-of-experts decoders (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3) from explicit shapes.

Layers, in order: ``embed`` (token table), ``block0 .. block{L-1}``, ``head`` (final RMSNorm, LM head, loss), as in
:mod:`sim.models.llama`, whose notation and conventions this family shares (bf16, no dropout, one sample of s
tokens). A block is pre-norm: RMSNorm → attention → residual → RMSNorm → feed-forward → residual, where the
feed-forward of the first ``dense_layers`` blocks is a SwiGLU of width ``ffn`` and of the others a **mixture of
experts**: a router (a linear h → E, softmax or sigmoid scores, the top k experts of each token), E routed experts,
each a SwiGLU of width f_e (``expert_ffn``), of which each token visits k, and ``shared_experts`` experts of the same
width that every token visits (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066 §3.2; held as one SwiGLU of width
``shared_experts · f_e``, as DeepSeek's code does). The token's output is its experts' outputs weighted by their
router scores (Shazeer et al. 2017, arXiv 1701.06538 §2; Fedus et al. 2021, arXiv 2101.03961 §2.1).

With ``mtp=1`` (DeepSeek-V3's multi-token prediction, arXiv 2412.19437 §2.2, depth 1) a layer ``mtp`` sits between
the last block and ``head``: the module's two RMSNorms of the main model's last hidden state and of the next tokens'
embeddings, the projection of their concatenation from 2h to h, and one more block (index ``layers``, so a MoE block
past the dense ones); the ``head`` then scores its prediction with the shared output head besides the main one (the
logits, their FLOPs and the loss twice). Its parameters are the block's, 2h + 2h·h, and the head's own RMSNorm h
(the token table and output head are shared; a pipeline's last stage would keep a copy of the table, not counted, as
for tied embeddings). This is Megatron-LM's FLOP count for it (``num_floating_point_operations`` in
``megatron/training/training.py``: one more layer, the "MTP eh norm + final norm" and "eh proj", the logits
``(mtp_num_layers + 1)`` times). :func:`total_params` counts the module, :func:`active_params` the main model only.

The attention is one of:

* grouped-query attention (``kv_lora = 0``): a query and g key/value heads of dimension d, q/k/v biases
  (``qkv_bias``), an output bias (``o_bias``), QK-norm (``qk_norm``), per-head attention sinks (``sinks``: one
  learned logit per head that joins every softmax's denominator, GPT-OSS), a sliding window on every
  ``window_period``-th layer from the first (GPT-OSS alternates 128-token windows and full attention:
  ``window=128, window_period=2``; ``window_period=1`` windows every layer);
* multi-head latent attention (``kv_lora > 0``; DeepSeek-V2, arXiv 2405.04434 §2.1.2; DeepSeek-V3, arXiv 2412.19437
  §2.1.1): queries through a low-rank bottleneck of ``q_lora`` (an RMSNorm inside it; ``q_lora = 0``: one h → a·(d +
  r) projection), keys and values from one down-projection to a latent of ``kv_lora`` plus a shared rotary key of
  ``rope_dim`` = r, an RMSNorm on the latent, and an up-projection to a heads of (d + v): d = ``head_dim`` the
  non-rotary query/key part, v = ``v_dim``. Each head's query and key have d + r values, its value v.

Parameters (exact: the HuggingFace modules' counts, held against the published totals in the tests):

* GQA attention: h·a·d + 2·h·g·d + a·d·h [+ a·d + 2·g·d biases] [+ h output bias] [+ 2d QK-norm] [+ a sinks];
* MLA: [h·q_lora + q_lora + q_lora·a·(d + r)] or [h·a·(d + r)], + h·(kv_lora + r) + kv_lora + kv_lora·a·(d + v)
  + a·v·h;
* two RMSNorms 2h per block; a dense block's SwiGLU 3·h·ffn;
* a MoE block's router h·E [+ E: GPT-OSS's router bias, DeepSeek-V3's score-correction bias], routed experts
  E·3·h·f_e [+ E·(2f_e + h) expert biases, GPT-OSS], shared experts 3·h·(shared_experts·f_e);
* embed V·h; head h + V·h (or h alone when tied).

Active parameters (:func:`active_params`) are those one token's forward multiplies by: everything but the
E − k routed experts it does not visit. The embedding table counts as active (Mistral's and Qwen's convention:
Mixtral 8x7B "12.9B active"); OpenAI and DeepSeek leave the lookup table out (GPT-OSS-120B "5.13B", DeepSeek-V3
"37B"): ``count_embedding=False``.

FLOPs (forward, per sample, one multiply-add = 2): 2s·(each GEMM's weights) for the attention's projections, the
router, the dense SwiGLU, the k routed and the shared experts (2s·3·h·f_e·k: the **active** parameters, as
Megatron-LM's and torchtitan's MFU formulas count them), and the attention scores and their weighting of the values
2s·κ·a·(d_qk + d_v) with κ the keys a query sees (s, or the window on a windowed layer) and d_qk, d_v the query/key
and value head dimensions; norms, rotary, activations, sinks, the top-k and the weighted sum are elementwise and not
counted. The backward is twice the forward.

Saved activations (per sample, bf16, no recomputation): a block's attention half keeps what a Llama block's does
(:mod:`sim.models.llama`: the output 2sh, two norms' outputs and the residual sum 6sh, q, k, v and the attention's
output and fp32 log-sum-exp, the norms' fp32 statistics, with MLA also the query and key/value latents, their norms'
inputs and statistics); a dense SwiGLU keeps 6s·ffn (fused, as below); a MoE feed-forward keeps the router's
fp32 scores 4sE and the top-k indices (int64, 8sk), the experts' input 2ksh, each routed token's fused SwiGLU
tensors (the gate and up GEMM's output 4f_e and the down GEMM's input 2f_e: 6ks·f_e; Megatron-Core's fused
bias-SwiGLU recomputes SiLU), the experts' outputs back at their tokens before the weighted sum 2ksh (their scores'
gradient reads them), and the shared experts' fused SwiGLU 6s·(shared_experts·f_e). Under expert parallelism the
experts' part is what this device computes (:mod:`sim.models.routing`: the tokens routed to its experts), the rest
its own tokens'.

Selective recomputation (``--recompute selective``) is Megatron-Core's fine-grained recomputation with the modules its
MoE guide names for MoE models, ``--recompute-modules layernorm moe_act`` and, with latent attention, ``mla_up_proj``
(``megatron/core/transformer/moe/README.md``, "Fine-grained Recomputation"; ``recompute_modules`` in
``transformer_config.py``): output-discarding checkpoints that drop the two block norms' outputs (and their fp32
statistics), the routed experts' SwiGLU output (the down projection's input, 2f_e per routed token) and, under MLA, the
up-projections' outputs and the rotary-applied q, k, v, each recomputed at the start of the backward from what the
block keeps anyway (its input and residual sum, the fc1 output, the latents). Megatron's default module, ``core_attn``,
is left out: with a fused (flash) attention it saves only the fp32 log-sum-exp, and Megatron itself warns that fused
attention has no need of it (``transformer_config.py``'s check of ``core_attn``); nor are the dense and shared
SwiGLUs (``mlp``, ``shared_experts``: whole-module checkpoints). The recomputed FLOPs are MLA's up-projections
(:func:`selective_recompute_flops`); the norms and the SwiGLU are elementwise (their time is the kernel model's,
:mod:`sim.cost.kernels.moe`).

Tensor parallelism splits the attention as in Llama (MLA: the down-projections and the latent norms are replicated,
the up-projections split by heads and the output projection by its input, as Megatron-Core's MLA does) and the dense
and shared SwiGLUs by their width; the router is replicated. A MoE layer under tensor parallelism needs sequence
parallelism (Megatron-Core requires it: the tokens of each rank enter the router once), so the mixture sees s/t of
the tokens on each rank; the routed experts are split by expert parallelism instead (``Sharding.ep``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.graph import Layer, LayerGraph, MixturePart, MlaPart, TransformerPart, canonical_spec
from sim.models.llama import DecoderShape
from sim.models.loss import loss_bytes
from sim.models.recompute_modules import RECOMPUTE_MODULES
from sim.models.routing import capped_shares, expert_shares, rank_loads, slowest_rank
from sim.models.sharding import NO_SHARDING, Collectives, Sharding, all_reduce, collective_layer, padded_vocab

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "OPTIONAL", "MoeShape", "build", "attention_params", "ffn_params",
           "expert_params", "block_params", "total_params", "active_params", "block_flops_fwd", "is_moe_layer",
           "is_windowed_layer", "block_saved_bytes", "selective_recompute_flops"]

NAME = "moe"
DESCRIPTION = ("mixture-of-experts decoder (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3): GQA or latent attention, "
               "top-k routed SwiGLU experts, shared experts, first dense_layers dense; mtp=1 adds a multi-token-"
               "prediction module (DeepSeek-V3); bf16; defaults = Qwen3-30B-A3B at seq 4096")
DEFAULTS: dict[str, int | float] = {
    "layers": 48,  # Qwen3-30B-A3B (configs/qwen3-30b-a3b.json)
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 4,
    "head_dim": 128,  # 0: hidden / heads; with MLA the non-rotary query/key part
    "ffn": 6144,  # the dense layers' SwiGLU width
    "vocab": 151936,
    "seq": 4096,  # Megatron-Bridge's MoE pre-training rows
    "qkv_bias": 0,
    "o_bias": 0,
    "qk_norm": 1,
    "sinks": 0,
    "tied": 0,
    "window": 0,
    "window_period": 1,
    "q_lora": 0,  # MLA's query bottleneck, 0: a plain query projection
    "kv_lora": 0,  # MLA's key/value latent, 0: grouped-query attention
    "rope_dim": 0,  # MLA's shared rotary key dimension
    "v_dim": 0,  # MLA's value head dimension
    "experts": 128,
    "topk": 8,
    "expert_ffn": 768,
    "shared_experts": 0,
    "dense_layers": 0,
    "router_bias": 0,
    "expert_bias": 0,
    "sigmoid": 0,  # 1: sigmoid router scores (DeepSeek-V3), 0: softmax
    "swiglu_clamp": 0,  # GPT-OSS clamps its SwiGLU's inputs at ±7 and adds 1 to the up projection
}
#: Keys a spec may give that its canonical form leaves out at their default, so that every spec written before the key
#: existed keeps its text: ``mtp``, the multi-token-prediction modules (DeepSeek-V3 trains with 1); ``groups`` and
#: ``group_topk``, group-limited routing (DeepSeek-V3: a token's experts from 4 of 8 groups of contiguous experts,
#: arXiv 2412.19437 §2.1.2; 0: none), which limits the servers a token's experts lie on
#: (:func:`sim.models.routing.expected_servers`).
OPTIONAL: dict[str, int] = {"mtp": 0, "groups": 0, "group_topk": 0}

DTYPE_BYTES = 2
TOKEN_ID_BYTES = 8
FP32_BYTES = 4
INDEX_BYTES = 8  # int64 expert indices of the top-k

_FLAGS = ("qkv_bias", "o_bias", "qk_norm", "sinks", "tied", "router_bias", "expert_bias", "sigmoid")
_MAY_BE_ZERO = ("head_dim", "window", "q_lora", "kv_lora", "rope_dim", "v_dim", "shared_experts", "dense_layers",
                "swiglu_clamp", "mtp", "groups", "group_topk", *_FLAGS)


@dataclass(frozen=True, kw_only=True)
class MoeShape(DecoderShape):
    """The shapes of a mixture-of-experts decoder (module docstring's notation and keys): a Llama-family decoder's
    (:class:`~sim.models.llama.DecoderShape`: ``ffn`` is the dense layers' SwiGLU width, ``window`` applies to the
    layers :func:`is_windowed_layer` names, so ``keys_seen`` is a windowed layer's) and the mixture's, attention's and
    router's own, given by keyword."""

    experts: int
    topk: int
    expert_ffn: int
    shared_experts: int = 0
    dense_layers: int = 0
    o_bias: bool = False
    sinks: bool = False
    window_period: int = 1
    q_lora: int = 0
    kv_lora: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    sigmoid: bool = False
    swiglu_clamp: int = 0
    mtp: int = 0
    groups: int = 0
    group_topk: int = 0

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (``kv_lora > 0``)."""
        return self.kv_lora > 0

    @property
    def qk_dim(self) -> int:
        """A head's query/key dimension: d, or d + r under MLA."""
        return self.head_dim + self.rope_dim if self.latent else self.head_dim

    @property
    def value_dim(self) -> int:
        """A head's value dimension: d, or v under MLA."""
        return self.v_dim if self.latent else self.head_dim

    @property
    def shared_ffn(self) -> int:
        """The shared experts' SwiGLU width, ``shared_experts · expert_ffn`` (0: none)."""
        return self.shared_experts * self.expert_ffn


def is_moe_layer(shape: MoeShape, index: int) -> bool:
    """Whether block ``index`` has a mixture of experts (every block from ``dense_layers`` on)."""
    return index >= shape.dense_layers


def is_windowed_layer(shape: MoeShape, index: int) -> bool:
    """Whether block ``index`` attends over a sliding window (every ``window_period``-th block from the first)."""
    return bool(shape.window) and index % shape.window_period == 0


def _attention_weights(shape: MoeShape) -> tuple[int, int]:
    """(weights split by tensor parallelism, weights replicated) of the attention's GEMMs, no biases or norms."""
    h, a, d = shape.hidden, shape.heads, shape.head_dim
    if not shape.latent:
        return h * a * d + 2 * h * shape.kv_heads * d + a * d * h, 0
    qk, r = shape.qk_dim, shape.rope_dim
    down = h * (shape.kv_lora + r) + (h * shape.q_lora if shape.q_lora else 0)
    up = (shape.q_lora if shape.q_lora else h) * a * qk + shape.kv_lora * a * (d + shape.v_dim) + a * shape.v_dim * h
    return up, down


def attention_params(shape: MoeShape, tp: int = 1) -> int:
    """Parameters of one block's attention shard at tensor-parallel degree ``tp``, its input RMSNorm included
    (module docstring): the split weights, biases and sinks over ``tp``, the rest whole."""
    split, replicated = _attention_weights(shape)
    replicated += shape.hidden  # the input RMSNorm
    if shape.latent:
        replicated += shape.kv_lora + shape.q_lora  # the latents' RMSNorms
    else:
        a, g, d = shape.heads, shape.kv_heads, shape.head_dim
        split += (a * d + 2 * g * d if shape.qkv_bias else 0) + (a if shape.sinks else 0)
        replicated += (shape.hidden if shape.o_bias else 0) + (2 * d if shape.qk_norm else 0)
    return split // tp + replicated


def expert_params(shape: MoeShape, shards: int = 1) -> int:
    """Parameters of one MoE block's routed experts held by one of ``shards`` expert-parallel × expert-tensor-parallel
    ranks (the experts and their biases split evenly)."""
    h, f = shape.hidden, shape.expert_ffn
    per_expert = 3 * h * f + ((2 * f + h) if shape.expert_bias else 0)
    return shape.experts * per_expert // shards


def ffn_params(shape: MoeShape, index: int, tp: int = 1, expert_shards: int = 1) -> int:
    """Parameters of block ``index``'s feed-forward shard, its RMSNorm included: the dense SwiGLU split by ``tp``; or
    the router (replicated), the routed experts split over ``expert_shards`` ranks and the shared experts by ``tp``."""
    h = shape.hidden
    if not is_moe_layer(shape, index):
        return 3 * h * shape.ffn // tp + h
    router = h * shape.experts + (shape.experts if shape.router_bias else 0)
    return h + router + expert_params(shape, expert_shards) + 3 * h * shape.shared_ffn // tp


def block_params(shape: MoeShape, index: int, tp: int = 1, expert_shards: int = 1) -> int:
    """Parameters of block ``index``'s shard: :func:`attention_params` + :func:`ffn_params`."""
    return attention_params(shape, tp) + ffn_params(shape, index, tp, expert_shards)


def _embed_params(shape: MoeShape, tp: int = 1) -> int:
    return padded_vocab(shape.vocab, tp) // tp * shape.hidden


def _head_params(shape: MoeShape, tp: int = 1) -> int:
    return shape.hidden + (0 if shape.tied else _embed_params(shape, tp))


def mtp_params(shape: MoeShape, tp: int = 1, expert_shards: int = 1) -> int:
    """Parameters of one multi-token-prediction module's shard (module docstring): its block (block index
    ``layers``: a MoE block past the dense ones), its two input RMSNorms 2h, the projection 2h·h (split by ``tp``) and
    the output head's RMSNorm h; the token table and the output head are the main model's."""
    h = shape.hidden
    return block_params(shape, shape.layers, tp, expert_shards) + 2 * h + 2 * h * h // tp + h


def total_params(shape: MoeShape) -> int:
    """The model's parameters, each tied matrix once, the multi-token-prediction modules' included (their token
    table and output head are the main model's)."""
    blocks = sum(block_params(shape, i) for i in range(shape.layers))
    return _embed_params(shape) + blocks + _head_params(shape) + shape.mtp * mtp_params(shape)


def active_params(shape: MoeShape, *, count_embedding: bool = True) -> int:
    """Parameters one token's forward through the main model uses: all but the routed experts it does not visit and
    the multi-token-prediction modules (module docstring; DeepSeek's 37 B activated are the main model's);
    ``count_embedding`` False leaves the token table out (OpenAI's and DeepSeek's convention)."""
    unvisited = (shape.experts - shape.topk) * expert_params(shape) // shape.experts
    moe_layers = shape.layers - shape.dense_layers
    table = _embed_params(shape) if count_embedding or shape.tied else 0
    main = total_params(shape) - shape.mtp * mtp_params(shape)
    return main - moe_layers * unvisited - _embed_params(shape) + table


def block_flops_fwd(shape: MoeShape, index: int) -> int:
    """Forward FLOPs of block ``index`` per sample (module docstring): 2s·(the GEMM weights a token uses) + the
    attention's 2s·κ·a·(d_qk + d_v)."""
    s, h = shape.seq, shape.hidden
    split, replicated = _attention_weights(shape)
    if is_moe_layer(shape, index):
        ffn = h * shape.experts + 3 * h * shape.expert_ffn * shape.topk + 3 * h * shape.shared_ffn
    else:
        ffn = 3 * h * shape.ffn
    keys = min(s, shape.window) if is_windowed_layer(shape, index) else s
    return 2 * s * (split + replicated + ffn) + 2 * s * keys * shape.heads * (shape.qk_dim + shape.value_dim)


def _check(values: dict[str, int], spec: str) -> MoeShape:
    """The shape the spec's values describe, checked; SpecError naming the spec otherwise."""
    for flag in _FLAGS:
        if values[flag] not in (0, 1):
            raise SpecError(f"{flag} must be 0 or 1, got {values[flag]} in {spec!r}")
    h, a, g = values["hidden"], values["heads"], values["kv_heads"]
    latent = values["kv_lora"] > 0
    if latent:
        if not values["head_dim"] or not values["rope_dim"] or not values["v_dim"]:
            raise SpecError(f"latent attention (kv_lora > 0) needs head_dim (the non-rotary query/key part), rope_dim "
                            f"and v_dim >= 1, in {spec!r}")
        for key in ("qkv_bias", "o_bias", "qk_norm", "sinks", "window"):
            if values[key]:
                raise SpecError(f"{key} is modelled for grouped-query attention only, not with kv_lora > 0, in "
                                f"{spec!r}")
    else:
        if values["q_lora"] or values["rope_dim"] or values["v_dim"]:
            raise SpecError(f"q_lora, rope_dim and v_dim belong to latent attention (kv_lora > 0), in {spec!r}")
        if a % g:
            raise SpecError(f"kv_heads ({g}) must divide heads ({a}) in {spec!r}")
        if not values["head_dim"] and h % a:
            raise SpecError(f"heads ({a}) must divide hidden ({h}) when head_dim is not given, in {spec!r}")
    if values["topk"] > values["experts"]:
        raise SpecError(f"topk ({values['topk']}) must be at most experts ({values['experts']}) in {spec!r}")
    if bool(values["groups"]) != bool(values["group_topk"]) or values["groups"] and (
            values["experts"] % values["groups"] or values["group_topk"] > values["groups"]
            or values["topk"] > values["group_topk"] * (values["experts"] // values["groups"])):
        raise SpecError(f"group-limited routing needs groups dividing experts ({values['experts']}) and 1 <= "
                        f"group_topk <= groups, their experts at least topk ({values['topk']}); got groups "
                        f"{values['groups']}, group_topk {values['group_topk']} in {spec!r}")
    if values["mtp"] > 1:
        raise SpecError(f"mtp must be 0 or 1 (DeepSeek-V3's one multi-token-prediction module), got {values['mtp']} "
                        f"in {spec!r}")
    if values["dense_layers"] > values["layers"]:
        raise SpecError(f"dense_layers ({values['dense_layers']}) must be at most layers ({values['layers']}) in "
                        f"{spec!r}")
    fields = {key: values[key] for key in [*DEFAULTS, *OPTIONAL] if key not in _FLAGS}
    fields["head_dim"] = values["head_dim"] or h // a
    return MoeShape(**fields, **{flag: bool(values[flag]) for flag in _FLAGS})


def shape_of(params: SpecParams) -> tuple[MoeShape, str]:
    """Read a ``moe:`` spec's keys (rejecting unknown ones): the shape and the canonical spec."""
    values = {key: params.int(key, int(default), minimum=0 if key in _MAY_BE_ZERO else 1)
              for key, default in {**DEFAULTS, **OPTIONAL}.items()}
    params.finish()
    spec = canonical_spec(NAME, {key: value for key, value in values.items() if OPTIONAL.get(key) != value})
    return _check(values, spec), spec


def build(params: SpecParams, sharding: Sharding = NO_SHARDING) -> LayerGraph:
    """Build ``moe:layers=..,hidden=..,experts=..,topk=..,expert_ffn=..``, or one device's shard of it (under expert
    parallelism, the rank whose experts receive the most tokens: every rank of the all-to-all waits for it).

    Raises:
        SpecError: a size below 1 (those of :data:`_MAY_BE_ZERO` may be 0), a flag other than 0 or 1, an unknown key,
            kv_heads not dividing heads, latent-attention keys without ``kv_lora`` (or GQA-only keys with it), topk
            above experts; ``tp`` not dividing the heads (and key/value heads), the widths or the tokens, a mixture
            under tensor parallelism without sequence parallelism; context parallelism with a sliding window; ``ep``
            not dividing the experts or ``etp`` their width; a routing trace listing another number of experts.
    """
    shape, spec = shape_of(params)
    return _graph(shape, spec, sharding)


def _graph(shape: MoeShape, spec: str, sharding: Sharding) -> LayerGraph:
    t, c = sharding.tp, sharding.cp
    recomputed = sharding.recompute_modules if sharding.selective_recompute else ()
    sp = sharding.sequence_parallel and t > 1
    heads_split = shape.heads if shape.latent else min(shape.heads, shape.kv_heads)
    if shape.heads % t or heads_split % t or shape.ffn % t or shape.shared_ffn % t:
        raise SpecError(f"tensor parallelism splits the heads and the SwiGLU widths: tp={t} must divide heads="
                        f"{shape.heads}{'' if shape.latent else f', kv_heads={shape.kv_heads}'}, ffn={shape.ffn} and "
                        f"the shared experts' width {shape.shared_ffn}, in {spec!r}")
    if t > 1 and not sp and shape.dense_layers < shape.layers:
        raise SpecError(f"a mixture of experts under tensor parallelism (tp={t}) needs sequence parallelism (each "
                        f"rank's tokens enter the router once, as Megatron-Core requires), in {spec!r}")
    if c > 1 and (shape.seq % (2 * c) or shape.window):
        raise SpecError(f"context parallelism splits each sequence into 2·cp = {2 * c} chunks: seq={shape.seq} must "
                        f"be a multiple of {2 * c}{' and there must be no sliding window' if shape.window else ''}, "
                        f"in {spec!r}")
    s, h = shape.seq // c, shape.hidden
    if sp and s % t:
        raise SpecError(f"sequence parallelism splits each rank's {s} tokens over tp={t}, in {spec!r}")
    ep, etp = sharding.ep, sharding.etp
    if shape.experts % ep or shape.expert_ffn % etp:
        raise SpecError(f"expert parallelism splits the experts and expert tensor parallelism their width: ep={ep} "
                        f"must divide experts={shape.experts} and etp={etp} expert_ffn={shape.expert_ffn}, in "
                        f"{spec!r}")
    vt = padded_vocab(shape.vocab, t) // t
    # One prediction's loss; each scored one (the main model's, each MTP module's) keeps its own.
    loss = loss_bytes(sharding.loss, s, vt, vocab_parallel=t > 1)
    full = DTYPE_BYTES * s * h
    boundary = full // t if sp else full
    none = Collectives()
    mla = MlaPart(shape.q_lora, shape.kv_lora, shape.rope_dim, shape.v_dim) if shape.latent else None
    common = dict(seq=shape.seq, hidden=h, heads=shape.heads, vocab=vt * t, tp=t, family=NAME,
                  kv_heads=shape.heads if shape.latent else shape.kv_heads, head_dim=shape.head_dim, ffn=shape.ffn,
                  qkv_bias=shape.qkv_bias, qk_norm=shape.qk_norm, cp=c, sequence_parallel=sp, o_bias=shape.o_bias,
                  sinks=shape.sinks, mla=mla)
    local = replace(shape, seq=s)
    embed = collective_layer(name="embed", kind="embedding", flops_fwd=0.0, flops_bwd=0.0,
                   param_bytes=DTYPE_BYTES * _embed_params(shape, t), activation_bytes=boundary, saved_bytes=boundary,
                   fwd=all_reduce(full) if t > 1 else none, bwd=none,
                   transformer=TransformerPart("embedding", **common))
    blocks = []
    for i in range(shape.layers):
        window = shape.window if is_windowed_layer(shape, i) else 0
        mixture = None
        if is_moe_layer(shape, i):
            mixture = _mixture(shape, i - shape.dense_layers, sharding)
        flops = block_flops_fwd(shape, i) // (t * c)
        # The attention's pair, and a SwiGLU's (dense, or the shared experts'); routed experts are not split by tp.
        pairs = 1 + (mixture is None or shape.shared_ffn > 0)
        comm = all_reduce(full, times=pairs) if t > 1 else none
        blocks.append(collective_layer(
            name=f"block{i}", kind="decoder", flops_fwd=float(flops), flops_bwd=float(2 * flops),
            param_bytes=DTYPE_BYTES * block_params(shape, i, t, ep * etp), activation_bytes=boundary,
            expert_param_bytes=DTYPE_BYTES * expert_params(shape, ep * etp) if mixture else 0,
            saved_bytes=block_saved_bytes(local, i, t, sp, mixture, recomputed=recomputed,
                                          saved_input_bytes=sharding.saved_input_bytes),
            recompute_flops=float(selective_recompute_flops(local, t, recomputed)), fwd=comm, bwd=comm,
            transformer=TransformerPart("block", **{**common, "window": window}, moe=mixture, recomputed=recomputed)))
    if shape.mtp:
        blocks.append(_mtp_layer(shape, local, sharding, common, boundary, full))
    scored = 1 + shape.mtp  # predictions the shared output head scores: the main model's and each MTP module's
    head = collective_layer(
        name="head", kind="head", flops_fwd=float(scored * 2 * s * h * vt), flops_bwd=float(scored * 4 * s * h * vt),
        param_bytes=DTYPE_BYTES * _head_params(shape, t), activation_bytes=FP32_BYTES,
        saved_bytes=scored * (full + FP32_BYTES * s + loss.saved), workspace_bytes=loss.forward_transient,
        backward_workspace_bytes=loss.backward_transient,
        fwd=all_reduce(FP32_BYTES * s, times=3 * scored) if t > 1 else none,
        bwd=all_reduce(full, times=scored) if t > 1 else none,
        transformer=TransformerPart("head", **common, mtp=shape.mtp))
    return LayerGraph(spec, [embed, *blocks, head], dtype_bytes=DTYPE_BYTES, input_bytes=TOKEN_ID_BYTES * s)


def _mtp_layer(shape: MoeShape, local: MoeShape, sharding: Sharding, common: dict, boundary: int, full: int) -> Layer:
    """The multi-token-prediction module (DeepSeek-V3, arXiv 2412.19437 §2.2, depth 1) as the layer after the last
    block: h' = M·[RMSNorm(h); RMSNorm(Emb(t_{i+1}))], then one more block (index ``layers``); its prediction is
    scored by the shared output head, which the ``head`` layer runs once more. It passes on the main model's last
    hidden state beside its own (2 × the boundary), and keeps, besides its block's tensors, the next tokens'
    embeddings 2sh, the concatenated norm outputs 4sh (the projection's input) and the projection's output 2sh
    (split along the sequence under sequence parallelism), and the norms' fp32 statistics 8s."""
    t, c, s, h = sharding.tp, sharding.cp, local.seq, shape.hidden
    index = shape.layers
    sp = sharding.sequence_parallel and t > 1
    mixture = _mixture(shape, index - shape.dense_layers, sharding) if is_moe_layer(shape, index) else None
    flops = (block_flops_fwd(shape, index) + 2 * shape.seq * 2 * h * h) // (t * c)
    pairs = 1 + (mixture is None or shape.shared_ffn > 0)
    comm = all_reduce(full, times=pairs) if t > 1 else Collectives()
    ep_shards = sharding.ep * sharding.etp
    recomputed = sharding.recompute_modules if sharding.selective_recompute else ()
    inputs = (DTYPE_BYTES * 8 * s * h + FP32_BYTES * 2 * s) // (t if sp else 1)
    return collective_layer(
        name="mtp", kind="decoder", flops_fwd=float(flops), flops_bwd=float(2 * flops),
        param_bytes=DTYPE_BYTES * mtp_params(shape, t, ep_shards), activation_bytes=2 * boundary,
        expert_param_bytes=DTYPE_BYTES * expert_params(shape, ep_shards) if mixture else 0,
        saved_bytes=inputs + block_saved_bytes(local, index, t, sp, mixture, recomputed=recomputed,
                                               saved_input_bytes=sharding.saved_input_bytes),
        recompute_flops=float(selective_recompute_flops(local, t, recomputed)), fwd=comm, bwd=comm,
        transformer=TransformerPart("block", **common, moe=mixture, recomputed=recomputed, mtp=1))


def _mixture(shape: MoeShape, moe_index: int, sharding: Sharding) -> MixturePart:
    """The mixture of the ``moe_index``-th MoE block on the expert-parallel rank that receives the most tokens under
    the sharding's routing, its experts' shares capped by the capacity factor (:mod:`sim.models.routing`)."""
    shares = expert_shares(sharding.routing, moe_index, shape.experts, topk=shape.topk)
    rank = slowest_rank(shares, sharding.ep)
    per_rank = shape.experts // sharding.ep
    capped = capped_shares(shares, sharding.capacity_factor)
    local = capped[rank * per_rank:(rank + 1) * per_rank]
    balanced = not sharding.capacity_factor and all(share == 1.0 / shape.experts for share in shares)
    return MixturePart(shape.experts, shape.topk, shape.expert_ffn, shape.shared_ffn, router_bias=shape.router_bias,
                       expert_bias=shape.expert_bias, sigmoid=shape.sigmoid, swiglu_clamp=shape.swiglu_clamp,
                       ep=sharding.ep, etp=sharding.etp, shares=() if balanced else local,
                       loads=() if balanced else rank_loads(capped, sharding.ep), groups=shape.groups,
                       group_topk=shape.group_topk, dispatcher=sharding.dispatcher)


def selective_recompute_flops(shape: MoeShape, tp: int = 1, recomputed: tuple[str, ...] = RECOMPUTE_MODULES) -> int:
    """FLOPs per sample of ``shape.seq`` tokens that one block's shard re-runs in its backward when selective
    recomputation drops the ``recomputed`` modules (module docstring; :mod:`sim.models.recompute_modules`): latent
    attention's up-projections under ``mla_up_proj``, 2s·(q_in·a·(d + r) + kv_lora·a·(d + v))/tp (q_in = ``q_lora``,
    or h without it); none under grouped-query attention or without ``mla_up_proj`` (the norms and the experts'
    SwiGLU are elementwise, not counted)."""
    if not shape.latent or "mla_up_proj" not in recomputed:
        return 0
    a, q_in = shape.heads, shape.q_lora or shape.hidden
    return 2 * shape.seq * (q_in * a * shape.qk_dim + shape.kv_lora * a * (shape.head_dim + shape.v_dim)) // tp


def block_saved_bytes(shape: MoeShape, index: int, tp: int = 1, sequence_parallel: bool = False,
                      mixture: MixturePart | None = None, *, recomputed: tuple[str, ...] = (),
                      saved_input_bytes: float = DTYPE_BYTES) -> int:
    """Bytes block ``index``'s shard keeps for its backward per sample of ``shape.seq`` tokens (module docstring):
    between the tensor-parallel regions replicated, or split by ``tp`` under ``sequence_parallel``; the attention's
    heads and the dense and shared SwiGLUs split by ``tp``; the mixture on the rank's tokens (1/``tp`` of them under
    sequence parallelism, all of them without tensor parallelism), its experts' on the tokens ``mixture`` routes to
    this device (balanced over the whole model's experts when not given); without what selective recomputation of the
    ``recomputed`` modules drops (:mod:`sim.models.recompute_modules`): ``layernorm`` the two block norms' outputs and
    statistics, ``moe_act`` the routed experts' SwiGLU output, ``mla_up_proj`` latent attention's q, k, v.
    Each linear's input is kept at ``saved_input_bytes`` per element (w of :mod:`sim.models.blocks`: the training
    dtype's 2, or narrower in a ``transformer-engine`` block under a narrow precision): the norms' outputs (the
    latents' too), the routed tokens entering the experts, each SwiGLU's down-projection input, and, when narrower,
    the o projection's quantized input beside the attention's output."""
    w = saved_input_bytes
    s, h, a = shape.seq, shape.hidden, shape.heads
    between = tp if sequence_parallel else 1
    # the output and the residual sum; the two norms' outputs (the qkv and fc1 projections' inputs) and statistics,
    # unless Megatron-Core's "layernorm" recomputes the norms from their inputs
    replicated = DTYPE_BYTES * 2 * s * h + (0 if "layernorm" in recomputed else w * 2 * s * h + FP32_BYTES * 2 * s)
    q, kv_out = a * shape.qk_dim, (a * (shape.qk_dim + shape.value_dim) if shape.latent
                                   else 2 * shape.kv_heads * shape.head_dim)
    if "mla_up_proj" in recomputed and shape.latent:  # the up-projections' outputs (q, k, v), recomputed from latents
        q = kv_out = 0
    quantized_copy = w if w < DTYPE_BYTES else 0  # in bf16 the o projection keeps the attention's own output
    split = (DTYPE_BYTES * s * (q + kv_out + a * shape.value_dim) + FP32_BYTES * s * a
             + quantized_copy * s * a * shape.value_dim)
    if shape.latent:  # the latents' norm inputs, their outputs (the up-projections' inputs) and their statistics,
        latent = shape.q_lora + shape.kv_lora  # replicated across the TP ranks
        replicated += (DTYPE_BYTES * s * (latent + shape.rope_dim) + w * s * latent + DTYPE_BYTES * s * shape.rope_dim
                       + FP32_BYTES * 2 * s)
    elif shape.qk_norm:
        split += DTYPE_BYTES * s * (q + shape.kv_heads * shape.head_dim) + FP32_BYTES * s * (a + shape.kv_heads)
    if not is_moe_layer(shape, index):  # the dense SwiGLU: fc1's output and fc2's input
        return int(replicated // between + (split + (2 * DTYPE_BYTES + w) * s * shape.ffn) // tp)
    tokens = s // tp if sequence_parallel else s  # what enters the router on this rank
    k = shape.topk
    part = mixture or MixturePart(shape.experts, k, shape.expert_ffn)
    received = sum(part.expert_tokens(tokens))  # the tokens this device's experts compute
    width = shape.expert_ffn // part.etp  # etp divides expert_ffn (checked when the model is built)
    kept = (FP32_BYTES * tokens * shape.experts + INDEX_BYTES * tokens * k  # router scores, top-k indices
            # the routed tokens as fc1 keeps them, its output, and fc2's input unless "moe_act" recomputes it
            + received * (w * h + 2 * DTYPE_BYTES * width + (0 if "moe_act" in recomputed else w * width))
            + DTYPE_BYTES * tokens * k * h  # the experts' outputs, back at their tokens' device
            + (2 * DTYPE_BYTES + w) * tokens * shape.shared_ffn)
    return int(replicated // between + split // tp + kept)
