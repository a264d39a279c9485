"""One device's share of a model under tensor, context and expert parallelism: the :class:`Sharding` that
``build_model`` takes.

``build_model(spec, sharding)`` returns the :class:`~sim.models.graph.LayerGraph` of the shard one device of a
tensor-parallel group holds: every layer's FLOPs, weights and saved activations are that device's, and each layer
records the tensor-parallel collectives it runs (``Layer.tp_comm_*``, per sample) and, under selective
recomputation, the FLOPs its backward re-runs (``Layer.recompute_flops``). ``build_model(spec)`` is
``build_model(spec, NO_SHARDING)``: the whole model on one device, figures unchanged.

Sources: Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053 §3) splits attention by heads and the MLP by its inner
dimension, with two all-reduces per block in the forward and two in the backward; sequence parallelism and selective
recomputation are Korthikanti et al. 2022 (arXiv 2205.05198) §4.2.2 and §5, with the per-layer activation memory of
each combination in its Table 2. ``gpt``, ``llama`` and ``moe`` are modelled sharded (:func:`sim.models.build_model`
refuses the others); expert parallelism, routing and the capacity factor shape the ``moe`` family's experts only.

Collective accounting: every collective is written as *all-reduce equivalents* (``Layer.tp_comm_*`` docstrings).
:func:`all_reduce` is one all-reduce of a buffer, :func:`lone_gather_or_scatter` a lone reduce-scatter or all-gather
of a tensor whose gathered size is given; under sequence parallelism a block's all-reduce becomes a reduce-scatter
and an all-gather of the same tensor, which a ring moves in the same time, so it keeps its all-reduce figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.models.blocks import BLOCKS, DTYPE_BYTES, check_blocks
from sim.models.graph import Layer
from sim.models.loss import LOSSES
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, check_recompute_modules
from sim.models.routing import BALANCED, Routing

#: The expert token dispatchers ``--ep-dispatcher`` takes (:class:`Sharding`'s ``dispatcher``), the default first.
DISPATCHERS = ("all-to-all", "deduplicated", "all-gather")

__all__ = ["Sharding", "NO_SHARDING", "DISPATCHERS", "Collectives", "all_reduce", "lone_gather_or_scatter",
           "padded_vocab",
           "collective_layer"]


@dataclass(frozen=True)
class Sharding:
    """How one device holds the model: its tensor-parallel shard.

    Attributes:
        tp: tensor-parallel degree t, the devices that split every layer (Megatron-LM §3).
        sequence_parallel: Korthikanti et al. §4.2.2: the LayerNorms, dropouts and residual adds, which tensor
            parallelism replicates, are split along the sequence instead, so the activations between the
            tensor-parallel regions are s/t long, and each all-reduce becomes a reduce-scatter + all-gather. With
            ``tp = 1`` there is nothing to split and it changes nothing (allowed, so a sweep may set it throughout).
        selective_recompute: Korthikanti et al. §5: the attention core (QK^T, softmax, softmax dropout, attention
            over V) keeps nothing for the backward, which re-runs it; everything else is kept.
        cp: context-parallel degree C: the device holds 1/C of each sequence's tokens (:mod:`sim.cost.
            context_parallel`), so its FLOPs and activations are 1/C of the replica's.
        ep: expert-parallel degree: the routed experts of each mixture split over ``ep`` devices
            (:mod:`sim.models.moe`); the device holds E/ep of them and computes the tokens routed to them.
        etp: expert-tensor-parallel degree: each expert's SwiGLU width split over ``etp`` devices.
        routing: how tokens spread over the experts (:mod:`sim.models.routing`); the device modelled is the
            expert-parallel rank that receives the most.
        capacity_factor: each expert computes at most ``capacity_factor · k · T / E`` of the slots, the rest dropped
            (0: dropless).
        dispatcher: how the expert-parallel ranks exchange tokens (:data:`DISPATCHERS`, ``--ep-dispatcher``):
            ``all-to-all`` (Megatron-Core's all-to-all token dispatcher: each token copy straight to its expert's
            rank) or ``deduplicated`` (DeepEP's and DeepSeek-V3's: once per server over the network, then to the
            experts inside it; :func:`sim.cost.collectives.deduplicated_all_to_all_cost`) or ``all-gather``
            (Megatron-Core's all-gather dispatcher, Megatron-LM's default: every token to every rank of the group,
            the experts' outputs reduce-scattered back; :mod:`sim.cost.expert_exchange`).
        loss: how the framework computes the cross entropy over the vocabulary (:data:`sim.models.loss.LOSSES`,
            ``--loss``), which decides what the head layer keeps and holds while it runs (:mod:`sim.models.loss`).
        blocks: the modules the framework builds each decoder block from (:data:`sim.models.blocks.BLOCKS`,
            ``--blocks``), which decides what a block keeps for its backward (:mod:`sim.models.blocks`).
        saved_input_bytes: bytes per element of a linear's input as a ``transformer-engine`` block keeps it for the
            weight gradient (w of :mod:`sim.models.blocks`): 2 in bf16, less under a narrow precision.
        offloaded_blocks: how many of the first decoder blocks keep their activations in host memory between the
            forward and the backward (``--offload-activations``, :mod:`sim.models.offload`); 0: none.
        recompute_modules: what ``selective_recompute`` drops in a moe-family block (Megatron-Core's
            output-discarding modules, ``--recompute-modules``, :mod:`sim.models.recompute_modules`); another set than
            the default needs ``selective_recompute``.
    """

    tp: int = 1
    sequence_parallel: bool = False
    selective_recompute: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    routing: Routing = BALANCED
    capacity_factor: float = 0.0
    dispatcher: str = "all-to-all"
    loss: str = LOSSES[0]
    blocks: str = BLOCKS[0]
    saved_input_bytes: float = DTYPE_BYTES
    offloaded_blocks: int = 0
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name} must be an int >= 1, got {value!r}")
        offloaded = self.offloaded_blocks
        if isinstance(offloaded, bool) or not isinstance(offloaded, int) or offloaded < 0:
            raise ValueError(f"Sharding.offloaded_blocks must be an int >= 0, got {offloaded!r}")
        if not isinstance(self.routing, Routing):
            raise ValueError(f"Sharding.routing must be a Routing, got {self.routing!r}")
        factor = self.capacity_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"capacity_factor must be a finite number >= 0 (0: dropless), got {factor!r}")
        for name in ("sequence_parallel", "selective_recompute"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"Sharding.{name} must be True or False, got {value!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"Sharding.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        check_blocks(self.blocks, self.saved_input_bytes)
        check_recompute_modules(self.recompute_modules)
        if self.recompute_modules != DEFAULT_RECOMPUTE_MODULES and not self.selective_recompute:
            raise ValueError(f"Sharding.recompute_modules {self.recompute_modules!r} needs selective_recompute")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"Sharding.dispatcher must be one of {', '.join(DISPATCHERS)}, got {self.dispatcher!r}")

    @property
    def sequence_shards(self) -> int:
        """Parts the sequence of the non-tensor-parallel regions is split into: ``tp`` under sequence
        parallelism, else 1 (those regions are replicated on every device of the group)."""
        return self.tp if self.sequence_parallel else 1

    @property
    def changes_model(self) -> bool:
        """Whether a graph built with this sharding can differ from the whole model's: ``tp > 1``, ``cp > 1``,
        selective recomputation, a loss or blocks other than the default, offloaded activations or any expert setting
        (sequence parallelism alone, at ``tp = 1``, is a no-op)."""
        return (self.tp > 1 or self.cp > 1 or self.selective_recompute or self.loss != LOSSES[0]
                or self.blocks != BLOCKS[0] or self.offloaded_blocks > 0 or self.shapes_experts)

    @property
    def shapes_experts(self) -> bool:
        """Whether this sharding sets anything of a mixture's experts (their parallelism, routing or capacity)."""
        return self.ep > 1 or self.etp > 1 or self.routing != BALANCED or self.capacity_factor > 0

    def describe(self) -> str:
        """Short text for messages, e.g. ``tp=4, sequence parallel, selective recompute``."""
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else [])
        parts += [f"{name}={getattr(self, name)}" for name in ("ep", "etp") if getattr(self, name) > 1]
        if self.routing != BALANCED:
            parts.append(f"routing {self.routing.describe()}")
        if self.capacity_factor:
            parts.append(f"capacity factor {self.capacity_factor:g}")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.selective_recompute:
            parts.append("selective recompute" + (f" of {', '.join(self.recompute_modules)}"
                                                  if self.recompute_modules != DEFAULT_RECOMPUTE_MODULES else ""))
        if self.loss != LOSSES[0]:
            parts.append(f"{self.loss} loss")
        if self.blocks != BLOCKS[0]:
            parts.append(f"{self.blocks} blocks" + (f" keeping {self.saved_input_bytes:g}-byte linear inputs"
                                                    if self.saved_input_bytes != DTYPE_BYTES else ""))
        if self.offloaded_blocks:
            parts.append(f"{self.offloaded_blocks} blocks' activations offloaded")
        return ", ".join(parts)


#: The whole model on one device: what ``build_model(spec)`` builds.
NO_SHARDING = Sharding()


@dataclass(frozen=True)
class Collectives:
    """Tensor-parallel collectives of one pass of one layer, per sample, as all-reduce equivalents.

    Attributes:
        nbytes: bytes, summed over the collectives (an all-reduce counts its buffer; a lone reduce-scatter or
            all-gather half its gathered tensor).
        count: collectives launched (an all-reduce, or the reduce-scatter + all-gather pair replacing it, is 1).
    """

    nbytes: int = 0
    count: int = 0

    def __add__(self, other: Collectives) -> Collectives:
        return Collectives(self.nbytes + other.nbytes, self.count + other.count)


def all_reduce(nbytes: int, times: int = 1) -> Collectives:
    """``times`` all-reduces of an ``nbytes`` buffer each (or, under sequence parallelism, the reduce-scatter +
    all-gather pairs of the same tensor that replace them: a ring moves both in the same time)."""
    return Collectives(nbytes * times, times)


def lone_gather_or_scatter(gathered_bytes: int) -> Collectives:
    """One reduce-scatter or all-gather whose gathered tensor has ``gathered_bytes``: half a ring all-reduce of that
    tensor (a ring all-reduce is a reduce-scatter followed by an all-gather), launched once."""
    if gathered_bytes % 2:
        raise ValueError(f"a gathered tensor of {gathered_bytes} bytes cannot be halved exactly")
    return Collectives(gathered_bytes // 2, 1)


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rows the ``tp`` shards of a vocabulary-parallel table hold together: ``vocab`` rounded up to a
    multiple of ``tp``, so every shard has ``padded_vocab // tp`` rows (the padding rows are never a target).

    Megatron-LM pads further, to a multiple of 128·t (``--make-vocab-size-divisible-by 128``), for matmul
    efficiency. We pad only as far as the split needs, so ``tp = 1`` keeps the model's exact vocabulary (the
    executor's torch modules are checked against it) and a shard holds fewer than 128 rows less than Megatron's.

    >>> padded_vocab(50257, 1), padded_vocab(50257, 2), padded_vocab(50257, 8)
    (50257, 50258, 50264)
    """
    return -(-vocab // tp) * tp


def collective_layer(*, fwd: Collectives, bwd: Collectives, **fields: object) -> Layer:
    """A :class:`~sim.models.graph.Layer` with its forward and backward tensor-parallel collectives (``fields`` are
    the layer's other attributes)."""
    return Layer(tp_comm_fwd_bytes=fwd.nbytes, tp_comm_fwd_count=fwd.count, tp_comm_bwd_bytes=bwd.nbytes,
                 tp_comm_bwd_count=bwd.count, **fields)  # type: ignore[arg-type]
