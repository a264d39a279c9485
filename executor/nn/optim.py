"""The optimizers the executor, the profiler and the single-process reference all build the same way.

One factory, so that a stage's OPT_STEP in a pipeline run, the reference trainer the tests compare it with, and the
per-layer ``opt_s`` that ``profiles.measure`` times are the same update rule with the same hyper-parameters.

* ``adam``: Adam (Kingma & Ba 2015) with PyTorch's defaults except the learning rate; its state is what the
  simulator's memory model budgets (two fp32 moments per parameter, ZeRO §3.1).
* ``sgd``: plain SGD without momentum, the cheapest update and the tightest numerical oracle.

Why not ``torch.optim.Adam``/``SGD`` themselves: ``torch.optim.Optimizer`` imports ``torch._dynamo`` when it adds
a parameter group and on every ``step`` (its graph-break guards), which costs each executor worker process about
2.2–2.5 s of CPU for a compiler the executor never uses. :class:`Adam` and :class:`SGD` here keep the part of the
``Optimizer`` class the executor uses (one parameter group, ``state``, ``step``, ``zero_grad``, a checkpoint's
``state_dict`` and ``load_state_dict``) and call torch's
own functional updates ``torch.optim.adam.adam`` / ``torch.optim.sgd.sgd`` with exactly the arguments
``torch.optim.Adam``/``SGD(foreach=False)`` pass, so the numbers are bitwise PyTorch's and ``state[p]`` is the same
dict (``step``, ``exp_avg``, ``exp_avg_sq`` for Adam; ``momentum_buffer`` for SGD with momentum; nothing for plain
SGD). Those functional updates do not import ``torch._dynamo`` (``tests/executor/nn/test_optim.py`` checks both).

Both use PyTorch's single-tensor ``for``-loop implementation (``foreach=False``): its arithmetic per parameter does
not depend on which other parameters share the optimizer, so a stage's update is bitwise the same computation as
the whole model's update of those parameters (a multi-tensor kernel may group tensors differently).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

from sim.core.errors import SpecError

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "Optimizer", "Adam", "SGD", "make_optimizer"]

OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
#: Default learning rate per optimizer: small enough that a few steps on random data stay finite.
DEFAULT_LR: dict[str, float] = {"adam": 1e-3, "sgd": 1e-2}


class Optimizer:
    """What the executor uses of ``torch.optim.Optimizer``: one parameter group, per-parameter state, ``zero_grad``.

    Attributes:
        param_groups: one dict, ``params`` (the tensors, in the order given) plus the hyper-parameters, which
            :meth:`step` reads each call (so a changed ``lr`` takes effect as in PyTorch).
        state: parameter → its state dict, a ``defaultdict(dict)`` like PyTorch's; entries appear on a parameter's
            first step with a gradient. Callers may pop and put back entries (``executor.csp.offload`` does).
        defaults: the hyper-parameters the optimizer was built with.
    """

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any]) -> None:
        if isinstance(params, (Tensor, set)):
            raise TypeError(f"params must be an ordered iterable of tensors, got {type(params).__name__}")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize tensors, got {type(p).__name__}")
            if not (p.is_leaf or p.retains_grad):
                raise ValueError("can't optimize a non-leaf Tensor")
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = [{"params": params, **defaults}]
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (``set_to_none``) or zero it in place, as ``torch.optim`` does."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The hyper-parameters and every parameter's state, parameters by position (as ``torch.optim`` keys them),
        tensors copied to the CPU: what a checkpoint keeps (``executor.checkpoint``)."""
        group = self.param_groups[0]
        position = {id(p): i for i, p in enumerate(group["params"])}
        state = {position[id(p)]: {key: value.detach().cpu().clone() if isinstance(value, Tensor) else value
                                   for key, value in entry.items()}
                 for p, entry in self.state.items()}
        return {"state": state, "hyper": {key: value for key, value in group.items() if key != "params"}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Put :meth:`state_dict`'s hyper-parameters and state back, each tensor on its parameter's device.

        Raises:
            ValueError: state for a parameter position this optimizer does not have.
        """
        group = self.param_groups[0]
        params = group["params"]
        if any(not 0 <= int(i) < len(params) for i in saved["state"]):
            raise ValueError(f"the saved optimizer state names parameter positions {sorted(saved['state'])}; this "
                             f"optimizer has {len(params)} parameters")
        group.update(saved["hyper"])
        self.state = defaultdict(dict)
        for i, entry in saved["state"].items():
            param = params[int(i)]
            self.state[param] = {key: value.clone().to(param.device) if isinstance(value, Tensor) else value
                                 for key, value in entry.items()}

    def step(self) -> None:
        raise NotImplementedError


def _scalar_dtype() -> torch.dtype:
    """The dtype of Adam's ``step`` counter: PyTorch keeps it float64 only under a float64 default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class Adam(Optimizer):
    """``torch.optim.Adam(params, lr, betas, eps, weight_decay, foreach=False)``, bitwise.

    Args:
        params: the tensors it updates (leaf tensors; ``nn.Parameter`` or a plain tensor with ``requires_grad``).
        lr: learning rate (dimensionless step scale).
        betas: decay rates of the first and second moment averages, each in [0, 1).
        eps: added to the denominator's square root.
        weight_decay: L2 penalty coefficient added to the gradient (not decoupled).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": (float(betas[0]), float(betas[1])), "eps": eps,
                                  "weight_decay": weight_decay})

    def step(self) -> None:
        """One Adam update of every parameter that has a gradient; others keep their values and state."""
        with torch.no_grad():
            for group in self.param_groups:
                params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
                has_complex = False
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("Adam does not support sparse gradients")
                    has_complex |= torch.is_complex(p)
                    state = self.state[p]
                    if not state:  # lazy, as PyTorch: the step counter on the CPU (neither capturable nor fused)
                        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    params.append(p)
                    grads.append(p.grad)
                    exp_avgs.append(state["exp_avg"])
                    exp_avg_sqs.append(state["exp_avg_sq"])
                    steps.append(state["step"])
                beta1, beta2 = group["betas"]
                adam_update(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, has_complex=has_complex,
                            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=False, foreach=False, capturable=False, differentiable=False,
                            fused=None, grad_scale=None, found_inf=None, decoupled_weight_decay=False)


class SGD(Optimizer):
    """``torch.optim.SGD(params, lr, momentum, weight_decay=weight_decay, foreach=False)``, bitwise.

    Args:
        params: the tensors it updates.
        lr: learning rate (dimensionless step scale).
        momentum: momentum factor; 0 keeps no state at all.
        weight_decay: L2 penalty coefficient added to the gradient.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def step(self) -> None:
        """One SGD update of every parameter that has a gradient."""
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                grads = [p.grad for p in params]
                momentum = group["momentum"]
                # PyTorch touches state only with momentum: plain SGD leaves ``state`` empty
                buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 else []
                sgd_update(params, grads, buffers, weight_decay=group["weight_decay"], momentum=momentum,
                           lr=group["lr"], dampening=0, nesterov=False, maximize=False,
                           has_sparse_grad=any(g.is_sparse for g in grads), foreach=False, fused=None,
                           grad_scale=None, found_inf=None)
                if momentum != 0:  # the functional update created the buffers of first steps in the list
                    for p, buffer in zip(params, buffers, strict=True):
                        self.state[p]["momentum_buffer"] = buffer


def make_optimizer(name: str, params: Iterable[Tensor], lr: float | None = None) -> Optimizer:
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
        return Adam(params, lr=rate)
    return SGD(params, lr=rate)
