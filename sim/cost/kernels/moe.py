"""The kernels of a mixture-of-experts block on one device (:mod:`sim.models.moe`): grouped-query or latent attention,
then a dense SwiGLU or a mixture of experts, as Megatron-Core runs them with its token dispatcher over all-to-all.

A mixture's forward on one device (Megatron-Core ``MoELayer``: ``router`` → ``token_dispatcher.dispatch`` →
``experts`` (``TEGroupedMLP``) → ``token_dispatcher.combine``, with the shared experts beside; Shazeer et al. 2017,
arXiv 1701.06538 §2; the DeepSeekMoE shared experts, arXiv 2401.06066 §3.2):

1. the router: a GEMM of the device's T tokens against the E expert embeddings, then the scores (softmax, or
   sigmoid for DeepSeek-V3) and the top k of each token, in one fused kernel (reads the logits, writes the fp32
   scores, the k chosen scores and their int64 indices);
2. the permutation: each token copied once per chosen expert into expert order (reads T·h, writes k·T·h);
3. (the dispatch all-to-all: an op of the plan, costed on the links, :mod:`sim.ir.ops`); under expert parallelism the
   received tokens arrive grouped by source and are sorted by local expert (a copy of what arrived);
4. the experts: one grouped GEMM for every local expert's gate and up projections (M_e tokens × 2f_e/etp, K = h),
   the SwiGLU (GPT-OSS's clamped one: two clamps and its +1 more per value), one grouped GEMM for the down projections
   (M_e × h, K = f_e/etp), each product's tiles apart (:func:`sim.cost.kernels.record.grouped_gemm`), M_e the tokens
   routing gives each of this device's experts (:meth:`sim.models.graph.MixturePart.expert_tokens`);
5. the sort back to source order, (the combine all-to-all), and the un-permutation: each token's k outputs weighted by
   their scores and summed (reads k·T·h and the scores, writes T·h);
6. the shared experts, a dense SwiGLU over the tokens (split by tensor parallelism), and their sum with the routed
   output.

The backward runs the same steps in reverse with each GEMM's input gradient then weight gradient (a grouped GEMM's
weight gradient is one grouped launch too, its K the tokens), the SwiGLU's gradient, the scores' gradient (a dot of
each returned output with its gradient) and the router's.

Latent attention (DeepSeek-V2 §2.1.2, DeepSeek-V3 §2.1.1; Megatron-Core's ``MLASelfAttention`` without the
inference-time absorption): the query's down-projection, its RMSNorm and up-projection (or one projection without
``q_lora``), the key/value down-projection to the latent and the shared rotary key, the latent's RMSNorm and
up-projection to every head's non-rotary key and value, the rotary embedding of the query's and the key's rotary
parts with the keys and queries assembled (one pass over each), the attention over heads of query/key dimension
d + r and value dimension v, and the output projection. The down-projections are replicated across the
tensor-parallel ranks, the rest split by heads.

Under selective recomputation a block's backward starts with what Megatron-Core's ``layernorm``, ``moe_act`` and
``mla_up_proj`` recompute modules re-run (:func:`selective_recompute_kernels`, :mod:`sim.models.moe`). The
multi-token-prediction module's block (``mtp``) runs its two input norms, their concatenation and the 2h → h
projection before the block's own kernels (their backward after).

Elementwise work follows :mod:`sim.cost.kernels.pointwise`: eager (one kernel per op, as a Llama block) or, with
``compiled``, fused (Transformer Engine's fused norms, SwiGLU and permutation kernels fuse as inductor does).
"""

from __future__ import annotations

from dataclasses import replace

from sim.core.errors import SpecError
from sim.cost.kernels.block import cast_kernel, linear_kernels, rowwise_cast_kernels
from sim.cost.kernels.llama import (
    LlamaBlockShape,
    attention_backward,
    attention_forward,
    flash_attention_kernels,
    norm_backward,
    swiglu_backward,
    swiglu_forward,
)
from sim.cost.kernels.pointwise import add_kernel, norm_backward_kernels, norm_kernels, swiglu_kernels
from sim.cost.kernels.record import ADD_FLOPS, Kernel, Narrow, gemm, grouped_gemm, mem
from sim.models.graph import MixturePart, MlaPart
from sim.models.recompute_modules import RECOMPUTE_MODULES

__all__ = ["MoeBlockShape", "moe_block_kernels", "selective_recompute_kernels", "MOE_COLLECTIVE_AFTER",
           "expert_all_to_alls"]

