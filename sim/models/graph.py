"""The cost model of a network: a DAG of layers with FLOPs, parameter and activation bytes (DESIGN §5).

A :class:`LayerGraph` is what every planner, schedule and the SimPy engine see of a model. It is built from a
compact model spec by :func:`sim.models.build_model` (or from a measured profile) and carries the canonical spec it
came from, so the executor can rebuild the very same network in torch.

Memory convention (so that stage sums neither miss nor double-count a tensor):

* ``Layer.saved_bytes`` counts the tensors a layer *creates* and that stay alive until backward, its own output
  included (its consumer needs it for its weight gradient), but never the layer's input: that tensor was created,
  and is counted, by the producing layer.
* A pipeline stage holding layers ``[lo, hi)`` therefore keeps, per in-flight sample,
  ``sum(saved_bytes) + received`` where ``received`` is ``input_bytes`` for the first stage and
  ``boundary_bytes(lo)`` for the others (the copy of the previous stage's output that arrived over the link).

All sizes are per sample: multiply by the microbatch size for a microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

__all__ = ["Layer", "LayerGraph", "TransformerPart", "MixturePart", "MlaPart", "canonical_spec"]


@dataclass(frozen=True, slots=True)
class MlaPart:
    """Multi-head latent attention's shapes (:mod:`sim.models.moe`): the query bottleneck ``q_lora`` (0: none), the
    key/value latent ``kv_lora``, the shared rotary key ``rope_dim`` and the value head dimension ``v_dim``."""

    q_lora: int
    kv_lora: int
    rope_dim: int
    v_dim: int


@dataclass(frozen=True, slots=True)
class MixturePart:
    """A block's mixture of experts (:mod:`sim.models.moe`), for the kernel model.

    Attributes:
        experts: routed experts E of the whole layer.
        topk: experts each token visits k.
        expert_ffn: each expert's SwiGLU width f_e.
        shared_ffn: the shared experts' SwiGLU width (0: none).
        router_bias: the router's per-expert bias.
        expert_bias: biases on each expert's linears (GPT-OSS).
        sigmoid: sigmoid router scores (DeepSeek-V3) instead of a softmax.
        swiglu_clamp: GPT-OSS's clamped SwiGLU (its limit; 0: the plain SwiGLU).
        ep: expert-parallel degree: the device holds E/ep of the experts.
        etp: expert-tensor-parallel degree: each expert's width split ``etp`` ways.
        shares: of the expert-parallel group's token slots (k per token of the group's ``ep · etp`` devices), the
            share each of this device's E/ep experts computes (:mod:`sim.models.routing`: the slowest rank's, capped
            by the capacity factor); ``()``: balanced, 1/E each.
        loads: the share of the slots each of the ``ep`` expert-parallel ranks receives (capped likewise; what the
            all-to-all's traffic matrix sends to each); ``()``: balanced, 1/ep each.
        groups: group-limited routing's groups of contiguous experts (0: none); ``group_topk`` of them per token.
        group_topk: the groups a token's experts come from (DeepSeek-V3: 4 of 8).
        dispatcher: how the tokens travel (:data:`sim.models.sharding.DISPATCHERS`): ``all-to-all`` (each token copy
            to its expert's rank), ``deduplicated`` (once per server, then inside it) or ``all-gather`` (every token
            to every rank of the group, the outputs reduce-scattered back).
    """

    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    sigmoid: bool = False
    swiglu_clamp: int = 0
    ep: int = 1
    etp: int = 1
    shares: tuple[float, ...] = ()
    loads: tuple[float, ...] = ()
    groups: int = 0
    group_topk: int = 0
    dispatcher: str = "all-to-all"

    @property
    def local_experts(self) -> int:
        """Experts this device holds."""
        return self.experts // self.ep

    def expert_tokens(self, tokens: int) -> tuple[int, ...]:
        """Tokens each of this device's experts computes when each of the group's devices routes ``tokens``
        (rounded to whole tokens)."""
        slots = tokens * self.topk * self.ep * self.etp
        shares = self.shares or (1.0 / self.experts,) * self.local_experts
        return tuple(round(share * slots) for share in shares)


@dataclass(frozen=True, slots=True)
class TransformerPart:
    """What a transformer layer shard is, for a cost model that lists its kernels (:mod:`sim.cost.gpu_time`).

    Attributes:
        part: ``"embedding"``, ``"block"`` or ``"head"``.
        seq, hidden, heads: sequence length, hidden size and attention heads of the whole model.
        vocab: vocabulary rows of the whole model, padded to a multiple of ``tp``.
        tp: tensor-parallel degree of the shard.
        cp: context-parallel degree: the shard holds ``seq / cp`` of each sequence's tokens.
        sequence_parallel: Megatron's sequence parallelism.
        family: ``"gpt"`` (Megatron's GPT block: LayerNorm, fused QKV, 4h GELU MLP, dropout, learned positions),
            ``"llama"`` (RMSNorm, rotary, grouped-query FlashAttention, SwiGLU; :mod:`sim.cost.kernels.llama`) or
            ``"moe"`` (the same with a mixture of experts or latent attention; :mod:`sim.cost.kernels.moe`).
        kv_heads, head_dim, ffn: the llama and moe families' key/value heads, head dimension and (dense) SwiGLU
            width (0 for gpt).
        qkv_bias, qk_norm, window: their q/k/v biases, QK-norm and this layer's sliding window (0: none).
        o_bias, sinks: the moe family's output-projection bias and per-head attention sinks (GPT-OSS).
        mla: the moe family's latent attention, or None for grouped-query attention.
        moe: the block's mixture of experts, or None for a dense block (and for the embedding and the head).
        recomputed: the moe family's block under selective recomputation: the output-discarding modules it re-runs at
            the start of its backward (:mod:`sim.models.recompute_modules`: its norms, experts' SwiGLU, latent
            up-projections); empty: none.
        mtp: the moe family's multi-token prediction: on a block, 1 when it is the MTP module's (its two input norms
            and the 2h → h projection before the block); on the head, the MTP modules whose prediction the shared
            output head scores besides the main one (0: none).
    """

    part: str
    seq: int
    hidden: int
    heads: int
    vocab: int
    tp: int = 1
    sequence_parallel: bool = False
    family: str = "gpt"
    cp: int = 1
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    window: int = 0
    o_bias: bool = False
    sinks: bool = False
    mla: MlaPart | None = None
    moe: MixturePart | None = None
    recomputed: tuple[str, ...] = ()
    mtp: int = 0

    def __post_init__(self) -> None:
        if self.part not in ("embedding", "block", "head"):
            raise ValueError(f"transformer part must be embedding, block or head, got {self.part!r}")
        if self.family not in ("gpt", "llama", "moe"):
            raise ValueError(f"transformer family must be gpt, llama or moe, got {self.family!r}")
        if self.family != "gpt" and min(self.kv_heads, self.head_dim, self.ffn) < 1:
            raise ValueError(f"a {self.family} transformer part needs kv_heads, head_dim and ffn >= 1")
        if self.family != "moe" and (self.mla or self.moe or self.o_bias or self.sinks):
            raise ValueError("latent attention, experts, output biases and sinks belong to the moe family")
        if self.family != "moe" and (self.recomputed or self.mtp):
            raise ValueError("recomputed modules and multi-token prediction belong to the moe family's parts")
        for attr in ("seq", "hidden", "heads", "vocab", "tp", "cp"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"transformer part: {attr} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Layer:
    """One node of a :class:`LayerGraph`: a layer's per-sample costs.

    Attributes:
        name: unique in its graph, e.g. ``"embed"``, ``"block0"``, ``"head"``, ``"conv0"``, ``"layer0"``.
        kind: ``"embedding"``, ``"decoder"``, ``"head"``, ``"conv"``, ``"uniform"``, ...
        flops_fwd: forward FLOPs per sample (one multiply-add = 2 FLOPs).
        flops_bwd: backward FLOPs per sample, input and weight gradients together (2x forward for matmuls).
        param_bytes: bytes of weights, in the graph's dtype.
        activation_bytes: bytes per sample of the output tensor, i.e. what crosses a stage boundary after this layer.
        saved_bytes: bytes per sample kept from forward until backward, the output included (module docstring).
        workspace_bytes: transient bytes per sample alive only while the op runs.
        fwd_s: device-independent forward time per sample in seconds, or None to derive it from FLOPs.
        bwd_s: device-independent backward time per sample in seconds; set exactly when ``fwd_s`` is.
        tp_comm_fwd_bytes: bytes per sample of the tensor-parallel collectives in this layer's forward, counted as
            all-reduce equivalents and summed over its collectives: an all-reduce counts its buffer (a Megatron
            block's two all-reduces of an fp16 s x h tensor count 2 * 2sh); under sequence parallelism each of them
            becomes a reduce-scatter + all-gather of the same tensor, which a ring moves in the same time, so the
            figure is the same and ``Sharding.sequence_parallel`` says how to cost it; a lone reduce-scatter or
            all-gather (sequence parallelism at the embedding and the LM head) is half a ring all-reduce and counts
            half the gathered tensor's bytes. A ring over t devices so takes ``2(t-1)/t * bytes / bandwidth``.
            0 without tensor parallelism (tp = 1) and for every model but gpt.
        tp_comm_bwd_bytes: the same for the layer's backward.
        tp_comm_fwd_count: how many collectives the forward launches, for the latency term: an all-reduce, or the
            reduce-scatter + all-gather pair that replaces it under sequence parallelism, counts 1, and so does a
            lone reduce-scatter or all-gather.
        tp_comm_bwd_count: the same for the backward.
        recompute_flops: FLOPs per sample that the backward re-runs under selective activation recomputation
            (Korthikanti et al. 2022, arXiv 2205.05198 §5), on top of ``flops_bwd``; 0 without it.
        elementwise_bytes: bytes per sample that the memory-bound ops inside a composite layer (normalisation,
            activations, pooling, additions, concatenation: an AmoebaNet cell) read and write in its forward, beyond
            the layer's input, output and weights. The roofline adds their time to the matmuls' (they run between
            them) and twice as much to the backward (each reads its saved input and the incoming gradient and writes
            a gradient); 0 for a layer that is one matmul-like op.
        transformer: for a GPT layer, which part of the transformer it is and its dimensions, so that a GPU's
            time can be costed from its kernels; None for other models.
        expert_param_bytes: of ``param_bytes``, those of routed experts (a mixture's), which the devices holding the
            same experts reduce and shard among themselves (the expert-data-parallel group, :mod:`sim.ir.parallel`)
            rather than the data-parallel group; 0 for a layer without experts.
        backward_workspace_bytes: transient bytes per sample alive only while the layer's backward runs, beyond the
            gradients it makes; ``None``: the same as ``workspace_bytes`` (the head's loss differs:
            :mod:`sim.models.loss`).
        activations_offloaded: the layer's saved activations leave for host memory as its forward makes them and
            come back for its backward (Transformer Engine's CPU offloading, :mod:`sim.models.offload`), so the
            device does not keep them between the two.
    """

    name: str
    kind: str
    flops_fwd: float
    flops_bwd: float
    param_bytes: int
    activation_bytes: int
    saved_bytes: int
    workspace_bytes: int = 0
    fwd_s: float | None = None
    bwd_s: float | None = None
    tp_comm_fwd_bytes: int = 0
    tp_comm_bwd_bytes: int = 0
    tp_comm_fwd_count: int = 0
    tp_comm_bwd_count: int = 0
    recompute_flops: float = 0.0
    transformer: TransformerPart | None = None
    elementwise_bytes: int = 0
    expert_param_bytes: int = 0
    backward_workspace_bytes: int | None = None
    activations_offloaded: bool = False

    def __post_init__(self) -> None:
        for attr in ("name", "kind"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value:
                raise ValueError(f"layer {attr} must be a non-empty string, got {value!r}")
        for attr in ("flops_fwd", "flops_bwd", "recompute_flops"):
            _check_number(self.name, attr, getattr(self, attr))
        for attr in ("param_bytes", "activation_bytes", "saved_bytes", "workspace_bytes", "tp_comm_fwd_bytes",
                     "tp_comm_bwd_bytes", "tp_comm_fwd_count", "tp_comm_bwd_count", "elementwise_bytes",
                     "expert_param_bytes"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"layer {self.name!r}: {attr} must be an int >= 0, got {value!r}")
        backward = self.backward_workspace_bytes
        if backward is not None and (isinstance(backward, bool) or not isinstance(backward, int) or backward < 0):
            raise ValueError(f"layer {self.name!r}: backward_workspace_bytes must be None or an int >= 0, got "
                             f"{backward!r}")
        if not isinstance(self.activations_offloaded, bool):
            raise ValueError(f"layer {self.name!r}: activations_offloaded must be True or False, got "
                             f"{self.activations_offloaded!r}")
        if self.expert_param_bytes > self.param_bytes:
            raise ValueError(f"layer {self.name!r}: expert_param_bytes {self.expert_param_bytes} exceeds param_bytes "
                             f"{self.param_bytes}")
        if (self.fwd_s is None) != (self.bwd_s is None):
            raise ValueError(
                f"layer {self.name!r}: set both fwd_s and bwd_s or neither, got {self.fwd_s!r}, {self.bwd_s!r}"
            )
        if self.fwd_s is not None:
            _check_number(self.name, "fwd_s", self.fwd_s)
            _check_number(self.name, "bwd_s", self.bwd_s)


    @property
    def backward_transient_bytes(self) -> int:
        """Transient bytes per sample while the layer's backward runs, beyond its gradients:
        ``backward_workspace_bytes``, or ``workspace_bytes`` where that is not set."""
        return self.workspace_bytes if self.backward_workspace_bytes is None else self.backward_workspace_bytes


def _check_number(layer: str, attr: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"layer {layer!r}: {attr} must be a finite number >= 0, got {value!r}")


def canonical_spec(name: str, values: Mapping[str, int | float]) -> str:
    """The canonical spec string of a model: ``name:`` then every ``key=value``, keys sorted.

    Integral floats print without a fraction (``fwd_ms=1``) and other floats with ``repr`` (shortest exact form),
    so parsing the string back yields the same numbers.

    >>> canonical_spec("gpt", {"layers": 2, "hidden": 64})
    'gpt:hidden=64,layers=2'
    """
    parts = []
    for key in sorted(values):
        value = values[key]
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            text = str(int(value))
        else:
            text = repr(value)
        parts.append(f"{key}={text}")
    return f"{name}:{','.join(parts)}" if parts else name


class LayerGraph:
    """A model as a networkx DiGraph of layers; nodes are ints ``0..n-1`` in execution (topological) order.

    Node attribute ``"layer"`` holds the :class:`Layer`; edge attribute ``"bytes"`` holds the bytes per sample of
    the tensor flowing along it. The graph is frozen: build a new LayerGraph rather than editing one.

    Args:
        spec: canonical spec string the graph was built from (all parameters, keys sorted).
        layers: the layers in execution order.
        dtype_bytes: bytes per parameter element (2 for fp16 training, 4 for fp32).
        edges: ``{(src, dst): bytes per sample}``; every edge must go forward (``src < dst``). Defaults to the chain
            ``i -> i+1`` carrying ``layers[i].activation_bytes``. When given, it replaces the chain entirely.
        input_bytes: bytes per sample of the model input (token ids, an image), received by layer 0.

    Raises:
        ValueError: no layers, duplicate names, an edge that is not forward (a self-loop, a cycle or layers not in
            topological order), an edge naming a missing layer, or a negative / non-integer size.
    """

    __slots__ = ("spec", "dtype_bytes", "input_bytes", "graph", "layers", "_cut_bytes")

    def __init__(
        self,
        spec: str,
        layers: Sequence[Layer],
        *,
        dtype_bytes: int,
        edges: Mapping[tuple[int, int], int] | None = None,
        input_bytes: int = 0,
    ) -> None:
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"LayerGraph spec must be a non-empty string, got {spec!r}")
        layers = tuple(layers)
        if not layers:
            raise ValueError(f"LayerGraph {spec!r} needs at least one layer, got 0")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise ValueError(f"LayerGraph {spec!r}: layers[{i}] is not a Layer, got {layer!r}")
        seen: dict[str, int] = {}
        for i, layer in enumerate(layers):
            if layer.name in seen:
                raise ValueError(
                    f"LayerGraph {spec!r}: duplicate layer name {layer.name!r} at {seen[layer.name]} and {i}"
                )
            seen[layer.name] = i
        for attr, value, low in (("dtype_bytes", dtype_bytes, 1), ("input_bytes", input_bytes, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LayerGraph {spec!r}: {attr} must be an int >= {low}, got {value!r}")

        n = len(layers)
        if edges is None:
            edges = {(i, i + 1): layers[i].activation_bytes for i in range(n - 1)}
        graph = nx.DiGraph()
        for i, layer in enumerate(layers):
            graph.add_node(i, layer=layer)
        for (src, dst), nbytes in edges.items():
            for end in (src, dst):
                if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end < n:
                    raise ValueError(f"LayerGraph {spec!r}: edge ({src!r}, {dst!r}) names no layer (0..{n - 1})")
            if src >= dst:
                raise ValueError(
                    f"LayerGraph {spec!r}: edge ({src}, {dst}) does not go forward; layers must be in "
                    f"execution order, so self-loops and cycles are rejected"
                )
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"LayerGraph {spec!r}: edge ({src}, {dst}) bytes must be an int >= 0, got {nbytes!r}")
            graph.add_edge(src, dst, bytes=nbytes)
        # Forward-only edges cannot form a cycle; this states the invariant the rest of sim relies on.
        assert nx.is_directed_acyclic_graph(graph)

        # cut_bytes[c] = bytes on edges (u, v) with u < c <= v: each edge adds its bytes to the cuts it crosses,
        # accumulated as a difference array so building is O(n + edges).
        diff = [0] * (n + 1)
        for src, dst, nbytes in graph.edges(data="bytes"):
            diff[src + 1] += nbytes
            diff[dst + 1] -= nbytes
        cut_bytes, running = [], 0
        for c in range(n + 1):
            running += diff[c]
            cut_bytes.append(running)

        self.spec = spec
        self.dtype_bytes = dtype_bytes
        self.input_bytes = input_bytes
        self.graph = nx.freeze(graph)
        self.layers: tuple[Layer, ...] = layers
        self._cut_bytes = tuple(cut_bytes)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayerGraph):
            return NotImplemented
        return (
            self.spec == other.spec
            and self.dtype_bytes == other.dtype_bytes
            and self.input_bytes == other.input_bytes
            and self.layers == other.layers
            and self.edge_bytes() == other.edge_bytes()
        )

    def __hash__(self) -> int:
        return hash((self.spec, self.layers))

    def __repr__(self) -> str:
        return f"LayerGraph({self.spec!r}, {len(self)} layers)"

    def edge_bytes(self) -> dict[tuple[int, int], int]:
        """Every edge as ``{(src, dst): bytes per sample}``."""
        return {(u, v): b for u, v, b in self.graph.edges(data="bytes")}

    def param_count(self, i: int) -> int:
        """Number of parameters of layer ``i`` (``param_bytes // dtype_bytes``)."""
        return self.layers[i].param_bytes // self.dtype_bytes

    def expert_param_count(self, i: int) -> int:
        """Of :meth:`param_count`, the routed experts' (``expert_param_bytes // dtype_bytes``)."""
        return self.layers[i].expert_param_bytes // self.dtype_bytes

    def boundary_bytes(self, cut: int) -> int:
        """Bytes per sample on edges from layers ``[0, cut)`` to ``[cut, n)``: what a stage cut before ``cut`` sends.

        Raises:
            ValueError: ``cut`` is not an int with ``0 < cut < n``.
        """
        n = len(self.layers)
        if isinstance(cut, bool) or not isinstance(cut, int) or not 0 < cut < n:
            raise ValueError(f"cut must be an int with 0 < cut < {n} for {self.spec!r}, got {cut!r}")
        return self._cut_bytes[cut]

    @property
    def total_params(self) -> int:
        """Parameters of all layers (each tied matrix once: the layer that holds it counts it)."""
        return sum(self.param_count(i) for i in range(len(self)))

    def total_param_bytes(self) -> int:
        """Bytes of all weights in the graph's dtype."""
        return sum(layer.param_bytes for layer in self.layers)

    def summary(self) -> str:
        """One line: layer count, parameters (millions), forward GFLOP per sample (and time when fixed)."""
        params = self.total_params
        gflop = sum(layer.flops_fwd for layer in self.layers) / 1e9
        text = f"{self.spec}: {len(self)} layers, {params / 1e6:.2f}M params, {gflop:.3f} GFLOP/sample fwd"
        if all(layer.fwd_s is not None for layer in self.layers):
            fwd_ms = sum(layer.fwd_s for layer in self.layers) * 1e3  # type: ignore[misc]
            text += f", {fwd_ms:g} ms/sample fwd"
        return text
