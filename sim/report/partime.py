"""What a stream run (PARTIME, ``--schedule stream``) is judged by: per-frame latency, the pipeline's step time and
throughput, each stage's time per step, and, for a live source, whether real time holds.

Definitions (``sim.schedules.partime``: frame f enters stage 0 at step f, stage s runs frame ``t − s`` and the
gradient of frame ``t − 2(N − 1) + s`` at step t):

* **frame in**: f / fps with a live source (``--fps``), else the start of frame f's first forward (a source that
  hands over a frame whenever the pipeline asks).
* **frame done**: the end of the last update frame f's gradient makes, on stage 0 (the last stage it reaches).
  **Latency** = done − in. With every stage's step equally long, τ, and free links it is (2N − 1) · τ.
* **Steady state**: steps ``2(N − 1) .. T − 1``, where every stage runs a forward and a backward (before them the
  pipeline fills, after them it drains; a live stream is always in the steady state). It exists when
  T > 2(N − 1). **Step time**: the median gap between the starts of consecutive frames' first forwards there;
  **throughput**: 1 / step time. **Stage step time**: a stage's compute busy time per steady step (its forward,
  backward and update; the time it waits is not in it).
* **Real time** (``--fps``): holds when the source's rate is at most the **sustainable rate**, 1 / step time of the
  same plan run unpaced (:func:`real_time`). Policy when it does not: frames *queue*: every frame is learnt from, in
  order, each waiting until stage 0 is free, so latency grows by about (step time − 1/fps) per frame; a source that
  drops instead would keep about sustainable / fps of its frames (reported, not simulated).
"""

from __future__ import annotations

import statistics
from typing import Any

from sim.ir.ops import COMPUTE_KINDS, WEIGHT_GRADIENT_KINDS, OpKind
from sim.ir.trace import Trace

__all__ = ["partime_metrics", "real_time", "format_partime_summary"]

# Spans carry their kind's spelling: the op table's kinds, spelt. A stream plan's compute is F, B, R and OPT_STEP.
_COMPUTE_KINDS = frozenset(kind.value for kind in COMPUTE_KINDS)
# What ends a frame's work on a stage: the ops that complete its weight gradients (B), and its update.
_FRAME_DONE_KINDS = frozenset(kind.value for kind in (*WEIGHT_GRADIENT_KINDS, OpKind.OPT_STEP))
_FORWARD = OpKind.F.value


def partime_metrics(trace: Trace, *, num_stages: int, num_frames: int, fps: float | None) -> dict[str, Any]:
    """The ``stream`` object of a stream plan's ``metrics.json`` (module docstring), times in s.

    Args:
        trace: the run's spans (simulated or measured).
        num_stages: pipeline stages N.
        num_frames: frames T.
        fps: the source's rate, frames/s, or ``None`` (frames whenever the pipeline asks).
    """
    first_forward: dict[int, float] = {}
    done: dict[int, float] = {}
    busy = [0.0] * num_stages
    steady_first, steady_last = 2 * (num_stages - 1), num_frames - 1
    for span in trace.spans:
        if span.stream != "compute" or span.kind not in _COMPUTE_KINDS or span.mb is None:
            continue
        stage, mb = span.vstage, span.mb
        if span.kind == _FORWARD and stage == 0:
            first_forward[mb] = span.start
        if span.kind in _FRAME_DONE_KINDS:
            done[mb] = max(done.get(mb, 0.0), span.end)
        # The step a span belongs to: a forward's frame enters stage s at step mb + s, a gradient's at
        # mb + 2(N − 1) − s; the update and a drain's recompute go with the backward they serve.
        step = mb + stage if span.kind == _FORWARD else mb + 2 * (num_stages - 1) - stage
        if steady_first <= step <= steady_last:
            busy[stage] += span.end - span.start
    arrival = ({f: f / fps for f in range(num_frames)} if fps else dict(first_forward))
    latencies = [done[f] - arrival[f] for f in range(num_frames) if f in done and f in arrival]
    steady_steps = steady_last - steady_first + 1
    found: dict[str, Any] = {
        "frames": num_frames, "stages": num_stages, "fps": fps, "policy": "queue",
        "latency_s": {"min": min(latencies), "median": statistics.median(latencies), "max": max(latencies),
                      "per_frame": latencies} if latencies else None,
        "steady_steps": max(steady_steps, 0),
    }
    if steady_steps >= 2:
        gaps = [first_forward[f + 1] - first_forward[f] for f in range(steady_first, steady_last)]
        step = statistics.median(gaps)
        steady_latency = [done[f] - arrival[f] for f in range(steady_first, steady_last + 1)]
        found.update({
            "step_time_s": step,
            "throughput_fps": 1.0 / step if step > 0 else None,
            "stage_step_time_s": [b / steady_steps for b in busy],
            "steady_latency_s": statistics.median(steady_latency),
            "latency_in_steps": statistics.median(steady_latency) / step if step > 0 else None,
            "queued_wait_s": (max(first_forward[f] - arrival[f] for f in range(num_frames)) if fps else 0.0),
        })
    else:
        found["step_time_s"] = None
        found["why_no_steady_state"] = (f"{num_frames} frames on {num_stages} stages: a steady state needs more than "
                                        f"2(N - 1) = {2 * (num_stages - 1)} frames")
    return found


