"""Running a PARTIME stream plan for real (``weight_policy = "stream"``; ``sim.schedules.partime``).

:class:`PartimeInterpreter` is the interpreter with PARTIME's three differences:

* **The backward runs through the stage's current forward.** B(v, g) carries the gradient of frame g, produced by
  stage v + 1 at the step before; it back-propagates through the graph of the newest forward of stage v, frame
  :func:`sim.schedules.partime.partime_inputs` names (the function the simulator uses too). A forward no gradient came
  for (a warm-up step's) is dropped when the next forward comes: a stage keeps one frame.
* **The drain recomputes.** After the last frame, a B with no forward in its step runs through a new forward of the
  stage's last input under the weights as they are now: R(v, g) re-runs it (the autograd graph of the old forward
  was consumed by the previous backward, and the weights it saved have been updated in place since).
* **An update after every backward, with the loss as is.** Each frame is a step of online SGD: the last stage
  back-propagates its frame's loss undivided, and OPT_STEP follows every B.

The weights after every step are those of :func:`executor.partime.partime_reference.partime` on the same frames,
bitwise (``tests/executor/partime/test_partime_run.py``). :func:`partime_frames` makes the frames: ``cnn`` models read
the seeded smooth video of :mod:`executor.partime.video` (iteration k continues the stream at frame k · T, so a run of
several iterations is one stream), other models a seeded synthetic batch per frame.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from executor.interpreter import RankInterpreter
from executor.nn.stages import synthetic_batch
from executor.partime.video import VideoSpec, frame
from sim.core.errors import SpecError
from sim.core.spec import parse_spec
from sim.ir.plan import Op, OpKind, Plan
from sim.models import build_model
from sim.schedules.partime import partime_inputs

__all__ = ["PartimeInterpreter", "partime_frames", "video_spec", "VIDEO_DRIFT"]

#: Phase advance of the synthetic video per frame, radians (the source's default: consecutive frames differ by
#: about 5 %, a slowly moving scene).
VIDEO_DRIFT = 0.05


class PartimeInterpreter(RankInterpreter):
    """One rank of a stream plan (module docstring); the arguments are :class:`RankInterpreter`'s."""

    def __init__(self, plan: Plan, rank: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(plan, rank, *args, **kwargs)
        self.current_of = partime_inputs(plan)
        self.loss_scale = 1
        self.last_input: dict[int, Tensor] = {}
        self.fps = plan.option("fps")

    def _recomputed_pairs(self) -> set[tuple[int, int]]:
        # Every R of a stream is the drain's, which runs a new forward of the kept input: no F runs without its graph,
        # as the interpreter's recomputation would make it.
        return set()

    def run_iteration(self, inputs: Any, targets: Any) -> Any:
        self.started = time.perf_counter()  # frame f of the iteration arrives f / fps after this
        return super().run_iteration(inputs, targets)

    def _wait_receives(self, op: Op) -> None:
        # A live source (the plan's fps): the first stage's forward of frame f waits until the frame arrives. The
        # wait comes before the op's span starts, as the simulator paces it (sim.engine.simpy_engine).
        if self.fps and op.kind is OpKind.F and op.vstage == 0:
            delay = self.started + op.mb / self.fps - time.perf_counter()  # type: ignore[operator]
            if delay > 0:
                time.sleep(delay)
        super()._wait_receives(op)

    def _forward(self, op: Op) -> None:
        v = op.vstage
        for key in [key for key in self.activations if key[0] == v]:
            del self.activations[key]  # a forward no gradient came for: the stage keeps one frame
        super()._forward(op)
        self.last_input[v] = self.activations[(v, op.mb)][0]  # type: ignore[index]

    def _recompute(self, op: Op) -> None:
        v, mb = op.vstage, op.mb
        assert mb is not None
        current = self.current_of[(v, mb)]
        x = self.last_input[v].detach()
        if v > 0:
            x.requires_grad_(True)
        self.activations[(v, current)] = (x, self._stage_forward(v, current, x, first=False))

    def _forward_of(self, v: int, mb: int) -> tuple[int, int]:
        return v, self.current_of[(v, mb)]


def video_spec(plan: Plan, seed: int) -> VideoSpec | None:
    """The synthetic video of a ``cnn`` stream plan (frames of its size, targets of its features), else ``None``.

    Raises:
        SpecError: a ``cnn`` stream with more than one sample per frame (a video frame is one image).
    """
    name, values = parse_spec(build_model(plan.model).spec)
    if name != "cnn":
        return None
    if plan.microbatch_size != 1:
        raise SpecError(f"a cnn stream learns from one frame at a time; --microbatch-size {plan.microbatch_size} "
                        f"would make each frame a batch")
    return VideoSpec(size=int(values["size"]), features=int(values["features"]), seed=seed, drift=VIDEO_DRIFT)


def partime_frames(plan: Plan, seed: int, iteration: int) -> list[tuple[Tensor, Tensor]]:
    """The frames of ``iteration``: frames ``iteration · T .. (iteration + 1) · T − 1`` of the stream, each
    ``(input, target)`` on the CPU."""
    spec = video_spec(plan, seed)
    first = iteration * plan.num_microbatches
    if spec is None:
        return [synthetic_batch(plan.model, plan.microbatch_size, seed=seed, index=first + j)
                for j in range(plan.num_microbatches)]
    with torch.no_grad():
        return [frame(spec, first + j) for j in range(plan.num_microbatches)]
