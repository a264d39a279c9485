"""``gpt``: a GPT-2 style decoder-only transformer (pre-LN blocks, learned positions, untied LM head).

Layers, in order: ``embed`` (token + position embeddings, dropout), ``block0 .. block{L-1}`` (pre-LN decoder
blocks), ``head`` (final LayerNorm, LM head Linear without bias, cross-entropy loss). Training is fp16, so
``dtype_bytes = 2`` and activations are 2 bytes per element; dropout masks are 1 byte per element.

Notation (per sample, i.e. microbatch size b = 1): s = sequence length, h = hidden size, a = attention heads,
V = vocabulary size.

Parameter counts are exact for this architecture, because the executor's torch modules are checked against them:

* block = LN1 (2h) + QKV Linear (3h^2 + 3h) + attention output Linear (h^2 + h) + LN2 (2h)
  + MLP up Linear (4h^2 + 4h) + MLP down Linear (4h^2 + h) = 12h^2 + 13h
* embed = token table V*h + position table s*h
* head = final LN (2h) + LM head V*h (no bias, not tied to the token table)

Tensor-parallel shard (:class:`~sim.models.sharding.Sharding`, t = tp; Megatron-LM, arXiv 1909.08053 §3): one
device holds, per block, the column-parallel QKV and MLP-up Linears' weights and biases split by t, the
row-parallel attention-output and MLP-down Linears' weights split by t with their biases replicated, and both
LayerNorms replicated: 12h^2/t + 7h/t + 6h parameters. Attention is split by heads, so t must divide ``heads`` (and
so ``hidden``). The token table and the LM head are vocabulary-parallel (V padded to a multiple of t,
:func:`~sim.models.sharding.padded_vocab`); the position table and the final LayerNorm are replicated. Collectives
per sample (all-reduce equivalents, ``Layer.tp_comm_*``):

* embed: forward all-reduce of the token embeddings (2sh bytes); under sequence parallelism the sum is then split
  along the sequence locally, as Megatron does for learned positions (``scatter_to_sequence_parallel_region``),
  and the backward all-gathers the gradient (half of 2sh).
* block: two all-reduces of 2sh in the forward (after attention and after the MLP) and two in the backward (the
  inputs' gradients of the two column-parallel Linears); under sequence parallelism the all-gather + reduce-scatter
  pairs replacing them. Megatron's sequence-parallel backward also re-gathers each column-parallel Linear's
  sharded input for its weight gradient; it runs concurrently with the input-gradient matmul, and is not counted.
* head: the vocabulary-parallel cross entropy's three forward all-reduces of s fp32 values (max, target logit,
  sum of exponentials); the backward all-reduce of the LM head input's gradient (2sh). Under sequence parallelism
  the LM head's input is all-gathered in the forward (half of 2sh) and its gradient reduce-scattered instead.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.graph import LayerGraph, TransformerPart, canonical_spec
from sim.models.loss import loss_bytes
from sim.models.sharding import (
    NO_SHARDING,
    Collectives,
    Sharding,
    all_reduce,
    collective_layer,
    lone_gather_or_scatter,
    padded_vocab,
)

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "build", "block_params", "block_flops_fwd", "block_saved_bytes",
           "block_shard_params", "block_replicated_params", "block_shard_saved_bytes"]

NAME = "gpt"
DESCRIPTION = "GPT-2 style decoder (pre-LN blocks, learned positions, untied LM head), fp16; defaults = GPT-2 medium"
DEFAULTS: dict[str, int | float] = {
    "layers": 24,  # GPT-2 medium (345M class)
    "hidden": 1024,
    "heads": 16,
    "seq": 1024,
    "vocab": 50257,  # GPT-2 BPE vocabulary
}

DTYPE_BYTES = 2  # fp16 weights and activations
TOKEN_ID_BYTES = 8  # int64 token ids, as torch.nn.Embedding takes them


def block_params(h: int) -> int:
    """Exact parameter count of one pre-LN decoder block with biases: 12h^2 + 13h."""
    return 12 * h * h + 13 * h


def block_flops_fwd(s: int, h: int) -> int:
    """Forward FLOPs of one decoder block per sample.

    Narayanan et al., SC'21, arXiv 2104.04473, Appendix "Floating-point operations": QKV 6sh^2, scores QK^T 2s^2h,
    attention over values 2s^2h, output projection 2sh^2, MLP 16sh^2, i.e. 24sh^2 + 4s^2h (b = 1). Elementwise
    ops (LayerNorm, softmax, GeLU, dropout, residual adds) are not counted, as in the paper.
    """
    return 24 * s * h * h + 4 * s * s * h


def block_saved_bytes(s: int, h: int, a: int) -> int:
    """Bytes one decoder block keeps for backward per sample, fp16, no recomputation: s*h*(34 + 5*a*s/h).

    Korthikanti et al. 2022, arXiv 2205.05198, §4.1, Eq. (1) with b = 1, t = 1: 11sh + 5as^2 for attention,
    19sh for the MLP, 4sh for the two LayerNorms. The paper counts the block's input (2sh, kept by LN1); under
    sim.models.graph's convention the block counts its output instead, which its consumer keeps: the same 2sh bytes.
    """
    return 34 * s * h + 5 * a * s * s


def block_replicated_params(h: int) -> int:
    """Parameters of a block that every tensor-parallel shard holds whole: the attention-output and MLP-down
    biases (row-parallel Linears add them after the all-reduce) and both LayerNorms' weights and biases: 6h."""
    return h + h + 2 * h + 2 * h