#: Kernels after which a tensor-parallel MoE-family block calls a collective: the attention's output projection and a
#: SwiGLU's down projection (dense, or the shared experts') forward; their first column-parallel inputs' gradients
#: backward (grouped-query q, latent attention's query up-projection, the gate).
MOE_COLLECTIVE_AFTER = frozenset({"wo", "w2", "shared_w2", "wq_wgrad", "q_up_wgrad", "w1_wgrad", "shared_w1_wgrad"})

#: Bytes of a router score (fp32), an expert index (int64).
_SCORE, _INDEX = 4, 8
#: FLOPs per value of the router's softmax or sigmoid and top-k, of GPT-OSS's clamped SwiGLU beyond the plain one.
_ROUTER_FLOPS, _CLAMP_FLOPS = 6, 3


class MoeBlockShape:
    """One MoE-family block on one device: the attention's shape (a :class:`LlamaBlockShape`: heads of this tensor-
    parallel rank, the local sequence), latent attention's sizes (``mla``, None for grouped-query attention), and the
    feed-forward: a dense SwiGLU of ``attention.ffn`` (``mixture`` None) or the ``mixture``, whose tokens are the
    ``norm_tokens`` this rank routes (1/t of the sequence under tensor parallelism, which a mixture requires to be
    sequence parallel)."""

    def __init__(self, attention: LlamaBlockShape, mla: MlaPart | None, mixture: MixturePart | None, *,
                 mtp: bool = False) -> None:
        if mixture is not None and attention.t > 1 and attention.norm_tokens == attention.tokens:
            raise SpecError("a mixture under tensor parallelism needs sequence parallelism")
        self.attention, self.mla, self.mixture, self.mtp = attention, mla, mixture, mtp
        self.tokens = attention.norm_tokens  # what enters the router on this device


def moe_block_kernels(shape: MoeBlockShape, *, backward: bool, dtype_bytes: int = 2, narrow: Narrow | None = None,
                      compiled: bool = False, recomputed: tuple[str, ...] = ()) -> tuple[Kernel, ...]:
    """One block's kernels on one device, in execution order (module docstring); ``narrow``: the attention's and
    the experts' linears on low-precision operands (the router stays in the training dtype, as Transformer Engine
    keeps it); ``recomputed``: the backward starts by re-running what selective recomputation of these modules
    dropped (:func:`selective_recompute_kernels`; empty: nothing)."""
    db, a = dtype_bytes, shape.attention
    if not backward:
        attention = (_mla_forward(shape, db, narrow, compiled) if shape.mla else
                     attention_forward(a, db, narrow, compiled))
        ffn = [*norm_kernels("ffn_norm", a.norm_tokens, a.h, db, compiled=compiled, residual=True),
               *(_mixture_forward(shape, db, narrow, compiled) if shape.mixture else
                 swiglu_forward("", a.tokens, a.h, a.ffn, db, narrow, compiled)),
               add_kernel("ffn_residual_add", a.norm_tokens * a.h, db)]
        return tuple(_mtp_input(shape, db, narrow, compiled, backward=False) + attention + ffn)
    norm_inputs = 2 if not shape.mixture else 2 + 2 * bool(shape.mixture.shared_ffn)  # linears the norm feeds
    ffn = (_mixture_backward(shape, db, narrow, compiled) if shape.mixture else
           swiglu_backward("", a.tokens, a.h, a.ffn, db, narrow, compiled))
    attention = _mla_backward(shape, db, narrow, compiled) if shape.mla else attention_backward(a, db, narrow, compiled)
    recompute = selective_recompute_kernels(shape, db, narrow, compiled, recomputed) if recomputed else []
    return tuple([*recompute, *ffn, *norm_backward("ffn_norm", a, db, compiled, norm_inputs), *attention,
                  *_mtp_input(shape, db, narrow, compiled, backward=True)])


