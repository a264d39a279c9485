"""The backward split into I (input gradient) and W (weight gradient) that zero-bubble schedules need.

Zero Bubble (Qi et al., arXiv 2401.10241 §2) splits the backward of every matrix multiplication ``Y = X Wᵀ`` into
``dX = dY W`` — needed at once by the previous stage, so it is on the critical path — and ``dW = dYᵀ X``, which
nothing waits for until the optimizer step and can therefore fill a pipeline bubble. The split has to happen at the
level of the weight-bearing operations: an autograd ``backward`` restricted to the inputs still walks the whole
graph, so running autograd twice (once for inputs, once for weights) would cost two full backwards.

Here every ``nn.Linear`` and ``nn.Conv2d`` of a stage whose plan has I/W ops runs through an autograd function whose
backward always returns the input gradient (and the bias gradient, which is a cheap reduction), and either returns
the weight gradient too (a plain B) or, while a :class:`WeightGradStore` is collecting for an I op, files
``(weight, saved input, output gradient)`` and returns none. The W op later computes those weight gradients and
accumulates them into ``.grad`` exactly as autograd would. Parameters of other layers (embeddings, LayerNorm) get
their gradients during I: they are small, and ZB's own implementation treats them the same way (its
``WeightGradStore`` defers only the linear layers' weight GEMMs).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["WeightGradStore", "enable_split_backward"]


class WeightGradStore:
    """Weight-gradient work deferred by I ops, per ``(vstage, microbatch)``.

    While :meth:`collecting` is active for a key, the deferring layers file their weight-gradient work under it
    instead of computing it; :meth:`flush` computes and accumulates it (the W op).
    """

    def __init__(self) -> None:
        self._active: list[tuple[Any, ...]] | None = None
        self._pending: dict[tuple[int, int], list[tuple[Any, ...]]] = {}

    def begin(self, key: tuple[int, int]) -> None:
        """Start collecting for ``key`` (the I op of that vstage and microbatch)."""
        self._active = self._pending.setdefault(key, [])

    def end(self) -> None:
        """Stop collecting: later backwards compute their weight gradients at once."""
        self._active = None

    @property
    def deferring(self) -> list[tuple[Any, ...]] | None:
        """The list deferred work goes into now, or ``None`` (compute weight gradients immediately)."""
        return self._active

    def flush(self, key: tuple[int, int]) -> int:
        """Compute and accumulate every weight gradient deferred under ``key``; returns how many.

        Raises:
            KeyError: nothing was deferred under ``key`` (a W without its I).
        """
        work = self._pending.pop(key)
        # Outside autograd: the saved inputs are activations that require grad, so a recorded matmul would hang a
        # graph on every weight gradient, keeping its output gradient and input alive until the optimizer step
        # (measured: 5.2 MB per microbatch on a 4-block h256 stage, executor.memory).
        with torch.no_grad():
            self._accumulate(work)
        return len(work)

    @staticmethod
    def _accumulate(work: list[tuple[Any, ...]]) -> None:
        """Compute each deferred weight gradient and add it into its weight's ``.grad``."""
        for kind, weight, saved, grad_out, extra in work:
            if kind == "linear":
                grad = grad_out.reshape(-1, grad_out.shape[-1]).t() @ saved.reshape(-1, saved.shape[-1])
            else:  # conv2d; extra = (stride, padding, dilation, groups)
                stride, padding, dilation, groups = extra
                grad = torch.nn.grad.conv2d_weight(saved, weight.shape, grad_out, stride, padding, dilation, groups)
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad += grad  # in place, as autograd accumulates: no second gradient-sized buffer

    def __len__(self) -> int:
        return len(self._pending)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        deferred = ctx.store.deferring
        if deferred is not None:
            deferred.append(("linear", weight, x, grad_out, None))
            grad_weight = None
        else:
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_weight, grad_bias, None


class _SplitConv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore,
                extra: tuple[Any, ...]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias, ctx.extra = store, bias is not None, extra
        stride, padding, dilation, groups = extra
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.extra
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(x.shape, weight, grad_out, stride, padding, dilation, groups)
        grad_bias = grad_out.sum((0, 2, 3)) if ctx.has_bias else None
        deferred = ctx.store.deferring
        if deferred is not None:
            deferred.append(("conv2d", weight, x, grad_out, ctx.extra))
            grad_weight = None
        else:
            grad_weight = torch.nn.grad.conv2d_weight(x, weight.shape, grad_out, stride, padding, dilation, groups)
        return grad_x, grad_weight, grad_bias, None, None


def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return _SplitLinear.apply(x, self.weight, self.bias, self._weight_grad_store)


def _conv2d_forward(self: nn.Conv2d, x: Tensor) -> Tensor:
    if self.padding_mode != "zeros" or isinstance(self.padding, str):
        raise NotImplementedError("split backward supports zero padding given as numbers only")
    extra = (self.stride, self.padding, self.dilation, self.groups)
    return _SplitConv2d.apply(x, self.weight, self.bias, self._weight_grad_store, extra)


def enable_split_backward(module: nn.Module, store: WeightGradStore) -> int:
    """Route every ``nn.Linear`` and ``nn.Conv2d`` inside ``module`` through the deferring functions.

    The forward arithmetic is unchanged (``F.linear``/``F.conv2d``); only the backward learns to defer. Returns the
    number of layers rerouted.
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub._weight_grad_store = store  # type: ignore[assignment]
            sub.forward = types.MethodType(_linear_forward, sub)  # type: ignore[method-assign]
            count += 1
        elif isinstance(sub, nn.Conv2d):
            sub._weight_grad_store = store  # type: ignore[assignment]
            sub.forward = types.MethodType(_conv2d_forward, sub)  # type: ignore[method-assign]
            count += 1
    return count
