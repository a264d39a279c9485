"""Per-layer memory of a model, measured the way a pipeline stage holds it: the memory side of a measured profile.

Each layer is run alone on its real input (the output of the layers before it on one seeded synthetic microbatch),
as :mod:`profiles.layer_timing` times it, while :class:`executor.memory.StorageCounter` counts the bytes of live
tensor storages operator by operator. Three figures per layer, bytes for one microbatch of the measured size:

* ``retained_bytes``: what the forward leaves allocated until the backward: its output and every tensor autograd
  saved for the backward, the layer's input excluded (it belongs to the layer before, or to the stage's input) —
  the measured counterpart of ``Layer.saved_bytes`` (``sim.models.graph``). The last layer's forward includes the
  loss, as in the executor.
* ``forward_transient_bytes``: the most the forward held above its starting level beyond what it retains (temporaries
  freed before it returns).
* ``backward_transient_bytes``: the most the backward holds above the level it starts from, with the weight
  gradients already allocated (they are the ledger's gradient buffers, not the backward's): activation gradients,
  the input gradient a stage sends upstream, the temporaries that are added into the weight gradients.
* ``first_backward_bytes``: the same for a backward that finds no weight gradient (a stage's first after an
  update, where gradients live per step), the gradients it makes included.
* ``input_backward_bytes`` and ``weight_backward_bytes``: with the backward split into I and W, the most an I, and
  a W, holds above its starting level.
* ``deferred_bytes``: with the backward split into I and W (zero bubble; ``executor.nn.split_backward``), what the I
  op leaves for its W once its activations are gone: the inputs of the weight GEMMs and their output gradients.

and its training state as run: ``param_bytes``, ``gradient_bytes`` (after a backward) and ``optimizer_bytes`` (the
optimizer's state after one step: Adam's two moments and its step counters), and of the gradients those a split
backward's W makes (``deferred_gradient_bytes``: the weights of the linear and convolution layers).

What the counter cannot see (allocator rounding, kernel scratch, communication buffers) is not in these figures
either; ``executor.memory`` says what it counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.memory import StorageCounter, live_tensors
from executor.nn.optim import make_optimizer
from executor.nn.seeds import derive_seed
from executor.nn.split_backward import WeightGradStore, enable_split_backward
from profiles.layer_inputs import layers_on_inputs
from sim.cost.profile import LayerMemory

__all__ = ["measure_layer_memory"]


def measure_layer_memory(spec: str, *, microbatch_size: int = 1, optimizer: str = "adam", seed: int = 0,
                         device: torch.device | str = "cpu", tp: int = 1) -> tuple[LayerMemory, ...]:
    """Measure every layer of ``spec`` on ``device`` (module docstring for what each figure holds), in layer order;
    with ``tp`` > 1 one tensor-parallel shard of each (:mod:`profiles.layer_inputs`).

    Raises:
        SpecError: an invalid spec, a model without a torch implementation, or an unknown optimizer.
    """
    device = torch.device(device)
    model = layers_on_inputs(spec, microbatch_size=microbatch_size, seed=seed, device=device, tp=tp)
    layers, layer_inputs, targets, make_loss = model.layers, model.inputs, model.targets, model.loss
    last = len(layers) - 1
    measured = []
    for i, (layer, x_in) in enumerate(zip(layers, layer_inputs)):
        x = x_in.detach().clone().requires_grad_(i > 0)  # a stage computes the gradient it sends upstream
        grad_output = None
        if i < last:
            with torch.no_grad():
                shape = layer(x).shape
            generator = torch.Generator().manual_seed(derive_seed("grad_output", seed, i))
            grad_output = torch.randn(shape, generator=generator).to(device)

        def forward(layer: torch.nn.Module = layer, x: torch.Tensor = x, loss: bool = i == last) -> torch.Tensor:
            out = layer(x)
            return make_loss(out, targets) if loss else out

        first_backward = _first_backward_bytes(layer, forward, x, grad_output)
        torch.autograd.backward(forward(), grad_output)  # the weight gradients exist, as after a first microbatch
        x.grad = None
        counter = StorageCounter(device.type)
        counter.track(live_tensors())
        with counter:
            start = counter.live_bytes
            counter.reset_peak()
            out = forward()
            retained = counter.live_bytes - start
            forward_transient = counter.peak_bytes - start - retained
            counter.reset_peak()
            level = counter.live_bytes
            torch.autograd.backward(out, grad_output)
            backward_transient = counter.peak_bytes - level
            del out
        input_backward, weight_backward, deferred = _split_backward_bytes(layer, forward, x, grad_output)
        params = [p for p in layer.parameters() if p.requires_grad]
        gradients = sum(_nbytes(p.grad) for p in params)
        state = 0
        if params:
            step = make_optimizer(optimizer, params)
            step.step()
            state = sum(_nbytes(value) for entry in step.state.values() for value in entry.values())
        with torch.no_grad():
            output = _nbytes(layer(x))
        gemm_gradients = sum(_nbytes(module.weight.grad) for module in layer.modules()
                             if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)))
        measured.append(LayerMemory(output, retained, forward_transient, backward_transient, first_backward,
                                    input_backward, weight_backward, deferred,
                                    sum(_nbytes(p) for p in layer.parameters()), gradients,
                                    gemm_gradients, state))
        layer.zero_grad(set_to_none=True)
    return tuple(measured)


def _first_backward_bytes(layer: torch.nn.Module, forward: Callable[[], torch.Tensor], x: torch.Tensor,
                          grad_output: torch.Tensor | None) -> int:
    """The most a backward of ``layer`` holds above its starting level when no weight gradient exists yet (a stage's
    first backward after an update), the gradients it makes included. Autograd then makes each gradient buffer from
    the computed gradient instead of adding a temporary into it, so this is not ``backward_transient_bytes`` plus the
    gradients."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    counter = StorageCounter(x.device.type)
    counter.track(live_tensors())
    with counter:
        out = forward()
        counter.reset_peak()
        level = counter.live_bytes
        torch.autograd.backward(out, grad_output)
        peak = counter.peak_bytes - level
        del out
    x.grad = None
    return peak


def _split_backward_bytes(layer: torch.nn.Module, forward: Callable[[], torch.Tensor], x: torch.Tensor,
                          grad_output: torch.Tensor | None) -> tuple[int, int, int]:
    """``(the most an I op of layer holds above its starting level, the same for its W, the bytes the I leaves for
    the W)``: the last is what is alive after I (the forward's graph gone) and freed by W. The layer is run split
    once first, so that every gradient buffer exists and W only adds into it; the split is undone after (the
    layer's modules get their class's forward back)."""
    store = WeightGradStore()
    split = [module for module in layer.modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))]
    enable_split_backward(layer, store)
    try:
        for key in ((0, 0), (0, 1)):
            counter = StorageCounter(x.device.type)
            counter.track(live_tensors())
            with counter:  # the forward too: its saved tensors are held from C++, out of the tracker's sight
                out = forward()
                counter.reset_peak()
                level = counter.live_bytes
                store.begin(key)
                torch.autograd.backward(out, grad_output)
                store.end()
                input_backward = counter.peak_bytes - level
                del out
                x.grad = None
                after_input = counter.live_bytes
                counter.reset_peak()
                store.flush(key)
                weight_backward = counter.peak_bytes - after_input
                after_weight = counter.live_bytes
    finally:
        for module in split:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_weight_grad_store", None)
    return input_backward, weight_backward, after_input - after_weight


def _nbytes(value: object) -> int:
    """Bytes of a tensor (0 for anything else: a missing gradient, an optimizer's plain-number state)."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
