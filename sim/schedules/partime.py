"""PARTIME's online streaming pipeline (Meloni et al., ICMLA 2022; the talk in the project's seed notes): learning
from a live stream, one frame at a time, an update at every step.

A source delivers frames 0, 1, …, T − 1. The network is split into N stages, one per rank, with one weight
version each. At step t, stage s runs the forward of the newest input it has, frame ``t − s`` (stage 0 takes the
frame that just arrived, stage s the output stage s − 1 produced at step t − 1), and the backward of the gradient
that just arrived from stage s + 1, which belongs to frame ``g = t − 2(N − 1) + s``, and updates its weights at
once. The backward runs through the stage's *current* forward, although the gradient was produced by an older
frame: consecutive frames of a video differ little, and this keeps one set of activations and one weight version
per stage ("Gradients are computed using the current input, even if it is not the same that produced that
gradient"). On the last stage the two frames coincide: its loss and backward are exact. Frame f enters at step f,
its gradient reaches stage 0 at step f + 2(N − 1), so with every step equally long a frame is in the pipeline for
2N − 1 steps.

In the IR a frame is a microbatch of one sample: ``F(s, t − s)``, then ``B(s, g)`` labelled by the gradient's frame
(so the lowering's SEND_B → RECV_B edges carry exactly PARTIME's gradient flow), then ``OPT_STEP(s, g)`` (added by
the lowering, ``weight_policy = "stream"``). A warm-up step runs F alone (no gradient has arrived yet). The stream
ends after T frames; so that every frame's gradient reaches every stage, the plan drains: a drain step has B
without a new input, and the stage's current input is its last one, whose forward the weights have changed since,
so the step first recomputes it, ``R(s, g)`` (labelled like the B it serves). The drain is an artefact of a finite
plan; a live stream never reaches it. Which forward each B and R runs through is :func:`partime_inputs`, which the
simulator (activation memory: one frame per stage) and the executor both use.

::

    N=2, T=3 (U = OPT_STEP)
    step:    0    1          2          3          4
    rank 0:  F0   F1         F2 B0 U0   R1 B1 U1   R2 B2 U2
    rank 1:       F0 B0 U0   F1 B1 U1   F2 B2 U2
"""

from __future__ import annotations

from sim.ir.plan import Op, OpKind, Plan

__all__ = ["partime", "partime_inputs", "partime_steps"]


def partime_steps(num_stages: int, num_frames: int) -> int:
    """Steps of a stream plan: the T frames plus the 2(N − 1) steps that bring the last frame's gradient back."""
    return num_frames + 2 * (num_stages - 1)


def partime(num_stages: int, num_frames: int) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of PARTIME's stream over ``num_frames`` frames (module docstring); the updates come with lowering.

    Args:
        num_stages: pipeline stages N (= ranks), ≥ 1.
        num_frames: frames T, ≥ 1.

    Raises:
        ValueError: N or T < 1.
    """
    if num_stages < 1 or num_frames < 1:
        raise ValueError(f"a stream needs >= 1 stage and >= 1 frame, got {num_stages} and {num_frames}")
    programs = []
    for stage in range(num_stages):
        ops: list[Op] = []
        for step in range(partime_steps(num_stages, num_frames)):
            frame = step - stage
            gradient = step - 2 * (num_stages - 1) + stage
            if 0 <= frame < num_frames:
                ops.append(Op(OpKind.F, stage, frame))
            elif 0 <= gradient < num_frames:
                ops.append(Op(OpKind.R, stage, gradient))  # drain: the last input again, under today's weights
            if 0 <= gradient < num_frames:
                ops.append(Op(OpKind.B, stage, gradient))
        programs.append(tuple(ops))
    return tuple(programs)


def partime_inputs(plan: Plan) -> dict[tuple[int, int], int]:
    """For each B and R ``(vstage, frame)`` of a stream plan, the frame whose forward it runs through: the latest F of
    that vstage before it in program order (the stage's current input).

    Raises:
        ValueError: the plan is not a stream plan, or a B or R comes before any F of its vstage.
    """
    if plan.weight_policy != "stream":
        raise ValueError(f"stream inputs exist for stream plans, got weight policy {plan.weight_policy!r}")
    found: dict[tuple[int, int], int] = {}
    for program in plan.programs:
        current: dict[int, int] = {}
        for op in program:
            if op.kind is OpKind.F:
                assert op.mb is not None
                current[op.vstage] = op.mb
            elif op.kind in (OpKind.B, OpKind.R):
                if op.vstage not in current:
                    raise ValueError(f"{op.id} comes before any forward of vstage {op.vstage}")
                found[(op.vstage, op.mb)] = current[op.vstage]  # type: ignore[index]
    return found
