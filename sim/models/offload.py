"""Activation offloading to host memory (``--offload-activations N``): which blocks' activations leave the device.

Megatron-Core offloads the activations of the first ``cpu_offloading_num_layers`` transformer layers through
Transformer Engine's ``get_cpu_offload_context`` (``megatron/core/transformer/transformer_block.py``; TE's
``transformer_engine/pytorch/cpu_offload.py`` and its guide, ``docs/features/other_optimizations/cpu_offloading``,
read at d0067d0): "First ``num_layers`` layers are offloaded to CPU", each tensor's copy starting as soon as the layer
saves it for the backward, and reloaded before the layer's backward needs it; "At most ``(model_layers -
num_layers)`` sets of activations are on GPU at any time; both compute and reload may be stalled to enforce this
limit", and ``num_layers`` must be below ``model_layers``. Megatron-Core refuses it beside pipeline parallelism and
beside activation recomputation (``transformer_config.py``: "Currently there is no support for Pipeline parallelism
with CPU offloading", "CPU offloading does not work when activation recomputation is enabled").

Here the first N decoder blocks of the model are marked (``Layer.activations_offloaded``): the memory ledger does
not keep their saved activations from forward to backward and holds each again only while its own backward runs
(:mod:`sim.cost.memory_sizes`), and the cost oracle makes an offloaded block's forward last at least its copy to the
host and its backward at least the copy back (:mod:`sim.cost.oracle`: the copies run on their own stream, so a
block is slowed only when its copy takes longer than its compute; Megatron's ``cpu_offloading_weights``, off in the
recipes, is not modelled).
"""

from __future__ import annotations

from dataclasses import replace

from sim.core.errors import SpecError
from sim.models.graph import LayerGraph

__all__ = ["offload_blocks", "block_indices"]


def block_indices(graph: LayerGraph) -> tuple[int, ...]:
    """The indices of the model's decoder blocks (the layers named ``block0``, ``block1``, ...) in order."""
    return tuple(i for i, layer in enumerate(graph.layers)
                 if layer.name.startswith("block") and layer.kind == "decoder")


def offload_blocks(graph: LayerGraph, count: int) -> LayerGraph:
    """``graph`` with the activations of its first ``count`` decoder blocks offloaded (module docstring).

    Raises:
        SpecError: ``count`` not below the model's number of blocks (Transformer Engine keeps at least one block's
            activations on the device).
    """
    blocks = block_indices(graph)
    if count >= len(blocks):
        raise SpecError(f"{{offload_activations}} {count} must be below the model's {len(blocks)} blocks "
                        f"(Transformer Engine keeps at least one block's activations on the device)",
                        "offload_activations")
    offloaded = set(blocks[:count])
    layers = [replace(layer, activations_offloaded=True) if i in offloaded else layer
              for i, layer in enumerate(graph.layers)]
    edges = {(src, dst): data["bytes"] for src, dst, data in graph.graph.edges(data=True)}
    return LayerGraph(graph.spec, layers, dtype_bytes=graph.dtype_bytes, edges=edges, input_bytes=graph.input_bytes)
