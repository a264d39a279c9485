"""The optimizers the executor, the profiler and the single-process reference all build the same way.

One factory, so that a stage's OPT_STEP in a pipeline run, the reference trainer the tests compare it with, and the
per-layer ``opt_s`` that ``profiles.measure`` times are the same update rule with the same hyper-parameters.

* ``adam``: ``torch.optim.Adam`` (Kingma & Ba 2015) with PyTorch's defaults except the learning rate; its state is
  what the simulator's memory model budgets (two fp32 moments per parameter, ZeRO §3.1).
* ``sgd``: plain ``torch.optim.SGD`` without momentum, the cheapest update and the tightest numerical oracle.

Both use PyTorch's single-tensor ``for``-loop implementation (``foreach=False``): its arithmetic per parameter does
not depend on which other parameters share the optimizer, so a stage's update is bitwise the same computation as
the whole model's update of those parameters (a multi-tensor kernel may group tensors differently).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sim.core.errors import SpecError

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "make_optimizer"]

OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: Default learning rate per optimizer: small enough that a few steps on random data stay finite.
DEFAULT_LR: dict[str, float] = {"adam": 1e-3, "sgd": 1e-2}


def make_optimizer(name: str, params: Iterable[nn.Parameter], lr: float | None = None) -> torch.optim.Optimizer:
    """A fresh optimizer over ``params``.

    Args:
        name: ``"adam"`` or ``"sgd"``.
        params: the parameters it updates (one stage's, one layer's, or the whole model's).
        lr: learning rate; ``None`` takes :data:`DEFAULT_LR` of ``name``.

    Raises:
        SpecError: unknown ``name`` or a learning rate that is not a positive finite number.
    """
    if name not in OPTIMIZERS:
        raise SpecError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")
    rate = DEFAULT_LR[name] if lr is None else lr
    if not (isinstance(rate, (int, float)) and 0 < rate < float("inf")):
        raise SpecError(f"learning rate must be a positive number, got {rate!r}")
    params = list(params)
    if name == "adam":
        return torch.optim.Adam(params, lr=rate, foreach=False)
    return torch.optim.SGD(params, lr=rate, foreach=False)
