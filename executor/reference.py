"""Single-process training of the same model on the same data: the oracle a pipeline run must reproduce.

A synchronous pipeline (GPipe, 1F1B with a flush) is only a reordering of the arithmetic of plain mini-batch
training: every microbatch's forward and backward with the weights of the step, gradients summed over the
microbatches, one optimizer step (GPipe, Huang et al. 2019 §2.2; PipeDream-Flush, Narayanan et al. 2021 §2.2). This
module is that plain training, written as directly as possible and sharing nothing with the interpreter but the
modules, the data and the optimizer factory, so that agreeing with it means the interpreter is right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from executor.modules import build_layers, loss_fn, synthetic_batch
from executor.optim import make_optimizer

__all__ = ["ReferenceResult", "train_reference"]


@dataclass(frozen=True)
class ReferenceResult:
    """What single-process training ended with.

    Attributes:
        state: parameter name → tensor, named as in the executor's stage state dicts (``layers.<layer>.<param>``).
        losses: per step, the loss of each microbatch, in microbatch order.
    """

    state: dict[str, Tensor]
    losses: tuple[tuple[float, ...], ...]


def train_reference(spec: str, *, steps: int, num_microbatches: int, microbatch_size: int, seed: int = 0,
                    data_seed: int = 0, optimizer: str = "adam", lr: float | None = None) -> ReferenceResult:
    """Train ``spec`` for ``steps`` steps of ``num_microbatches`` microbatches each, in one process.

    Step ``k`` uses microbatches ``k * num_microbatches + j`` of :func:`executor.modules.synthetic_batch`, as the
    executor does. Each microbatch's loss is divided by ``num_microbatches`` before its backward, so the accumulated
    gradient is the mean over the step's samples.

    Args:
        spec: model spec.
        steps: optimizer steps, >= 1.
        num_microbatches: microbatches per step, >= 1.
        microbatch_size: samples per microbatch, >= 1.
        seed: parameter seed.
        data_seed: data seed.
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: learning rate (``None``: the optimizer's default).
    """
    layers = build_layers(spec, seed=seed)
    model = torch.nn.Sequential(*layers)
    names = [layer.name for layer in _graph_layers(spec)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = make_optimizer(optimizer, params, lr)
    loss = loss_fn(spec)
    losses = []
    for step in range(steps):
        step_losses = []
        for j in range(num_microbatches):
            inputs, targets = synthetic_batch(spec, microbatch_size, seed=data_seed, index=step * num_microbatches + j)
            value = loss(model(inputs), targets)
            (value / num_microbatches).backward()
            step_losses.append(float(value.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tuple(step_losses))
    state = {f"layers.{names[i]}.{key}": tensor.detach().clone()
             for i, layer in enumerate(layers) for key, tensor in layer.state_dict().items()}
    return ReferenceResult(state, tuple(losses))


def _graph_layers(spec: str):
    from sim.models import build_model

    return build_model(spec).layers
