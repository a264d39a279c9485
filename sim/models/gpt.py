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
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "build", "block_params", "block_flops_fwd", "block_saved_bytes"]

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


def build(params: SpecParams) -> LayerGraph:
    """Build ``gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..``.

    Raises:
        SpecError: a size below 1, heads not dividing hidden, a non-integer value, or an unknown key.
    """
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    n_layers, h, a, s, v = (values[k] for k in ("layers", "hidden", "heads", "seq", "vocab"))
    spec = canonical_spec(NAME, values)
    if h % a:
        raise SpecError(f"heads ({a}) must divide hidden ({h}), got hidden={h}, heads={a} in {spec!r}")

    act = DTYPE_BYTES * s * h  # one fp16 s x h tensor: what crosses every stage boundary (Megatron §2.2: b*s*h)
    embed = Layer(
        name="embed",
        kind="embedding",
        # A table lookup plus one add: no matmul FLOPs; the standard count (2104.04473 Appendix) ignores it.
        flops_fwd=0.0,
        flops_bwd=0.0,
        param_bytes=DTYPE_BYTES * (v * h + s * h),
        activation_bytes=act,
        # Output 2sh plus the embedding-dropout mask sh (2205.05198 §4.3, "input embeddings dropout").
        saved_bytes=act + s * h,
    )
    block_kwargs = {
        "kind": "decoder",
        "flops_fwd": float(block_flops_fwd(s, h)),
        "flops_bwd": float(2 * block_flops_fwd(s, h)),  # input + weight gradients: 2x forward (2104.04473 App.)
        "param_bytes": DTYPE_BYTES * block_params(h),
        "activation_bytes": act,
        "saved_bytes": block_saved_bytes(s, h, a),
        # Without recomputation every intermediate the block materialises is already in saved_bytes.
        "workspace_bytes": 0,
    }
    blocks = [Layer(name=f"block{i}", **block_kwargs) for i in range(n_layers)]  # type: ignore[arg-type]
    head = Layer(
        name="head",
        kind="head",
        # LM head: 2shV forward, 4shV backward (2104.04473 Appendix: logit layer 6BshV for fwd + bwd);
        # the final LayerNorm and the loss are elementwise and not counted.
        flops_fwd=float(2 * s * h * v),
        flops_bwd=float(4 * s * h * v),
        param_bytes=DTYPE_BYTES * (2 * h + v * h),
        activation_bytes=4,  # the fp32 loss; nothing leaves the last layer
        # Final-LN output (the LM head's input, 2sh) + fp32 logits kept by cross-entropy (4sV): 2205.05198 §4.3
        # counts 4sh + 4sV for the output layer, of which the LN input 2sh is the last block's output, counted there.
        saved_bytes=2 * s * h + 4 * s * v,
        workspace_bytes=DTYPE_BYTES * s * v,  # fp16 logits before the cast to fp32 for the loss
    )
    return LayerGraph(spec, [embed, *blocks, head], dtype_bytes=DTYPE_BYTES, input_bytes=TOKEN_ID_BYTES * s)
