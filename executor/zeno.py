"""Zeno's suspicion-based aggregation of the data-parallel gradients (``executor.run --aggregate zeno:B[:RHO]``; Xie,
Koyejo and Gupta, "Zeno: Distributed Stochastic Gradient Descent with Suspicion-based Fault-tolerance", ICML 2019,
arXiv 1805.10032).

Instead of averaging the D replicas' gradients, every replica receives all D of them (an all-gather) and scores each
candidate u by its stochastic descendant score on a validation batch: the loss now minus the loss after a step of the
learning rate γ along it, less ρ‖u‖², ``f(x) − f(x − γ·u) − ρ·‖u‖²``; it drops the B lowest-scored and averages the
rest. A gradient that climbs the loss, or is noise, scores low. The validation batch is the synthetic batch of the
iteration from a stream of its own (:func:`validation_batch`), the same on every replica, and every replica scores
with the same weights on the same data, so all drop the same candidates and keep one set of weights.

What it costs per step: the all-gather of D gradients instead of one all-reduce, and D + 1 forward passes of the
model on the validation batch. It runs where each replica holds the whole model: data parallelism without a
pipeline, tensor or expert parallelism, or ZeRO (refused otherwise, ``executor.run``). γ is the optimizer's learning
rate (Zeno's analysis is for SGD).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from executor.nn.seeds import derive_seed
from executor.nn.stages import synthetic_batch
from sim.core.errors import SpecError

__all__ = ["ZenoRule", "parse_aggregate", "validation_batch", "scores", "keep", "ZenoAggregator"]


@dataclass(frozen=True)
class ZenoRule:
    """``zeno:B[:RHO]``: drop the B lowest-scored of the D gradients; ρ weights the magnitude penalty."""

    drop: int
    rho: float = 0.0

    def describe(self) -> str:
        return f"zeno:{self.drop}:{self.rho:g}"


def parse_aggregate(text: str, replicas: int) -> ZenoRule | None:
    """``mean`` (``None``) or ``zeno:B[:RHO]``.

    Raises:
        SpecError: another spelling, B outside ``1..replicas-1``, or ρ not a finite number >= 0.
    """
    if text == "mean":
        return None
    parts = text.split(":")
    if parts[0] != "zeno" or len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SpecError(f"--aggregate takes mean or zeno:B[:RHO] (B replicas dropped each step), got {text!r}")
    drop = int(parts[1])
    if not 1 <= drop < replicas:
        raise SpecError(f"--aggregate {text}: B must be 1..{replicas - 1} (at least one of the {replicas} gradients "
                        f"is kept)")
    try:
        rho = float(parts[2]) if len(parts) == 3 else 0.0
    except ValueError:
        rho = math.nan
    if not math.isfinite(rho) or rho < 0:
        raise SpecError(f"--aggregate {text}: RHO must be a finite number >= 0")
    return ZenoRule(drop, rho)


def validation_batch(spec: str, samples: int, data_seed: int, step: int) -> tuple[Tensor, Tensor]:
    """The validation batch of optimizer step ``step``: a synthetic batch from a stream apart from the training
    data's (the seed mixed with Zeno's tag)."""
    return synthetic_batch(spec, samples, seed=derive_seed("zeno", data_seed, 0), index=step)


def scores(evaluate: Callable[[dict[str, Tensor] | None], float], named: list[tuple[str, nn.Parameter]],
           candidates: list[list[Tensor]], lr: float, rho: float) -> list[float]:
    """Each candidate's stochastic descendant score (module docstring). ``evaluate(None)`` is the validation loss with
    the current weights, ``evaluate(weights)`` with ``weights`` (by parameter name) instead; ``candidates[i]`` holds
    one tensor per parameter of ``named``."""
    with torch.no_grad():
        now = evaluate(None)
        result = []
        for candidate in candidates:
            stepped = {name: p - lr * u for (name, p), u in zip(named, candidate, strict=True)}
            penalty = rho * math.fsum(float(u.double().pow(2).sum()) for u in candidate)
            result.append(now - evaluate(stepped) - penalty)
    return result


def keep(values: list[float], drop: int) -> list[int]:
    """The indices of the ``len(values) − drop`` highest scores, in index order (ties: the lower index kept)."""
    ranked = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return sorted(ranked[:len(values) - drop])


class ZenoAggregator:
    """One process's Zeno: the model it scores with and the rule (module docstring).

    Args:
        model: the whole model (the one vstage of a data-parallel plan).
        rule: B and ρ.
        lr: γ, the learning rate.
        spec, samples, data_seed: what :func:`validation_batch` draws.
        loss: ``(model output, targets) -> scalar``, the model's loss.
    """

    def __init__(self, model: nn.Module, rule: ZenoRule, lr: float, spec: str, samples: int, data_seed: int,
                 loss: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.model, self.rule, self.lr = model, rule, lr
        self.spec, self.samples, self.data_seed, self.loss = spec, samples, data_seed, loss
        self.step = 0

    def aggregate(self, named: list[tuple[str, nn.Parameter]], candidates: list[list[Tensor]]) -> list[Tensor]:
        """The mean of the kept candidates, one tensor per parameter of ``named`` (the model's, by name)."""
        inputs, targets = validation_batch(self.spec, self.samples, self.data_seed, self.step)
        device = named[0][1].device
        inputs, targets = inputs.to(device), targets.to(device)

        def evaluate(weights: dict[str, Tensor] | None) -> float:
            out = self.model(inputs) if weights is None else torch.func.functional_call(self.model, weights, (inputs,))
            return float(self.loss(out, targets))

        kept = keep(scores(evaluate, named, candidates, self.lr, self.rule.rho), self.rule.drop)
        self.step += 1
        mean = []
        for k in range(len(named)):
            total = candidates[kept[0]][k].clone()
            for i in kept[1:]:
                total = total + candidates[i][k]
            mean.append(total / len(kept))
        return mean
