"""A model's layers, each beside its real input: what the per-layer measurements (times in
:mod:`profiles.layer_timing`, memory in :mod:`profiles.layer_memory`) run each layer on.

One seeded synthetic microbatch is pushed through the layers without autograd; layer i's input is then the output of
layers ``0 .. i-1``, exactly what layer i receives as the first layer of a pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from executor.nn.stages import build_layers, loss_fn, synthetic_batch
from sim.models import build_model
from sim.models.graph import LayerGraph

__all__ = ["LayersOnInputs", "layers_on_inputs"]


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


def layers_on_inputs(spec: str, *, microbatch_size: int, seed: int, device: torch.device) -> LayersOnInputs:
    """Build ``spec``'s layers on ``device`` (seeded) and compute each one's real input.

    Raises:
        SpecError: an invalid spec, or a model without a torch implementation.
    """
    graph = build_model(spec)
    layers = tuple(layer.to(device) for layer in build_layers(graph.spec, seed=seed))
    batch, targets = synthetic_batch(graph.spec, microbatch_size, seed=seed, index=0)
    inputs = []
    with torch.no_grad():
        x = batch.to(device)
        for layer in layers:
            inputs.append(x)
            x = layer(x)
    return LayersOnInputs(graph, layers, tuple(inputs), targets.to(device), loss_fn(graph.spec))
