"""Full activation recomputation one layer at a time (``--recompute``), as the simulator's memory ledger counts it.

The forward of a recomputed microbatch builds no autograd graph and keeps each layer's input, its checkpoint. The
backward then walks the layers from the last to the first: it rebuilds one layer's graph from that layer's checkpoint
and back-propagates through it at once, so at most one layer's activations are alive at a time. This is Megatron-LM's
uniform recomputation with one layer per checkpoint and torchtitan's per-block full activation checkpointing (Chen et
al., arXiv 1604.06174, with one layer per segment; GPipe §2.3 rebuilds whole stages instead, which would hold a
stage's activations at once). ``sim.cost.ledger`` predicts exactly this: every layer's input kept from F to the
backward, and one layer rebuilt at a time.

Since the rebuild runs inside the backward, the plan's R op cannot start before the output gradient is there
(``sim.plan.lower.add_send_recv`` makes it wait like the backward). The R op itself does nothing in the executor; the
backward times its rebuild segments (:class:`RebuildTime`), and the interpreter draws their sum as R's span right
before the backward's, which is how the simulator draws the same work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Layer", "RebuildTime", "checkpointed_forward", "rebuild_and_backward"]

#: One layer of a stage as the executor calls it: its input tensor to its output tensor.
Layer = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class RebuildTime:
    """Where the seconds of one backward with per-layer rebuilding went.

    Attributes:
        rebuild_s: wall time of the rebuild segments (the R work), their tensor-parallel collectives included (s).
        rebuild_collective_s: the part of ``rebuild_s`` spent inside tensor-parallel collectives (s).
        backward_collective_s: seconds the backward segments spent inside tensor-parallel collectives (s).
    """

    rebuild_s: float
    rebuild_collective_s: float
    backward_collective_s: float


def checkpointed_forward(layers: Sequence[Layer], x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Run ``layers`` in order without an autograd graph, keeping each layer's input.

    Args:
        layers: the stage's layers in order.
        x: the stage input.

    Returns:
        The last layer's output and the list of checkpoints, one per layer (the first is ``x`` itself).
    """
    checkpoints: list[Tensor] = []
    with torch.no_grad():
        for layer in layers:
            checkpoints.append(x)
            x = layer(x)
    return x, checkpoints


def rebuild_and_backward(layers: Sequence[Layer], checkpoints: list[Tensor | None], output_gradient: Tensor | None,
                         *, head: Callable[[Tensor], Tensor] | None = None, sync: Callable[[], None],
                         take_collective_seconds: Callable[[], float]) -> tuple[Tensor | None, RebuildTime]:
    """Back-propagate through ``layers``, rebuilding each from its checkpoint right before its own backward.

    Args:
        layers: the same layers :func:`checkpointed_forward` ran, in order (under weight stashing, bound to the same
            weight version).
        checkpoints: what :func:`checkpointed_forward` kept; each entry is dropped (set to ``None``) once its layer's
            backward is done, so the checkpoints go as the backward passes them.
        output_gradient: the gradient of the last layer's output, or ``None`` when ``head`` makes it a scalar loss.
        head: applied to the last layer's rebuilt output to give the scalar to differentiate (the last stage's loss,
            already divided by its scale).
        sync: waits for the device (CUDA) so that the clock reads the end of the work, not of its launch.
        take_collective_seconds: returns and restarts the tensor-parallel collectives' time count (s).

    Returns:
        The gradient of the stage input (``None`` when the input is not floating point, e.g. token ids), and the
        split of the time between rebuilding and back-propagating.
    """
    gradient = output_gradient
    rebuild_s = rebuild_collective_s = backward_collective_s = 0.0
    for index in reversed(range(len(layers))):
        checkpoint = checkpoints[index]
        assert checkpoint is not None, f"layer {index}'s checkpoint was already consumed"
        backward_collective_s += take_collective_seconds()
        start = time.perf_counter()
        leaf = checkpoint.detach().requires_grad_(checkpoint.is_floating_point())
        with torch.enable_grad():
            output = layers[index](leaf)
            if head is not None and index == len(layers) - 1:
                output = head(output)
        sync()
        rebuild_s += time.perf_counter() - start
        rebuild_collective_s += take_collective_seconds()
        torch.autograd.backward(output, gradient)
        del output
        checkpoints[index] = None
        gradient = leaf.grad if leaf.requires_grad else None
    backward_collective_s += take_collective_seconds()
    return gradient, RebuildTime(rebuild_s, rebuild_collective_s, backward_collective_s)