def block_shard_params(h: int, t: int) -> int:
    """Exact parameter count of one block's shard at tensor-parallel degree ``t`` (t divides h): the QKV
    (3h^2 + 3h) and MLP-up (4h^2 + 4h) Linears split by t, the attention-output and MLP-down weights (h^2, 4h^2)
    split by t, the rest replicated: 12h^2/t + 7h/t + 6h."""
    return (12 * h * h + 7 * h) // t + block_replicated_params(h)


def block_shard_saved_bytes(s: int, h: int, a: int, sharding: Sharding) -> int:
    """Bytes one block's shard keeps for backward per sample: Korthikanti et al. 2022 Table 2, b = 1.

    The 5as^2 of the attention core (softmax output 2as^2, its dropout mask as^2, the dropout output 2as^2) is
    split by heads over t, and dropped under selective recomputation. Of the rest (§4.1), 24sh is inside the
    tensor-parallel regions and split by t: Q and K 4sh, V 2sh, attention-output input 2sh, GeLU input 8sh,
    MLP-down input 8sh. The other 10sh is outside them, replicated, or split by t under sequence parallelism: the
    two LayerNorm inputs 4sh (LN1's input is the previous layer's output; by sim.models.graph's convention this
    block counts its own output instead, the same size), the QKV and MLP-up inputs 4sh (stored sharded under
    sequence parallelism and re-gathered in the backward, §4.2.2) and the two dropout masks 2sh.
    """
    t, ts = sharding.tp, sharding.sequence_shards
    attention_core = 0 if sharding.selective_recompute else 5 * a * s * s // t
    return 10 * s * h // ts + 24 * s * h // t + attention_core


