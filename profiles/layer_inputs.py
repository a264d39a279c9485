"""A model's layers, each beside its real input: what the per-layer measurements (times in
:mod:`profiles.layer_timing`, memory in :mod:`profiles.layer_memory`) run each layer on.

One seeded synthetic microbatch is pushed through the layers without autograd; layer i's input is then the output of
layers ``0 .. i-1``, exactly what layer i receives as the first layer of a pipeline stage.

With ``tp`` > 1 the layers are one tensor-parallel shard of each (the executor's: ``shard_layer`` of
:mod:`executor.nn.gpt_parallel` or :mod:`executor.nn.llama_parallel`, shard 0 of ``tp``) in this one process: their
collectives leave each tensor as it is (:class:`MeasuredShardComm`). A shard then computes on the shapes, and keeps
the tensors, that a rank of a ``tp``-way group does (the executor's all-reduces run in place on a clone the autograd
functions make either way), though its sums are its own partial ones: right for bytes and for the time of its compute,
not for the values, nor for the collectives' time, which the simulator costs apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from executor.nn.gpt_parallel import parallel_loss
from executor.nn.stages import build_layers, loss_fn, synthetic_batch
from executor.nn.tensor_parallel import TensorParallelComm
from executor.parallel import tensor_parallel_module
from sim.core.errors import SpecError
from sim.core.spec import parse_spec
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.models.sharding import Sharding

__all__ = ["LayersOnInputs", "layers_on_inputs", "MeasuredShardComm", "TENSOR_PARALLEL_MODELS"]

#: The models whose layers the executor splits into tensor-parallel shards (what ``--tp`` can measure).
TENSOR_PARALLEL_MODELS = ("gpt", "llama")


class MeasuredShardComm(TensorParallelComm):
    """Shard 0 of a ``size``-way tensor-parallel group, alone in this process: every all-reduce leaves its tensor as
    it is (module docstring). Nothing is communicated, so no process group is needed."""

    def __init__(self, size: int) -> None:
        super().__init__(None, size, 0)

    def all_reduce(self, tensor: Tensor, op: object = None) -> Tensor:
        """``tensor`` unchanged (the group's other shards are not here)."""
        return tensor


@dataclass(frozen=True)
class LayersOnInputs:
    """A model's torch layers on one device and their inputs.

    Attributes:
        graph: the model's layer graph (names and order).
        layers: one torch module per graph layer, seeded.
        inputs: layer i's input for one microbatch (no autograd history).
        targets: the microbatch's loss targets.
        loss: ``(last layer's output, targets) -> scalar``, as the executor's last stage applies it.
    """

    graph: LayerGraph
    layers: tuple[torch.nn.Module, ...]
    inputs: tuple[Tensor, ...]
    targets: Tensor
    loss: Callable[[Tensor, Tensor], Tensor]


def layers_on_inputs(spec: str, *, microbatch_size: int, seed: int, device: torch.device,
                     tp: int = 1) -> LayersOnInputs:
    """Build ``spec``'s layers on ``device`` (seeded), or with ``tp`` > 1 shard 0 of each of them (module docstring),
    and compute each one's real input.

    Raises:
        SpecError: an invalid spec, a model without a torch implementation, or ``tp`` > 1 for a model without
            tensor-parallel shards or one ``tp`` does not divide.
    """
    if tp == 1:
        graph = build_model(spec)
        layers = tuple(layer.to(device) for layer in build_layers(graph.spec, seed=seed))
        loss = loss_fn(graph.spec)
    else:
        name = parse_spec(spec)[0]
        if name not in TENSOR_PARALLEL_MODELS:
            raise SpecError(f"--tp {tp}: the executor splits only {' and '.join(TENSOR_PARALLEL_MODELS)} layers into "
                            f"tensor-parallel shards, not {name}")
        graph = build_model(spec, Sharding(tp=tp))  # refuses a degree that does not divide the heads or widths
        comm = MeasuredShardComm(tp)
        values = {key: int(value) for key, value in parse_spec(graph.spec)[1].items()}
        shard_layer = tensor_parallel_module(graph.spec).shard_layer
        layers = tuple(shard_layer(layer, values, comm).to(device) for layer in build_layers(graph.spec, seed=seed))
        loss = parallel_loss(values, comm)
    batch, targets = synthetic_batch(graph.spec, microbatch_size, seed=seed, index=0)
    inputs = []
    with torch.no_grad():
        x = batch.to(device)
        for layer in layers:
            inputs.append(x)
            x = layer(x)
    return LayersOnInputs(graph, layers, tuple(inputs), targets.to(device), loss)
