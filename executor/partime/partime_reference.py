"""PARTIME's delayed-gradient update and exact online SGD, each in one process: the oracles of a stream run.

PARTIME (Meloni et al., ICMLA 2022) learns online from a stream with the network split into N stages and one weight
version: at every step each stage runs the forward of the newest input it has and the backward of the gradient that has
just arrived from the next stage, through its *current* forward (so with its current input, though that gradient came
from an older frame), and updates its weights at once. :func:`partime` is that rule, written as plainly as possible so
that the pipelined executor can be tested bitwise against it; :func:`exact_online_sgd` is the sequential learner it
approximates.

The rule, exactly. Stages s = 0 .. N-1, frames f = 0 .. T-1, steps t = 0 .. T + 2(N-1) - 1. Within a step every
stage reads only what the previous step produced (the outputs and input-gradients of step t-1), so the order in
which stages are visited inside a step changes no number. At step t, stage s does, in this order:

1. **F** if ``0 <= t - s < T`` (frame f = t - s): its input is x_f for s = 0, and for s > 0 the output stage s-1
   produced at step t-1, detached and marked ``requires_grad_(True)``. It runs its forward with its current
   weights (those left by step t-1) and keeps the graph and the input; a newer F replaces the kept one.
2. **B** if ``0 <= g < T`` with ``g = t - 2(N-1) + s`` (the frame whose gradient arrives now):

   * s = N-1 (there g = f, its own frame): backward of ``loss(output, y_g)`` through this step's forward. That
     loss, taken before the update, is frame g's **online loss**.
   * s < N-1: ``torch.autograd.backward(output, upstream)`` through the kept forward, where ``upstream`` is the
     gradient of its input that stage s+1 produced at step t-1 (it belongs to frame g, while the kept forward is of
     frame t - s: the gradient lags ``2(N-1-s)`` frames behind the input it is applied with).
   * If the stage ran no F at this step (the drain: ``t - s >= T``), it first re-runs its forward on its last input
     (frame T-1's) with its current weights, an **R** (recompute), and backs through that.

   For s > 0 the input's ``.grad`` is what stage s-1 receives at step t+1. Then ``optimizer.step()`` and
   ``optimizer.zero_grad(set_to_none=True)`` on this stage: one weight version, updated at every B.
3. Warm-up steps (t < 2(N-1) - s) have an F and no B.

Counts per stage: T forwards, T backwards, ``min(T, 2(N-1-s))`` recomputes. With N = 1 every step is one F and one
B of the same frame: plain online SGD, which is why :func:`partime` with one stage equals :func:`exact_online_sgd`
bit for bit (the same operations in the same order).

:func:`exact_online_sgd`: for each frame in order, the forward through all stages (one autograd graph), the loss,
one backward, then ``step`` and ``zero_grad(set_to_none=True)`` on every stage, stage 0 first. The online loss is
the frame's loss before its update, as in :func:`partime`.

Observing the weights: both take ``on_step(t, stages)``, called after every step's updates (after every frame for
:func:`exact_online_sgd`), so a test can compare the weights after every step. Nothing here reads the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from sim.core.errors import SpecError

__all__ = ["OptimizerLike", "PartimeResult", "partime", "exact_online_sgd", "steps_of", "recomputes_of"]


class OptimizerLike(Protocol):
    """What the stream trainers use of an optimizer: ``torch.optim.SGD`` or :class:`executor.nn.optim.SGD`."""

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


Frames = Callable[[int], tuple[Tensor, Tensor]]
Loss = Callable[[Tensor, Tensor], Tensor]
OnStep = Callable[[int, Sequence[nn.Module]], None]


@dataclass(frozen=True)
class PartimeResult:
    """What an online run did.

    Attributes:
        losses: per frame, its online loss (fp32 value as a float): the last stage's loss of that frame, taken
            before the update that frame's gradient makes.
        steps: steps run (T + 2(N-1) for :func:`partime`, T for :func:`exact_online_sgd`).
        forwards: per stage, the forwards of new frames it ran (F).
        backwards: per stage, the backwards it ran, each followed by an update (B).
        recomputes: per stage, the forwards it re-ran on its last input in the drain (R).
    """

    losses: tuple[float, ...]
    steps: int
    forwards: tuple[int, ...]
    backwards: tuple[int, ...]
    recomputes: tuple[int, ...]


def steps_of(num_stages: int, num_frames: int) -> int:
    """Steps of a PARTIME run: T + 2(N-1) (the last frame enters stage 0 at step T-1; its gradient reaches stage 0
    2(N-1) steps later)."""
    return num_frames + 2 * (num_stages - 1)


def recomputes_of(num_stages: int, num_frames: int, stage: int) -> int:
    """Recomputes (R) of ``stage`` in a PARTIME run: its B steps after its last F, ``min(T, 2(N-1-s))``."""
    return min(num_frames, 2 * (num_stages - 1 - stage))


def _check(stages: Sequence[nn.Module], num_frames: int) -> None:
    if len(stages) < 1:
        raise SpecError(f"a stream run needs at least one stage, got {len(stages)}")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise SpecError(f"num_frames must be an int >= 1, got {num_frames!r}")


def partime(stages: Sequence[nn.Module], make_optimizer: Callable[[nn.Module], OptimizerLike], frames: Frames,
            num_frames: int, loss: Loss, *, on_step: OnStep | None = None) -> PartimeResult:
    """Run PARTIME's rule (module docstring) on ``stages`` over frames ``0 .. num_frames - 1``, in place.

    Args:
        stages: N >= 1 modules; stage s maps stage s-1's output (stage 0: x_f) to its own output. Trained in place.
        make_optimizer: called once per stage, in order, with the stage; e.g.
            ``lambda stage: torch.optim.SGD(stage.parameters(), lr=0.01)``.
        frames: ``f -> (x_f, y_f)``; called once per frame, in order.
        num_frames: T >= 1.
        loss: ``(last stage's output, y) -> scalar``, e.g. ``torch.nn.functional.mse_loss``.
        on_step: called with ``(t, stages)`` after every step's updates.

    Returns:
        The online losses and the counts of F, B and R per stage.

    Raises:
        SpecError: no stage, or ``num_frames`` < 1.
    """
    _check(stages, num_frames)
    n = len(stages)
    optimizers = [make_optimizer(stage) for stage in stages]
    inputs: list[Tensor | None] = [None] * n  # per stage: the input of its newest F (kept for the drain's R)
    kept: list[Tensor | None] = [None] * n  # per stage: the output (and graph) of its newest F, until a B uses it
    outputs: list[Tensor | None] = [None] * n  # what each stage produced at the previous step
    gradients: list[Tensor | None] = [None] * n  # per stage s > 0: its input's gradient from the previous step
    targets: dict[int, Tensor] = {}  # y_f of the frames on the last stage's way, popped at their B
    losses: list[float] = [0.0] * num_frames
    forwards, backwards, recomputes = [0] * n, [0] * n, [0] * n
    steps = steps_of(n, num_frames)
    for t in range(steps):
        new_outputs: list[Tensor | None] = [None] * n
        new_gradients: list[Tensor | None] = [None] * n
        for s, stage in enumerate(stages):
            f = t - s
            ran_forward = 0 <= f < num_frames
            if ran_forward:
                if s == 0:
                    x, y = frames(f)
                    targets[f] = y
                else:
                    previous = outputs[s - 1]
                    assert previous is not None  # stage s-1 ran the F of frame f at step t-1
                    x = previous.detach().requires_grad_(True)
                output = stage(x)
                inputs[s], kept[s] = x, output
                new_outputs[s] = output
                forwards[s] += 1
            g = t - 2 * (n - 1) + s
            if not 0 <= g < num_frames:
                continue
            x = inputs[s]
            assert x is not None  # a B always follows the stage's first F
            if ran_forward:
                output = kept[s]
            else:  # drain: PARTIME's "current input" is the last one it had, through its current weights
                output = stage(x)
                recomputes[s] += 1
                # the previous R's gradient went to stage s-1; a fresh one, not accumulated into (and mutating) it
                x.grad = None
            assert output is not None
            kept[s] = None  # the graph is consumed by this backward
            if s == n - 1:
                value = loss(output, targets.pop(g))
                losses[g] = float(value.item())
                value.backward()
            else:
                upstream = gradients[s + 1]
                assert upstream is not None  # stage s+1 ran the B of frame g at step t-1
                torch.autograd.backward(output, upstream)
            if s > 0:
                new_gradients[s] = x.grad
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)
            backwards[s] += 1
        outputs, gradients = new_outputs, new_gradients
        if on_step is not None:
            on_step(t, stages)
    return PartimeResult(tuple(losses), steps, tuple(forwards), tuple(backwards), tuple(recomputes))


def exact_online_sgd(stages: Sequence[nn.Module], make_optimizer: Callable[[nn.Module], OptimizerLike],
                     frames: Frames, num_frames: int, loss: Loss, *,
                     on_step: OnStep | None = None) -> PartimeResult:
    """Sequential online SGD, the baseline PARTIME approximates: per frame, forward through every stage, loss,
    backward, update every stage (module docstring). Arguments, result and errors as :func:`partime`; ``on_step``
    is called with ``(f, stages)`` after frame f's updates."""
    _check(stages, num_frames)
    n = len(stages)
    optimizers = [make_optimizer(stage) for stage in stages]
    losses: list[float] = []
    for f in range(num_frames):
        x, y = frames(f)
        for stage in stages:
            x = stage(x)
        value = loss(x, y)
        losses.append(float(value.item()))
        value.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(f, stages)
    ones = (num_frames,) * n
    return PartimeResult(tuple(losses), num_frames, ones, ones, (0,) * n)