def selective_recompute_kernels(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool,
                                recomputed: tuple[str, ...] = RECOMPUTE_MODULES) -> list[Kernel]:
    """What Megatron-Core's output-discarding recomputation of the ``recomputed`` modules
    (:mod:`sim.models.recompute_modules`) re-runs before a block's backward: ``layernorm`` the two block norms,
    ``moe_act`` the routed experts' SwiGLU, ``mla_up_proj`` latent attention's up-projections with the rotary
    embedding and the query/key assembly; each kernel as the forward runs it, named ``recompute_...``."""
    a, m = shape.attention, shape.mixture
    kernels = []
    if "layernorm" in recomputed:
        kernels += [*norm_kernels("attention_norm", a.norm_tokens, a.h, db, compiled=compiled),
                    *norm_kernels("ffn_norm", a.norm_tokens, a.h, db, compiled=compiled)]
    if m is not None and "moe_act" in recomputed:
        received = sum(m.expert_tokens(shape.tokens))
        kernels += _expert_activation(received * (m.expert_ffn // m.etp), db, m.swiglu_clamp, backward=False,
                                      compiled=compiled)
    if shape.mla is not None and "mla_up_proj" in recomputed:
        ups = ("q_up", "kv_up", "mla_query_rope", "mla_key_assemble")
        kernels += [k for k in _mla_forward(shape, db, narrow, compiled) if k.name.startswith(ups)]
    return [replace(k, name="recompute_" + k.name) for k in kernels]


def _mtp_input(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool, *,
               backward: bool) -> list[Kernel]:
    """The multi-token-prediction module's input before its block (DeepSeek-V3, arXiv 2412.19437 §2.2: h' =
    M·[RMSNorm(h); RMSNorm(Emb(t_next))]): the two norms, their concatenation and the 2h → h projection (split by the
    tensor-parallel ranks like a column-parallel linear); nothing for another block."""
    if not shape.mtp:
        return []
    a = shape.attention
    tokens, h = a.tokens, a.h
    projection = linear_kernels("mtp_eh_proj", tokens, 2 * h, h // a.t, db, backward, False, bias_grad=False,
                                narrow=narrow, compiled=compiled)
    concat = mem("mtp_concat" + "_bwd" * backward, "elementwise", 2 * tokens * h, 0, 4 * tokens * h * db)
    if not backward:
        return [*norm_kernels("mtp_hnorm", a.norm_tokens, h, db, compiled=compiled),
                *norm_kernels("mtp_enorm", a.norm_tokens, h, db, compiled=compiled), concat, *projection]
    return [*projection, concat,
            *norm_backward_kernels("mtp_hnorm", a.norm_tokens, h, db, compiled=compiled, skip=False),
            *norm_backward_kernels("mtp_enorm", a.norm_tokens, h, db, compiled=compiled, skip=False)]


def expert_all_to_alls(mixture: MixturePart | None) -> int:
    """All-to-alls one pass of a block launches: dispatch and combine under expert parallelism, else none."""
    return 2 if mixture is not None and mixture.ep * mixture.etp > 1 else 0


def _mixture_forward(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    m = shape.mixture
    assert m is not None
    t, h, k, experts = shape.tokens, shape.attention.h, m.topk, m.experts
    rows = m.expert_tokens(t)
    received, width = sum(rows), m.expert_ffn // m.etp
    kernels = [gemm("router", t, experts, h, db),
               mem("router_topk", "softmax", t * experts, _ROUTER_FLOPS,
                   t * experts * (db + _SCORE) + t * k * (_SCORE + _INDEX)),
               mem("moe_permute", "elementwise", t * k * h, 0, (t * h + t * k * h) * db + t * k * _INDEX)]
    if m.ep * m.etp > 1:  # the received tokens, grouped by source, sorted into local expert order
        kernels.append(mem("moe_sort_chunks", "elementwise", received * h, 0, 2 * received * h * db))
    kernels += _grouped_linear("experts_fc1", rows, h, 2 * width, db, narrow, backward=False)
    kernels += _expert_activation(received * width, db, m.swiglu_clamp, backward=False, compiled=compiled)
    kernels += _grouped_linear("experts_fc2", rows, width, h, db, narrow, backward=False)
    if m.ep * m.etp > 1:
        kernels.append(mem("moe_unsort_chunks", "elementwise", received * h, 0, 2 * received * h * db))
    kernels.append(mem("moe_unpermute", "elementwise", t * k * h, 2, (t * k * h + t * h) * db + t * k * _SCORE))
    if m.shared_ffn:
        tokens = shape.attention.tokens  # the shared experts are tensor-parallel: every token, 1/t of the width
        kernels += swiglu_forward("shared_", tokens, h, m.shared_ffn // shape.attention.t, db, narrow, compiled)
        kernels.append(add_kernel("shared_add", t * h, db))
    return kernels


def _mixture_backward(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    m = shape.mixture
    assert m is not None
    t, h, k, experts = shape.tokens, shape.attention.h, m.topk, m.experts
    rows = m.expert_tokens(t)
    received, width = sum(rows), m.expert_ffn // m.etp
    kernels: list[Kernel] = []
    if m.shared_ffn:
        kernels += swiglu_backward("shared_", shape.attention.tokens, h, m.shared_ffn // shape.attention.t, db, narrow,
                                   compiled)
    # the un-permutation's backward: each copy's gradient (the token's, times its score) and each score's gradient
    # (the copy's output · the token's gradient)
    kernels.append(mem("moe_unpermute_bwd", "elementwise", t * k * h, 3,
                       (t * h + 2 * t * k * h) * db + 2 * t * k * _SCORE))
    if m.ep * m.etp > 1:
        kernels.append(mem("moe_unsort_chunks_bwd", "elementwise", received * h, 0, 2 * received * h * db))
    kernels += _grouped_linear("experts_fc2", rows, width, h, db, narrow, backward=True)
    kernels += _expert_activation(received * width, db, m.swiglu_clamp, backward=True, compiled=compiled)
    kernels += _grouped_linear("experts_fc1", rows, h, 2 * width, db, narrow, backward=True)
    if m.ep * m.etp > 1:
        kernels.append(mem("moe_sort_chunks_bwd", "elementwise", received * h, 0, 2 * received * h * db))
    kernels += [mem("moe_permute_bwd", "elementwise", t * k * h, ADD_FLOPS, (t * k * h + t * h) * db + t * k * _INDEX),
                mem("router_topk_bwd", "softmax", t * experts, _ROUTER_FLOPS,
                    t * experts * (_SCORE + db) + t * k * (_SCORE + _INDEX)),
                gemm("router_dgrad", t, h, experts, db), gemm("router_wgrad", h, experts, t, db)]
    return kernels


def _grouped_linear(name: str, rows: tuple[int, ...], n_in: int, n_out: int, db: int, narrow: Narrow | None, *,
                    backward: bool) -> list[Kernel]:
    """The experts' linear as grouped GEMMs over ``rows`` tokens per expert: forward Y_e = X_e·W_e; backward the
    input gradients dX_e = dY_e·W_eᵀ then the weight gradients dW_e = X_eᵀ·dY_e (K the expert's tokens: an expert
    with no tokens writes a zero gradient, not costed). ``narrow``: each operand cast first, as a linear's are
    (:func:`sim.cost.kernels.block.linear_kernels`; Transformer Engine quantizes a grouped linear's inputs and
    weights in both orders at once)."""
    total, experts = sum(rows), sum(1 for r in rows if r)
    sizes = {"input": total * n_in, "weight": experts * n_in * n_out, "grad": total * n_out}
    if narrow is not None and narrow.rowwise:  # two passes per operand, as a dense linear's (rowwise_cast_kernels)
        roles = ("input", "weight") if not backward else ("weight", "grad")
        casts = [kernel for role in roles for kernel in rowwise_cast_kernels(name, role, sizes[role], db, backward)]
    elif not backward:
        casts = [cast_kernel(name + "_cast_input", sizes["input"], db, narrow, True),
                 cast_kernel(name + "_cast_weight", sizes["weight"], db, narrow, True)] if narrow else []
    else:
        casts = [cast_kernel(name + "_cast_grad", sizes["grad"], db, narrow, True)] if narrow else []
    if not backward:
        return [*casts, grouped_gemm(name, rows, n_out, n_in, db, narrow=narrow)]
    return [*casts, grouped_gemm(name + "_dgrad", rows, n_in, n_out, db, narrow=narrow),
            *_weight_grads(name, rows, n_in, n_out, db, narrow)]


def _weight_grads(name: str, rows: tuple[int, ...], n_in: int, n_out: int, db: int,
                  narrow: Narrow | None) -> list[Kernel]:
    """The grouped weight gradient: for each expert with tokens an (n_in × n_out) product over its M_e tokens, one
    launch; every expert's output tile count is the same, so the launch is costed as one batch of the experts'
    products at their mean K (the FLOPs and bytes summed exactly)."""
    active = [r for r in rows if r]
    if not active:
        return []
    flops = sum(2.0 * n_in * n_out * r for r in active)
    operands = sum(n_in * r + r * n_out for r in active)
    nbytes = (narrow.stored_bytes(operands) if narrow else operands * db) + len(active) * n_in * n_out * db
    mean_k = max(1, round(sum(active) / len(active)))
    return [Kernel(name + "_wgrad", "gemm", flops, float(nbytes), (n_in, n_out, mean_k), len(active), narrow)]


def _expert_activation(values: int, db: int, clamp: int, *, backward: bool, compiled: bool) -> list[Kernel]:
    """The experts' SwiGLU over ``values`` outputs (its gate and up halves read from the fused fc1 output), with
    GPT-OSS's clamps where ``clamp``; eager as a Llama block's SwiGLU, compiled one kernel each way."""
    kernels = swiglu_kernels(values, db, backward=backward, compiled=compiled)
    if clamp:  # the clamps of gate and up and the +1 (one more pass over the values each way, eagerly)
        kernels = [*kernels, mem("swiglu_clamp" + "_bwd" * backward, "elementwise", values, _CLAMP_FLOPS,
                                 (3 if backward else 2) * values * db)] if not compiled else kernels
    return [Kernel("experts_" + k.name, k.kind, k.flops, k.bytes) for k in kernels]


def _mla_forward(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    a, mla = shape.attention, shape.mla
    assert mla is not None
    tokens, h, heads = a.tokens, a.h, a.q_heads
    nope, rope, v = a.d - mla.rope_dim, mla.rope_dim, a.dv

    def linear(name: str, n_in: int, n_out: int) -> list[Kernel]:
        return linear_kernels(name, tokens, n_in, n_out, db, False, False, bias_grad=False, narrow=narrow,
                              compiled=compiled)

    query = ([*linear("q_down", h, mla.q_lora), *norm_kernels("q_norm", tokens, mla.q_lora, db, compiled=compiled),
              *linear("q_up", mla.q_lora, heads * a.d)] if mla.q_lora else linear("q_up", h, heads * a.d))
    return [
        *norm_kernels("attention_norm", a.norm_tokens, h, db, compiled=compiled),
        *query,
        *linear("kv_down", h, mla.kv_lora + rope),
        *norm_kernels("kv_norm", tokens, mla.kv_lora, db, compiled=compiled),
        *linear("kv_up", mla.kv_lora, heads * (nope + v)),
        # the rotary parts rotated and every head's query and key assembled (its key's rotary part shared)
        mem("mla_query_rope", "elementwise", tokens * heads * a.d, 3, 2 * tokens * heads * a.d * db),
        mem("mla_key_assemble", "elementwise", tokens * heads * a.d, 3,
            (tokens * heads * nope + tokens * rope + tokens * heads * a.d) * db),
        *flash_attention_kernels(a, db, False),
        *linear_kernels("wo", tokens, heads * v, h, db, False, False, bias_grad=False, narrow=narrow,
                        compiled=compiled),
    ]


def _mla_backward(shape: MoeBlockShape, db: int, narrow: Narrow | None, compiled: bool) -> list[Kernel]:
    a, mla = shape.attention, shape.mla
    assert mla is not None
    tokens, h, heads = a.tokens, a.h, a.q_heads
    nope, rope, v = a.d - mla.rope_dim, mla.rope_dim, a.dv

    def linear(name: str, n_in: int, n_out: int) -> list[Kernel]:
        return linear_kernels(name, tokens, n_in, n_out, db, True, False, bias_grad=False, narrow=narrow,
                              compiled=compiled)

    query = ([*linear("q_up", mla.q_lora, heads * a.d),
              *norm_backward_kernels("q_norm", tokens, mla.q_lora, db, compiled=compiled, skip=False),
              *linear("q_down", h, mla.q_lora)] if mla.q_lora else linear("q_up", h, heads * a.d))
    return [
        *linear("wo", heads * v, h),
        *flash_attention_kernels(a, db, True),
        mem("mla_key_assemble_bwd", "elementwise", tokens * heads * a.d, 3,
            (tokens * heads * a.d + tokens * heads * nope + tokens * rope) * db),
        mem("mla_query_rope_bwd", "elementwise", tokens * heads * a.d, 3, 2 * tokens * heads * a.d * db),
        *linear("kv_up", mla.kv_lora, heads * (nope + v)),
        *norm_backward_kernels("kv_norm", tokens, mla.kv_lora, db, compiled=compiled, skip=False),
        *linear("kv_down", h, mla.kv_lora + rope),
        *query,
        *norm_backward("attention_norm", a, db, compiled, 2),  # the query's and the key/value's first linears
    ]
