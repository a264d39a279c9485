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
(modules are created on the CPU with torch's default initialisers skipped and the global RNG forked, then filled
from the generator). Synthetic batches likewise come from a generator seeded from ``(seed, index)``. Seeds are mixed
through BLAKE2b with a purpose tag, rather than ``seed * K + i``, so no two (purpose, seed, index) triples share a
stream by arithmetic accident.

Start-up cost. Nothing here runs a tensor op on the ``meta`` device: torch implements most meta kernels (``normal_``,
``add``, ``relu``, ...) as Python references wrapped in ``torch._disable_dynamo``, whose first call imports
``torch._dynamo`` (1.5-2 s of every worker's start on a 2-core host). Boundary shapes therefore come from the
model's spec values, checked against the graph's byte counts, not from a meta forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from executor.nn import cnn as models_cnn
from executor.nn import gpt as models_gpt
from executor.nn import llama as models_llama
from executor.nn import moe as models_moe
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
        hidden_shape: ``spec values -> per-sample shape`` of every layer's fp32 output but the last's.
        output_shape: ``spec values -> per-sample shape`` of the last layer's fp32 output (what ``loss`` reads).
        check: refuses, with a :class:`SpecError`, spec values the modules do not run (before anything is built).
    """

    make_layer: Callable[[dict[str, int], int], nn.Module]
    make_batch: Callable[[dict[str, int], int, torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    hidden_shape: Callable[[dict[str, int]], tuple[int, ...]]
    output_shape: Callable[[dict[str, int]], tuple[int, ...]]
    check: Callable[[dict[str, int]], None] = lambda values: None


def _tokens_by_hidden(values: dict[str, int]) -> tuple[int, ...]:
    return values["seq"], values["hidden"]  # GPT and supernet blocks: (s, h) hidden states


def _tokens_by_vocab(values: dict[str, int]) -> tuple[int, ...]:
    return values["seq"], values["vocab"]  # GPT and supernet heads: (s, V) logits


def _feature_map(values: dict[str, int]) -> tuple[int, ...]:
    return values["features"], values["size"], values["size"]  # every CNN layer: (C, S, S), same padding


_MODELS: Mapping[str, _TorchModel] = {
    "gpt": _TorchModel(models_gpt.make_layer, models_gpt.make_batch, models_gpt.loss,
                       _tokens_by_hidden, _tokens_by_vocab),
    "llama": _TorchModel(models_llama.make_layer, models_gpt.make_batch, models_gpt.loss,
                         _tokens_by_hidden, _tokens_by_vocab, models_llama.check_values),
    "moe": _TorchModel(models_moe.make_layer, models_gpt.make_batch, models_gpt.loss,
                       _tokens_by_hidden, _tokens_by_vocab, models_moe.check_values),
    "cnn": _TorchModel(models_cnn.make_layer, models_cnn.make_batch, models_cnn.loss, _feature_map, _feature_map),
    "supernet": _TorchModel(models_supernet.make_layer, models_supernet.make_batch, models_supernet.loss,
                            _tokens_by_hidden, _tokens_by_vocab),
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
    # gpt, llama, moe, cnn and supernet read every key with SpecParams.int, so the canonical values are integers.
    values = {key: int(value) for key, value in raw.items()}
    model.check(values)
    return graph, model, values


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


#: torch.nn.init's public in-place initialisers (``normal_``, ``kaiming_uniform_``, ``ones_``, ...).
_INITIALISERS = frozenset(
    function for name, function in vars(torch.nn.init).items()
    if callable(function) and name.endswith("_") and not name.startswith("_")
)


class _SkipInitialisers(TorchFunctionMode):
    """While active, torch.nn.init's initialisers that dispatch to a torch-function mode return their tensor untouched.

    The constructors' default initialisation would be thrown away (``init_parameters`` writes every parameter
    from the layer's own generator), and the random part costs about as much as that write. In torch 2.13
    ``normal_``, ``uniform_`` and ``kaiming_uniform_`` dispatch (the defaults of ``nn.Embedding``, ``nn.Linear`` and
    ``nn.Conv2d``): their parameters are left as ``torch.empty`` made them, as ``to_empty`` would. Initialisers
    that do not dispatch (``ones_``, ``zeros_``, ``xavier_*``) simply run, on the forked global RNG.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _build_layer(model: _TorchModel, values: dict[str, int], i: int, seed: int) -> nn.Module:
    """Layer ``i`` with its parameters drawn from the generator of ``(seed, i)``, fp32 on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(derive_seed("layer", seed, i))
    # Built on the CPU, not the meta device (see "Start-up cost" above). fork_rng guarantees that whatever a
    # constructor draws from the global RNG is undone; init_parameters then writes every parameter from this
    # layer's own generator. fp32 is forced so that a changed torch default dtype cannot change the weights.
    with torch.random.fork_rng(devices=[]), _SkipInitialisers():
        layer = model.make_layer(values, i)
    layer = layer.to(torch.float32)
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
        return _product(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def boundary_specs(spec: str, cuts: list[int] | tuple[int, ...], num_samples: int, *,
                   sequence_parts: int = 1) -> dict[int, TensorSpec]:
    """The shape and dtype of the tensor entering layer ``cut``, for each cut, for a microbatch of ``num_samples``.

    Cut 0 is the model input as ``synthetic_batch`` makes it; every other cut is the fp32 output of layer
    ``cut - 1``, whose per-sample shape comes from the spec's values and is checked against the graph: its element
    count must be the layer's ``activation_bytes / dtype_bytes`` (the head's ``workspace_bytes / dtype_bytes``,
    its logits; the graph's ``activation_bytes`` there is the loss), the contract the layer modules are tested to
    keep. No module is built and no forward pass run (see "Start-up cost" above).

    Args:
        spec: a model spec.
        cuts: layer indices in ``[0, len(graph)]``; ``len(graph)`` means the model's output.
        num_samples: samples in the microbatch, >= 1.
        sequence_parts: under context parallelism, C: every boundary tensor holds 1/C of the sequence (dim 1 of a
            sequence model's tensors).

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
    one, _ = model.make_batch(values, 1, torch.Generator(device="cpu").manual_seed(0))  # one sample: shape only
    specs: dict[int, TensorSpec] = {}
    for cut in cuts:
        if cut == 0:
            shape, dtype, graph_bytes = tuple(one.shape[1:]), one.dtype, graph.input_bytes
            nbytes = one.numel() * one.element_size()
        else:
            layer = graph.layers[cut - 1]
            shape = model.output_shape(values) if cut == len(graph) else model.hidden_shape(values)
            dtype, nbytes = torch.float32, graph.dtype_bytes * _product(shape)
            graph_bytes = layer.workspace_bytes if layer.kind == "head" else layer.activation_bytes
        if nbytes != graph_bytes:  # a model module and its graph disagree: a bug, never bad input
            raise RuntimeError(f"boundary {cut} of {graph.spec!r}: shape {shape} is {nbytes} bytes per sample in "
                               f"the graph's dtype, but the graph says {graph_bytes}")
        if sequence_parts > 1:
            shape = (shape[0] // sequence_parts, *shape[1:])
        specs[cut] = TensorSpec((num_samples, *shape), dtype)
    return specs


def _product(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


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
