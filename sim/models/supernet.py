"""``supernet``: a NASPipe-style weight-sharing supernet: embedding, B choice blocks of K candidate ops, LM head.

NASPipe (Zhao et al., ASPLOS'22; ../shared/reference/hardware.md §4.1, schedules.md §7) trains a supernet whose
every choice block holds a ``ModuleList`` of candidate ops; a *subnet* picks one candidate per block, and subnets
that pick the same candidate share its weights. The whole supernet lives in host memory; a GPU holds only the
candidates its running subnets use (DESIGN §3, "NASPipe CSP in the IR").

Layers, in order: ``embed`` (token + learned position embeddings, like ``gpt``), ``block0 .. block{B-1}`` (choice
blocks), ``head`` (final LayerNorm, LM head Linear without bias, next-token cross-entropy, like ``gpt``). Training is
fp16 (``dtype_bytes = 2``), no dropout.

Candidates. Candidate k of every block has kind ``KIND_CYCLE[k % 16]``, a fixed mix of sizes and kinds loosely
after NASPipe's fairseq op set (standard conv, depthwise-separable conv, multi-head attention with different head
counts, gated linear units; ``transformer_oneshot.py``), so ``choices=K`` always gives the same first K kinds and
K > 16 repeats the cycle with fresh weights. Every candidate maps (n, s, h) -> (n, s, h) as ``x + f(LN(x))``
(pre-LayerNorm, residual) except ``identity`` (``x``, no parameters). Convolutions and attention are causal, as
the head is a next-token language model. Notation: s = sequence length, h = hidden size, a = heads of the
candidate, V = vocabulary size.

Exact parameter counts (the executor's torch modules are checked against them):

===========  ==================================================  =======================
kind         modules after LN (2h)                               parameters
===========  ==================================================  =======================
conv{k}      Conv1d(h, h, k) + bias, ReLU                        k*h^2 + 3h
dwconv{k}    depthwise Conv1d(h, h, k, groups=h) + bias,         h^2 + (k + 4)h
             pointwise Linear(h, h), ReLU
attn         QKV Linear(h, 3h), out Linear(h, h), ``heads``      4h^2 + 6h
attn_few     same with the largest proper divisor of ``heads``   4h^2 + 6h
ffn{m}       Linear(h, m*h), GELU, Linear(m*h, h)                2m*h^2 + (m + 3)h
glu{m}       Linear(h, 2m*h), GLU (Dauphin et al. 2017),         3m*h^2 + (2m + 3)h
             Linear(m*h, h)
identity     nothing (no LayerNorm either)                       0
===========  ==================================================  =======================

Per-candidate costs per sample (b = 1), forward FLOPs counting matmuls and convolutions only, 2 FLOPs per
multiply-add, zero padding counted as data (as ``cnn``); elementwise ops are not counted (as ``gpt``). Backward is
2x forward (input and weight gradients). ``saved_bytes`` (fp16, the output included, the input excluded: the
convention of :mod:`sim.models.graph`) counts what autograd keeps: the LN output (or its padded copy) that the first
matmul/conv reads, every intermediate a later op's backward reads, and the output; the k - 1 padding rows are not
counted. Attention is Korthikanti et al. 2022 (arXiv 2205.05198) §4.1 without dropout: LN out, Q, K, V, the
a*s^2 softmax, the context and the output.

===========  ============================  =========================
kind         forward FLOPs                 saved bytes
===========  ============================  =========================
conv{k}      2k*s*h^2                      6sh (LN out, ReLU out, output)
dwconv{k}    2k*s*h + 2s*h^2               8sh (+ depthwise out)
attn(_few)   8s*h^2 + 4s^2*h               12sh + 2a*s^2
ffn{m}       4m*s*h^2                      (4 + 4m)sh
glu{m}       6m*s*h^2                      (4 + 6m)sh
identity     0                             0
===========  ============================  =========================

The graph. A :class:`LayerGraph` has one Layer per choice block (kind ``"choice"``) whose numbers describe the
*supernet*: ``param_bytes`` is the sum over its K candidates (what host memory holds), while ``flops_fwd``,
``flops_bwd`` and ``saved_bytes`` are the mean over candidates (the expected cost of a uniformly sampled subnet;
``saved_bytes`` rounded up to an int). ``activation_bytes`` is 2sh for every candidate. A cost model of one subnet
takes :func:`subnet_layer_costs`, which swaps in the chosen candidate's own numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from sim.core.errors import SpecError
from sim.core.spec import SpecParams, parse_spec
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = [
    "NAME", "DESCRIPTION", "DEFAULTS", "KIND_CYCLE", "KIND_SHAPES", "CandidateOp", "Supernet", "build",
    "build_supernet", "candidate_kinds", "candidate_heads", "candidate_params", "candidate_flops_fwd",
    "candidate_saved_bytes", "subnet_layer_costs",
]

NAME = "supernet"
DESCRIPTION = "NASPipe supernet: embed, B choice blocks of K candidate ops (conv, attn, FFN, GLU, skip), LM head, fp16"
DEFAULTS: dict[str, int | float] = {
    "blocks": 12,  # choice blocks
    "choices": 4,  # candidates per block, kinds from KIND_CYCLE
    "hidden": 256,
    "heads": 4,  # heads of the 'attn' candidates; 'attn_few' uses its largest proper divisor
    "seq": 64,
    "vocab": 1000,
}

DTYPE_BYTES = 2  # fp16 weights and activations, as gpt
TOKEN_ID_BYTES = 8  # int64 token ids

# The fixed cycle of candidate kinds. The first four already mix a conv, attention, a gated MLP and a skip; the
# first eight add two convs, a narrow MLP and attention with fewer heads; all sixteen add the remaining sizes.
KIND_CYCLE: tuple[str, ...] = (
    "conv3", "attn", "glu4", "identity",
    "conv5", "dwconv3", "ffn2", "attn_few",
    "conv7", "dwconv7", "ffn4", "conv1",
    "glu2", "dwconv5", "dwconv11", "dwconv9",
)

# kind -> (family, size): size is the kernel of conv/dwconv, the width multiplier of ffn/glu, 0 otherwise.
KIND_SHAPES: Mapping[str, tuple[str, int]] = MappingProxyType(
    {
        "conv1": ("conv", 1), "conv3": ("conv", 3), "conv5": ("conv", 5), "conv7": ("conv", 7),
        "dwconv3": ("dwconv", 3), "dwconv5": ("dwconv", 5), "dwconv7": ("dwconv", 7), "dwconv9": ("dwconv", 9),
        "dwconv11": ("dwconv", 11),
        "attn": ("attn", 0), "attn_few": ("attn", 0),
        "ffn2": ("ffn", 2), "ffn4": ("ffn", 4), "glu2": ("glu", 2), "glu4": ("glu", 4),
        "identity": ("identity", 0),
    }
)
assert set(KIND_SHAPES) == set(KIND_CYCLE)


@dataclass(frozen=True, slots=True)
class CandidateOp:
    """One candidate op of a choice block: its exact parameter count and per-sample costs.

    Attributes:
        kind: an entry of :data:`KIND_CYCLE`, e.g. ``"conv5"``, ``"attn_few"``, ``"identity"``.
        params: exact number of parameters (elements, not bytes).
        flops_fwd: forward FLOPs per sample.
        flops_bwd: backward FLOPs per sample (2x forward).
        activation_bytes: bytes per sample of the output (2sh, fp16).
        saved_bytes: bytes per sample kept for backward, output included, input excluded.
    """

    kind: str
    params: int
    flops_fwd: float
    flops_bwd: float
    activation_bytes: int
    saved_bytes: int


@dataclass(frozen=True)
class Supernet:
    """A supernet: its :class:`LayerGraph` (one Layer per choice block) and the table of candidates per block.

    Attributes:
        graph: ``embed``, ``block0 .. block{B-1}``, ``head``; block b is graph layer ``b + 1``.
        candidates: ``candidates[b][k]`` is candidate k of block b.
    """

    graph: LayerGraph
    candidates: tuple[tuple[CandidateOp, ...], ...]

    def __post_init__(self) -> None:
        if len(self.graph) != len(self.candidates) + 2:
            raise ValueError(
                f"supernet {self.graph.spec!r}: {len(self.graph)} layers but {len(self.candidates)} blocks "
                f"(expected blocks + 2 layers)"
            )

    @property
    def num_blocks(self) -> int:
        """B, the number of choice blocks."""
        return len(self.candidates)

    @property
    def num_choices(self) -> int:
        """K, the number of candidates per block."""
        return len(self.candidates[0])

    @staticmethod
    def block_layer(block: int) -> int:
        """The graph layer index of choice block ``block`` (``block + 1``: layer 0 is the embedding)."""
        return block + 1


def candidate_kinds(num_choices: int) -> tuple[str, ...]:
    """The kinds of candidates ``0 .. num_choices - 1`` of every block: :data:`KIND_CYCLE`, repeated as needed."""
    return tuple(KIND_CYCLE[k % len(KIND_CYCLE)] for k in range(num_choices))


def candidate_heads(kind: str, heads: int) -> int:
    """Attention heads of an ``attn`` / ``attn_few`` candidate given the spec's ``heads``.

    ``attn_few`` uses the largest proper divisor of ``heads`` (half of an even count; 1 for a prime or for 1), which
    always divides ``hidden`` because ``heads`` does.
    """
    if kind == "attn":
        return heads
    if kind == "attn_few":
        return max((d for d in range(1, heads) if heads % d == 0), default=1)
    raise ValueError(f"candidate kind {kind!r} has no attention heads")


def candidate_params(kind: str, h: int) -> int:
    """Exact parameter count of a candidate of ``kind`` at hidden size ``h`` (module docstring table)."""
    family, size = KIND_SHAPES[kind]
    if family == "identity":
        return 0
    ln = 2 * h
    if family == "conv":
        return ln + size * h * h + h
    if family == "dwconv":
        return ln + (size * h + h) + (h * h + h)
    if family == "attn":
        return ln + (3 * h * h + 3 * h) + (h * h + h)
    if family == "ffn":
        return ln + (size * h * h + size * h) + (size * h * h + h)
    assert family == "glu", family
    return ln + (2 * size * h * h + 2 * size * h) + (size * h * h + h)


def candidate_flops_fwd(kind: str, s: int, h: int) -> int:
    """Forward FLOPs per sample of a candidate (module docstring table)."""
    family, size = KIND_SHAPES[kind]
    if family == "identity":
        return 0
    if family == "conv":
        return 2 * size * s * h * h  # each of the s*h outputs is a k*h dot product
    if family == "dwconv":
        return 2 * size * s * h + 2 * s * h * h  # depthwise k taps per output, then a pointwise h x h matmul
    if family == "attn":
        # QKV 6sh^2 + scores 2s^2h + over values 2s^2h + output 2sh^2 (2104.04473 Appendix, as gpt)
        return 8 * s * h * h + 4 * s * s * h
    if family == "ffn":
        return 4 * size * s * h * h  # up h -> mh and down mh -> h
    assert family == "glu", family
    return 6 * size * s * h * h  # up h -> 2mh and down mh -> h


def candidate_saved_bytes(kind: str, s: int, h: int, heads: int) -> int:
    """Bytes per sample a candidate keeps for backward, fp16, output included (module docstring table).

    Args:
        kind: the candidate kind.
        s: sequence length.
        h: hidden size.
        heads: the spec's ``heads`` (the candidate's own head count follows from :func:`candidate_heads`).
    """
    family, size = KIND_SHAPES[kind]
    sh = s * h
    if family == "identity":
        return 0  # creates no tensor: its output is its input, counted by the producer
    if family == "conv":
        return DTYPE_BYTES * 3 * sh  # padded LN out (the conv's input), ReLU out, output
    if family == "dwconv":
        return DTYPE_BYTES * 4 * sh  # padded LN out, depthwise out (pointwise input), ReLU out, output
    if family == "attn":
        a = candidate_heads(kind, heads)
        # LN out, Q, K, V, context, output: 6sh elements, plus the a x s x s softmax (2205.05198 §4.1, no dropout)
        return DTYPE_BYTES * (6 * sh + a * s * s)
    if family == "ffn":
        return DTYPE_BYTES * (2 + 2 * size) * sh  # LN out, up out (GELU input), GELU out, output
    assert family == "glu", family
    return DTYPE_BYTES * (2 + 3 * size) * sh  # LN out, up out (2mh: GLU input), GLU out (mh), output


def _candidate(kind: str, s: int, h: int, heads: int) -> CandidateOp:
    flops = float(candidate_flops_fwd(kind, s, h))
    return CandidateOp(
        kind=kind,
        params=candidate_params(kind, h),
        flops_fwd=flops,
        flops_bwd=2 * flops,
        activation_bytes=DTYPE_BYTES * s * h,
        saved_bytes=candidate_saved_bytes(kind, s, h, heads),
    )


def _build(params: SpecParams) -> Supernet:
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    n_blocks, k, h, a, s, v = (values[key] for key in ("blocks", "choices", "hidden", "heads", "seq", "vocab"))
    spec = canonical_spec(NAME, values)
    if h % a:
        raise SpecError(f"heads ({a}) must divide hidden ({h}), got hidden={h}, heads={a} in {spec!r}")

    kinds = candidate_kinds(k)
    per_block = tuple(_candidate(kind, s, h, a) for kind in kinds)  # identical numbers in every block
    act = DTYPE_BYTES * s * h
    embed = Layer(
        name="embed",
        kind="embedding",
        flops_fwd=0.0,  # a lookup and an add (as gpt)
        flops_bwd=0.0,
        param_bytes=DTYPE_BYTES * (v * h + s * h),
        activation_bytes=act,
        saved_bytes=act,  # the output; no dropout mask
    )
    block_kwargs = {
        "kind": "choice",
        "flops_fwd": sum(c.flops_fwd for c in per_block) / k,
        "flops_bwd": sum(c.flops_bwd for c in per_block) / k,
        "param_bytes": DTYPE_BYTES * sum(c.params for c in per_block),  # the whole supernet block
        "activation_bytes": act,
        "saved_bytes": -(-sum(c.saved_bytes for c in per_block) // k),  # mean, rounded up
    }
    blocks = [Layer(name=f"block{b}", **block_kwargs) for b in range(n_blocks)]  # type: ignore[arg-type]
    head = Layer(
        name="head",
        kind="head",
        flops_fwd=float(2 * s * h * v),  # as gpt's head
        flops_bwd=float(4 * s * h * v),
        param_bytes=DTYPE_BYTES * (2 * h + v * h),
        activation_bytes=4,  # the fp32 loss
        saved_bytes=2 * s * h + 4 * s * v,
        workspace_bytes=DTYPE_BYTES * s * v,
    )
    graph = LayerGraph(spec, [embed, *blocks, head], dtype_bytes=DTYPE_BYTES, input_bytes=TOKEN_ID_BYTES * s)
    return Supernet(graph, (per_block,) * n_blocks)


def build(params: SpecParams) -> LayerGraph:
    """Build the graph of ``supernet:blocks=..,choices=..,hidden=..,heads=..,seq=..,vocab=..``.

    Raises:
        SpecError: a size below 1, heads not dividing hidden, a non-integer value, or an unknown key.
    """
    return _build(params).graph


def build_supernet(spec: str) -> Supernet:
    """The :class:`Supernet` of a ``supernet:...`` spec: its graph and its per-block candidate table.

    Raises:
        SpecError: the spec names another model, or is invalid (see :func:`build`).
    """
    name, raw = parse_spec(spec)
    if name != NAME:
        raise SpecError(f"expected a '{NAME}:...' spec, got model {name!r} in {spec!r}")
    return _build(SpecParams(spec, raw))


def subnet_layer_costs(supernet: Supernet, choice: Sequence[int]) -> tuple[Layer, ...]:
    """The per-layer costs of one subnet: the graph's layers with each block replaced by its chosen candidate.

    Block b becomes ``Layer(name="block{b}", kind=<candidate kind>, ...)`` with the candidate's own FLOPs, parameter
    bytes (``params * dtype_bytes``) and saved bytes; ``embed`` and ``head`` are the graph's.

    Args:
        supernet: from :func:`build_supernet`.
        choice: one candidate index per block, ``0 <= choice[b] < K``.

    Returns:
        ``len(supernet.graph)`` layers in graph order.

    Raises:
        ValueError: ``choice`` has the wrong length or an index out of range; the message names it.
    """
    choice = tuple(choice)
    if len(choice) != supernet.num_blocks:
        raise ValueError(f"subnet {choice!r} has {len(choice)} choices, {supernet.graph.spec!r} has "
                         f"{supernet.num_blocks} blocks")
    k = supernet.num_choices
    for b, c in enumerate(choice):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < k:
            raise ValueError(f"subnet {choice!r}: block {b} choice {c!r} is not an int in [0, {k})")
    graph = supernet.graph
    layers = list(graph.layers)
    for b, c in enumerate(choice):
        cand = supernet.candidates[b][c]
        layers[Supernet.block_layer(b)] = Layer(
            name=f"block{b}",
            kind=cand.kind,
            flops_fwd=cand.flops_fwd,
            flops_bwd=cand.flops_bwd,
            param_bytes=graph.dtype_bytes * cand.params,
            activation_bytes=cand.activation_bytes,
            saved_bytes=cand.saved_bytes,
        )
    return tuple(layers)
