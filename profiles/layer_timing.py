"""Per-layer forward, backward and optimizer-step times of a model, measured the way a pipeline stage runs them.

Every layer is timed on its real input: one seeded synthetic microbatch is pushed through the layers first, and
layer i is then timed alone on the output of layers ``0 .. i-1``. Each layer behaves exactly as if it were a
pipeline stage of its own:

* forward runs with autograd recording, as in training;
* backward is ``torch.autograd.backward(output, grad_output)`` with a seeded random ``grad_output`` of the output's
  shape (what the next stage would send back); the input of every layer but the first requires grad, so the input
  gradient is computed as well as the weight gradients, like a stage that must send a gradient upstream. The first
  layer's input (token ids or images) needs no gradient, as in the executor;
* the last layer also computes the loss: the executor evaluates ``loss_fn`` inside the last stage's forward op and
  backpropagates from the loss in its backward op, so the last layer's ``fwd_s`` is layer + loss and its ``bwd_s``
  is ``loss.backward()``;
* the optimizer step is ``make_optimizer(name, layer.parameters()).step()`` with gradients present.

Each backward repeat re-runs the forward untimed first, because a backward consumes the graph its forward built.
Weight gradients accumulate across repeats, as they do across the microbatches of one pipeline iteration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from executor.nn.optim import make_optimizer
from executor.nn.seeds import derive_seed
from profiles.layer_inputs import layers_on_inputs

__all__ = ["LayerMeasurement", "time_layers", "median_time_s"]


@dataclass(frozen=True)
class LayerMeasurement:
    """Measured costs of one layer for one microbatch.

    Attributes:
        name: layer name, as in the ``LayerGraph``.
        fwd_s: median forward time in s (the last layer's includes the loss).
        bwd_s: median backward time in s, input and weight gradients (the last layer's starts from the loss).
        opt_s: median optimizer-step time of the layer's parameters in s; 0 for a layer without parameters.
        param_bytes: bytes of the layer's parameter tensors as measured (fp32 in the executor).
        activation_bytes: bytes of the layer's output tensor for the whole microbatch (the last layer's is the
            network output the loss reads, not the scalar loss).
    """

    name: str
    fwd_s: float
    bwd_s: float
    opt_s: float
    param_bytes: int
    activation_bytes: int


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` has finished its queued work (a no-op on CPU, which is synchronous)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def median_time_s(run: Callable[[Any], Any], *, warmup: int, repeats: int, sync: Callable[[], None],
                  setup: Callable[[], Any] | None = None) -> float:
    """Median wall time in s of ``run(setup())`` over ``repeats`` timed calls after ``warmup`` untimed ones.

    ``setup`` runs untimed before each call and its result is ``run``'s argument (``None`` without ``setup``).
    ``sync`` is called before starting and before stopping the clock, so asynchronous device work is counted in
    the call that queued it. ``run``'s result is dropped only after the clock stops, so freeing it (an autograd
    graph, for instance) is not counted.
    """
    times = []
    for k in range(warmup + repeats):
        arg = setup() if setup is not None else None
        sync()
        start = time.perf_counter()
        result = run(arg)
        sync()
        elapsed = time.perf_counter() - start
        del result, arg
        if k >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def time_layers(spec: str, *, microbatch_size: int = 1, optimizer: str = "adam", warmup: int = 3, repeats: int = 10,
                seed: int = 0, device: torch.device | str = "cpu", tp: int = 1) -> tuple[LayerMeasurement, ...]:
    """Time every layer of ``spec`` on ``device`` (module docstring for what each time contains).

    Args:
        spec: a model spec with a torch implementation (``gpt`` or ``cnn``).
        microbatch_size: samples per microbatch, >= 1.
        optimizer: ``"adam"`` or ``"sgd"`` (:mod:`executor.nn.optim`).
        warmup: untimed runs before the timed ones, >= 0.
        repeats: timed runs, >= 1; the median is kept.
        seed: seeds the weights, the synthetic microbatch and the output gradients.
        device: where to run, e.g. ``"cpu"`` or ``"cuda:0"``.
        tp: with > 1, time one tensor-parallel shard of each layer (:mod:`profiles.layer_inputs`).

    Returns:
        One :class:`LayerMeasurement` per graph layer, in graph order.

    Raises:
        SpecError: an invalid spec, a model without a torch implementation, or an unknown optimizer.
    """
    device = torch.device(device)
    sync = _synchronizer(device)
    # Each layer's real input: what the layers before it make of the microbatch. No graph is needed for these.
    model = layers_on_inputs(spec, microbatch_size=microbatch_size, seed=seed, device=device, tp=tp)
    graph, layers, layer_inputs, targets, make_loss = (model.graph, model.layers, model.inputs, model.targets,
                                                       model.loss)

    measured = []
    last = len(layers) - 1
    for i, (layer, x_in) in enumerate(zip(layers, layer_inputs)):
        x = x_in.detach()
        if i > 0:
            x.requires_grad_(True)  # a pipeline stage sends this gradient upstream, so its cost belongs here
        with torch.no_grad():
            out = layer(x)
        if i == last:
            grad_output = None  # backward starts from the scalar loss, like loss.backward()
        else:
            generator = torch.Generator(device="cpu").manual_seed(derive_seed("grad_output", seed, i))
            grad_output = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(device)
        fwd_s, bwd_s, opt_s = _time_layer(
            layer, x, loss=make_loss if i == last else None, targets=targets, grad_output=grad_output,
            optimizer=optimizer, warmup=warmup, repeats=repeats, sync=sync,
        )
        measured.append(LayerMeasurement(
            name=graph.layers[i].name,
            fwd_s=fwd_s,
            bwd_s=bwd_s,
            opt_s=opt_s,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            activation_bytes=out.numel() * out.element_size(),
        ))
        layer.zero_grad(set_to_none=True)  # free this layer's gradients before timing the next one
    return tuple(measured)


def _time_layer(layer: torch.nn.Module, x: Tensor, *, loss: Callable[[Tensor, Tensor], Tensor] | None,
                targets: Tensor, grad_output: Tensor | None, optimizer: str, warmup: int, repeats: int,
                sync: Callable[[], None]) -> tuple[float, float, float]:
    """``(fwd_s, bwd_s, opt_s)`` of one layer on input ``x``; ``loss`` is given for the last layer only."""

    def forward(_: object = None) -> Tensor:
        out = layer(x)
        return loss(out, targets) if loss is not None else out

    def fresh_forward() -> Tensor:
        x.grad = None  # every microbatch's input is a new tensor: its gradient never accumulates
        return forward()

    def backward(y: Tensor) -> None:
        torch.autograd.backward(y, grad_output)

    fwd_s = median_time_s(forward, warmup=warmup, repeats=repeats, sync=sync)
    bwd_s = median_time_s(backward, warmup=warmup, repeats=repeats, sync=sync, setup=fresh_forward)
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return fwd_s, bwd_s, 0.0
    # The first step creates Adam's moment buffers; the warm-up runs absorb it, so opt_s is a steady-state step.
    step = make_optimizer(optimizer, params).step
    opt_s = median_time_s(lambda _: step(), warmup=warmup, repeats=repeats, sync=sync)
    return fwd_s, bwd_s, opt_s