def real_time(paced: dict[str, Any], unpaced: dict[str, Any]) -> dict[str, Any] | None:
    """Whether a live source at ``paced["fps"]`` is kept up with, from the same plan's paced and unpaced runs.

    Returns ``None`` without a steady state in the unpaced run, else ``sustainable_fps`` (1 / its step time),
    ``holds``, ``margin_s`` (1 / fps − step time: the slack per frame, s; negative when it fails),
    ``margin_fraction`` (1 − fps / sustainable), and when it fails ``kept_fraction_if_dropping`` (sustainable /
    fps).
    """
    step = unpaced.get("step_time_s")
    fps = paced["fps"]
    if not step or not fps:
        return None
    sustainable = 1.0 / step
    holds = fps <= sustainable * (1 + 1e-12)
    verdict: dict[str, Any] = {"sustainable_fps": sustainable, "holds": holds, "margin_s": 1.0 / fps - step,
                               "margin_fraction": 1.0 - fps / sustainable}
    if not holds:
        verdict["kept_fraction_if_dropping"] = sustainable / fps
    return verdict


def format_partime_summary(stream: dict[str, Any]) -> str:
    """The lines ``sim.run`` and ``executor.run`` print for a stream run."""
    lines = [f"stream: {stream['frames']} frames on {stream['stages']} stages"
             + (f", source at {stream['fps']:g} frames/s (frames queue when the pipeline is slower)"
                if stream["fps"] else ", frames as fast as the pipeline takes them")]
    if stream.get("step_time_s"):
        lines.append(f"step time         {stream['step_time_s'] * 1e3:.3f} ms ({stream['throughput_fps']:.1f} "
                     f"frames/s); per stage (ms): "
                     + ", ".join(f"{t * 1e3:.3f}" for t in stream["stage_step_time_s"]))
        lines.append(f"latency           {stream['steady_latency_s'] * 1e3:.3f} ms in the steady state "
                     f"({stream['latency_in_steps']:.2f} steps); over all frames "
                     f"{stream['latency_s']['min'] * 1e3:.3f}-{stream['latency_s']['max'] * 1e3:.3f} ms")
    else:
        lines.append(f"no steady state: {stream['why_no_steady_state']}")
    verdict = stream.get("real_time")
    if verdict is not None:
        if verdict["holds"]:
            lines.append(f"real time holds   at {stream['fps']:g} frames/s: sustainable "
                         f"{verdict['sustainable_fps']:.1f} frames/s, margin {verdict['margin_s'] * 1e3:.3f} ms per "
                         f"frame ({verdict['margin_fraction']:.1%})")
        else:
            lines.append(f"real time FAILS   at {stream['fps']:g} frames/s: sustainable "
                         f"{verdict['sustainable_fps']:.1f} frames/s; frames queued up to "
                         f"{stream['queued_wait_s'] * 1e3:.1f} ms; a dropping source would keep "
                         f"{verdict['kept_fraction_if_dropping']:.0%} of its frames")
    return "\n".join(lines)
