"""Real ``torch.nn`` layers and pipeline stages built from a model spec, matching ``sim``'s LayerGraph exactly.

The executor runs the plan the simulator made, so its network must be the simulator's network: the same spec
string goes through :func:`sim.models.build_model` (which checks it and fills in defaults) and then builds one
module per graph layer, in graph order, with exactly ``graph.param_count(i)`` parameters and an output of exactly
``activation_bytes / dtype_bytes`` elements per sample (DESIGN §5). Model-specific code lives in
:mod:`executor.nn.gpt`, :mod:`executor.nn.cnn` and :mod:`executor.nn.supernet`; ``uniform`` is a
cost-only model with no architecture and has no torch implementation.

Head and loss. Every layer module maps one tensor to one tensor, and the last one returns the network's output
(GPT: logits; CNN: the last feature map); :func:`loss_fn` turns that output and the microbatch's targets into the
scalar loss. The simulator folds the loss into its last layer (GPT's ``head`` has ``activation_bytes = 4``, the fp32
loss), but the loss has no parameters, so counts still match; keeping it outside means every :class:`Stage` has the
same ``forward(x) -> y`` signature, targets never travel between stages, and only the last stage's handler applies
the loss (the split ``torch.distributed.pipelining`` also makes between a stage and its ``loss_fn``).

Determinism. Layer i's parameters come from its own ``torch.Generator`` seeded from ``(seed, i)``, so the weights
of layer i are bitwise identical whichever stage split builds it, and building never touches the global RNG
(modules are created on the ``meta`` device, allocated empty, then filled from the generator). Synthetic batches
likewise come from a generator seeded from ``(seed, index)``. Seeds are mixed through BLAKE2b with a purpose tag,
rather than ``seed * K + i``, so no two (purpose, seed, index) triples share a stream by arithmetic accident.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from executor.nn import cnn as models_cnn
from executor.nn import gpt as models_gpt
from executor.nn import supernet as models_supernet
from executor.nn.seeds import derive_seed
from sim.core.errors import SpecError
from sim.core.spec import parse_spec
from sim.models import build_model
from sim.models.graph import LayerGraph

__all__ = [
    "TORCH_MODELS", "Stage", "TensorSpec", "build_layers", "build_stage", "boundary_specs", "check_torch_model",
    "synthetic_batch", "loss_fn",
]


@dataclass(frozen=True)
class _TorchModel:
    """How to build one model of the zoo in torch.

    Attributes:
        make_layer: ``(spec values, layer index) -> nn.Module`` with an ``init_parameters(generator)`` method.
        make_batch: ``(spec values, num_samples, generator) -> (inputs, targets)``.
        loss: ``(last layer's output, targets) -> scalar loss``.
    """

    make_layer: Callable[[dict[str, int], int], nn.Module]
    make_batch: Callable[[dict[str, int], int, torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]


_MODELS: Mapping[str, _TorchModel] = {
    "gpt": _TorchModel(models_gpt.make_layer, models_gpt.make_batch, models_gpt.loss),
    "cnn": _TorchModel(models_cnn.make_layer, models_cnn.make_batch, models_cnn.loss),
    "supernet": _TorchModel(models_supernet.make_layer, models_supernet.make_batch, models_supernet.loss),
}
TORCH_MODELS: tuple[str, ...] = tuple(sorted(_MODELS))  # the zoo models the executor can run


def _resolve(spec: str) -> tuple[LayerGraph, _TorchModel, dict[str, int]]:
    """The graph of ``spec``, its torch builders and its canonical key values.

    Raises:
        SpecError: ``spec`` is invalid (from :func:`build_model`) or names a model with no torch implementation.
    """
    graph = build_model(spec)
    name, raw = parse_spec(graph.spec)
    model = _MODELS.get(name)
    if model is None:
        raise SpecError(
            f"model {name!r} has no torch implementation, so the executor cannot run {graph.spec!r} "
            f"(torch models: {', '.join(TORCH_MODELS)})"
        )
    # gpt, cnn and supernet read every key with SpecParams.int, so the canonical values are integers.
    return graph, model, {key: int(value) for key, value in raw.items()}


def check_torch_model(spec: str) -> LayerGraph:
    """The graph of ``spec``, or :class:`SpecError` unless it is a valid model with a torch implementation; builds no
    module (so a launcher can check a plan without paying for torch's module machinery)."""
    return _resolve(spec)[0]


def _check_int(what: str, value: object, minimum: int | None) -> int:
    """Return ``value`` if it is an int (not a bool) >= ``minimum``; else raise TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _build_layer(model: _TorchModel, values: dict[str, int], i: int, seed: int) -> nn.Module:
    """Layer ``i`` with its parameters drawn from the generator of ``(seed, i)``, fp32 on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(derive_seed("layer", seed, i))
    # On the meta device the constructors' default initialisation allocates nothing and draws nothing from the
    # global RNG; init_parameters then writes every parameter from this layer's own generator. fp32 is forced
    # so that a changed torch default dtype cannot change the weights.
    with torch.device("meta"):
        layer = model.make_layer(values, i)
    layer = layer.to(torch.float32).to_empty(device="cpu")
    layer.init_parameters(generator)  # type: ignore[operator]
    return layer


def build_layers(spec: str, *, seed: int = 0) -> list[nn.Module]:
    """One initialised module per layer of ``build_model(spec)``, in the graph's order.

    Args:
        spec: a model spec such as ``"gpt:layers=2,hidden=64"`` (defaults fill the missing keys).
        seed: the parameter seed; layer i is initialised from ``(seed, i)`` exactly as in :func:`build_stage`.

    Returns:
        ``len(graph)`` fp32 CPU modules; module i has ``graph.param_count(i)`` parameters.

    Raises:
        SpecError: an invalid spec, or a model with no torch implementation (e.g. ``uniform``).
        TypeError: ``seed`` is not an int.
    """
    graph, model, values = _resolve(spec)
    _check_int("seed", seed, None)
    return [_build_layer(model, values, i, seed) for i in range(len(graph))]


class Stage(nn.Module):
    """The layers ``[start, end)`` of one pipeline stage, run in order.

    Submodules are keyed by the graph's layer names (``embed``, ``block3``, ``head``, ``conv0``), so a stage's
    ``state_dict`` keys (``layers.block3.qkv.weight``) are the same whichever split holds the layer, and the union
    of all stages' state dicts is the whole model's.

    Args:
        spec: the canonical model spec.
        start: graph index of the first layer.
        layers: the layers ``start, start + 1, ...`` in order, keyed by graph layer name.

    Attributes:
        spec: the canonical model spec.
        start: index of the first layer in the graph.
        end: one past the index of the last layer.
        layers: ``nn.ModuleDict`` of the layers in order.
    """

    def __init__(self, spec: str, start: int, layers: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.spec = spec
        self.start = start
        self.end = start + len(layers)
        self.layers = nn.ModuleDict(layers)

    def forward(self, x: Tensor) -> Tensor:
        """Run the stage's layers in order.

        Args:
            x: the model input (first stage) or the previous stage's output, e.g. GPT (n, s) int64 token ids or
                (n, s, h) fp32 hidden states, CNN (n, 3 or C, S, S) fp32.

        Returns:
            The last layer's output: the next stage's input, or the network output that :func:`loss_fn` reads.
        """
        for layer in self.layers.values():
            x = layer(x)
        return x

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}, start={self.start}, end={self.end}"


def build_stage(spec: str, start: int, end: int, *, seed: int) -> Stage:
    """The stage holding layers ``[start, end)`` of ``spec``, parameters initialised from ``(seed, i)`` per layer.

    Only the stage's own layers are built, so a rank never allocates the rest of the model. Layer i's parameters
    are bitwise identical to those of ``build_layers(spec, seed=seed)[i]`` and of any other split.

    Args:
        spec: a model spec.
        start: first layer index, ``0 <= start < end``.
        end: one past the last layer index, ``end <= len(graph)``.
        seed: the parameter seed.

    Raises:
        SpecError: an invalid spec, or a model with no torch implementation.
        TypeError: ``start``, ``end`` or ``seed`` is not an int.
        ValueError: the range is empty or outside ``[0, len(graph))``; the message names it.
    """
    graph, model, values = _resolve(spec)
    _check_int("start", start, None)
    _check_int("end", end, None)
    _check_int("seed", seed, None)
    if not 0 <= start < end <= len(graph):
        raise ValueError(
            f"stage layers [{start}, {end}) must satisfy 0 <= start < end <= {len(graph)} for {graph.spec!r}"
        )
    layers = {graph.layers[i].name: _build_layer(model, values, i, seed) for i in range(start, end)}
    return Stage(graph.spec, start, layers)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor that crosses a layer boundary (what an ``irecv`` buffer must look like).

    Attributes:
        shape: the tensor's shape, microbatch dimension first.
        dtype: its dtype.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def boundary_specs(spec: str, cuts: list[int] | tuple[int, ...], num_samples: int) -> dict[int, TensorSpec]:
    """The shape and dtype of the tensor entering layer ``cut``, for each cut, for a microbatch of ``num_samples``.

    Found by running the whole model once on the ``meta`` device (shapes only: no memory, no arithmetic, no RNG), so
    the answer is the modules' own, never a second description of them that could drift.

    Args:
        spec: a model spec.
        cuts: layer indices in ``[0, len(graph)]``; ``len(graph)`` means the model's output.
        num_samples: samples in the microbatch, >= 1.

    Returns:
        cut -> spec of the tensor that flows into layer ``cut`` (cut 0: the model input).

    Raises:
        SpecError: an invalid spec or a model with no torch implementation.
        ValueError: a cut outside ``[0, len(graph)]``.
    """
    graph, model, values = _resolve(spec)
    _check_int("num_samples", num_samples, 1)
    for cut in cuts:
        if not 0 <= cut <= len(graph):
            raise ValueError(f"cut {cut} outside [0, {len(graph)}] for {graph.spec!r}")
    x, _ = model.make_batch(values, num_samples, torch.Generator(device="cpu").manual_seed(0))
    with torch.device("meta"):
        layers = [model.make_layer(values, i) for i in range(len(graph))]
    x = x.to("meta")
    specs: dict[int, TensorSpec] = {}
    with torch.no_grad():
        for i in range(len(graph) + 1):
            if i in cuts:
                specs[i] = TensorSpec(tuple(x.shape), x.dtype)
            if i < len(graph):
                x = layers[i](x)
    return specs


def synthetic_batch(spec: str, num_samples: int, *, seed: int, index: int) -> tuple[Tensor, Tensor]:
    """Seeded synthetic inputs and targets of microbatch ``index``; a pure function of its arguments.

    The stream is seeded from ``(seed, index)`` only, so it does not depend on the stage count, the rank that
    asks or what was drawn before. A batch of 2n samples is not two batches of n: ask per microbatch.

    Args:
        spec: a model spec.
        num_samples: n, samples in the microbatch, >= 1.
        seed: the data seed.
        index: the microbatch index, >= 0.

    Returns:
        ``(inputs, targets)``. GPT: (n, s) int64 token ids and (n, s) int64 next-token ids. CNN: (n, 3, S, S)
        fp32 N(0, 1) images and (n, C, S, S) fp32 U[0, 1) targets, the shape of the last layer's output.

    Raises:
        SpecError: an invalid spec, or a model with no torch implementation.
        TypeError / ValueError: ``num_samples`` < 1, ``index`` < 0 or a non-int ``seed``.
    """
    _, model, values = _resolve(spec)
    _check_int("num_samples", num_samples, 1)
    _check_int("seed", seed, None)
    _check_int("index", index, 0)
    generator = torch.Generator(device="cpu").manual_seed(derive_seed("batch", seed, index))
    return model.make_batch(values, num_samples, generator)


def loss_fn(spec: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss of ``spec``'s model: ``loss(last layer's output, targets) -> () fp32 scalar``.

    GPT: mean cross-entropy over all n x s tokens of the head's (n, s, V) logits. CNN: mean squared error over
    all n x C x S x S output elements. Both are means, so the loss of a microbatch does not scale with its size.

    Raises:
        SpecError: an invalid spec, or a model with no torch implementation.
    """
    return _resolve(spec)[1].loss