def build(params: SpecParams, sharding: Sharding = NO_SHARDING) -> LayerGraph:
    """Build ``gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..``, or the shard of it one device holds.

    Args:
        params: the spec's keys.
        sharding: the tensor-parallel shard to build (module docstring); the default is the whole model, and the
            graph's ``spec`` is the model's canonical spec either way.

    Raises:
        SpecError: a size below 1, heads not dividing hidden, a non-integer value, an unknown key; ``tp`` not
            dividing ``heads``; under sequence parallelism, ``tp`` not dividing ``seq``.
    """
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    n_layers, h, a, s, v = (values[k] for k in ("layers", "hidden", "heads", "seq", "vocab"))
    spec = canonical_spec(NAME, values)
    if h % a:
        raise SpecError(f"heads ({a}) must divide hidden ({h}), got hidden={h}, heads={a} in {spec!r}")
    t, ts = sharding.tp, sharding.sequence_shards
    # t | heads implies t | hidden (heads divides hidden), so every split below is exact.
    if a % t:
        raise SpecError(f"tensor parallelism splits attention heads: tp={t} must divide heads={a} in {spec!r}")
    if s % ts:
        raise SpecError(f"sequence parallelism splits the sequence: tp={t} must divide seq={s} in {spec!r}")
    vt = padded_vocab(v, t) // t  # vocabulary rows per shard
    loss = loss_bytes(sharding.loss, s, vt, vocab_parallel=t > 1)
    dims = dict(seq=s, hidden=h, heads=a, vocab=vt * t, tp=t, sequence_parallel=sharding.sequence_parallel)

    full = DTYPE_BYTES * s * h  # one fp16 s x h tensor (Megatron §2.2: b*s*h)
    act = full // ts  # what crosses every stage boundary: the whole tensor, or this shard's s/t of it
    none = Collectives()
    embed_fwd = all_reduce(full) if t > 1 else none  # VocabParallelEmbedding sums the shards' lookups
    embed_bwd = lone_gather_or_scatter(full) if ts > 1 else none  # gradient of the local sequence split
    embed = collective_layer(
        name="embed",
        kind="embedding",
        # A table lookup plus one add: no matmul FLOPs; the standard count (2104.04473 Appendix) ignores it.
        flops_fwd=0.0,
        flops_bwd=0.0,
        param_bytes=DTYPE_BYTES * (vt * h + s * h),
        activation_bytes=act,
        # Output 2sh plus the embedding-dropout mask sh (2205.05198 §4.3, "input embeddings dropout"), both s/t long
        # under sequence parallelism.
        saved_bytes=act + s * h // ts,
        fwd=embed_fwd,
        bwd=embed_bwd,
        transformer=TransformerPart("embedding", **dims),
    )
    flops = block_flops_fwd(s, h) // t
    block_comm = all_reduce(full, times=2) if t > 1 else none
    block_kwargs = {
        "kind": "decoder",
        "flops_fwd": float(flops),
        "flops_bwd": float(2 * flops),  # input + weight gradients: 2x forward (2104.04473 App.)
        "param_bytes": DTYPE_BYTES * block_shard_params(h, t),
        "activation_bytes": act,
        "saved_bytes": block_shard_saved_bytes(s, h, a, sharding),
        # Without recomputation every intermediate the block materialises is already in saved_bytes; with selective
        # recomputation the attention core's 5as^2/t bytes exist again while the backward runs.
        "workspace_bytes": 5 * a * s * s // t if sharding.selective_recompute else 0,
        # Re-run QK^T and attention over V (2s^2h each, split by heads); softmax and dropout are elementwise and, as
        # in the FLOP count above, not counted.
        "recompute_flops": float(4 * s * s * h // t) if sharding.selective_recompute else 0.0,
        "fwd": block_comm,
        "bwd": block_comm,
        "transformer": TransformerPart("block", **dims),
    }
    blocks = [collective_layer(name=f"block{i}", **block_kwargs) for i in range(n_layers)]  # type: ignore[arg-type]
    head_fwd = all_reduce(4 * s, times=3) if t > 1 else none  # vocab-parallel cross entropy, fp32 per token
    head_bwd = none
    if ts > 1:
        head_fwd += lone_gather_or_scatter(full)  # gather the s/t-long LM head input
        head_bwd = lone_gather_or_scatter(full)  # reduce-scatter its gradient
    elif t > 1:
        head_bwd = all_reduce(full)  # sum the shards' gradients of the replicated LM head input
    head = collective_layer(
        name="head",
        kind="head",
        # LM head: 2shV forward, 4shV backward (2104.04473 Appendix: logit layer 6BshV for fwd + bwd), V/t columns
        # per shard; the final LayerNorm and the loss are elementwise and not counted.
        flops_fwd=float(2 * s * h * vt),
        flops_bwd=float(4 * s * h * vt),
        param_bytes=DTYPE_BYTES * (2 * h + vt * h),
        activation_bytes=4,  # the fp32 loss; nothing leaves the last layer
        # Final-LN output (the LM head's input, 2sh; kept s/t long under sequence parallelism) + what the cross
        # entropy over this shard's logits keeps (sim.models.loss; the default, Megatron's fused loss, keeps the fp32
        # logits 4sV/t): 2205.05198 §4.3 counts 4sh + 4sV for the output layer, of which the LN input 2sh is the last
        # block's output, counted there.
        saved_bytes=act + loss.saved,
        workspace_bytes=loss.forward_transient,  # the default's: the fp16 logits before the cast to fp32
        backward_workspace_bytes=loss.backward_transient,
        fwd=head_fwd,
        bwd=head_bwd,
        transformer=TransformerPart("head", **dims),
    )
    return LayerGraph(spec, [embed, *blocks, head], dtype_bytes=DTYPE_BYTES, input_bytes=TOKEN_ID_BYTES * s)
