"""Predicted versus measured: ``compare.json``, and the calibrated profile a run can write (DESIGN §7).

The prediction is the simulator run on the very plan that executed, with the cost source the user names (a profile,
or the hardware catalog's roofline). The measurement is the median iteration after warm-up. Per op kind both mean
durations are listed, which is where a wrong prediction shows *why* it is wrong (compute too slow or fast,
transfers, the optimizer step).

Calibration (``executor.run --calibrate-out``) turns a run into a profile for the simulator: the per-stage medians of
F, B and OPT_STEP measured in place, with every rank busy, which on a shared CPU is 30–60% slower than the same op
measured alone (``../shared/reference/simulators.md``). A stage's measured time is split over its layers in
proportion to the prior per-layer estimate (the profile or roofline the plan was simulated with), so the stage sums
are the measured ones exactly and the layer shares keep the prior's shape; the point-to-point fit comes from a
ping-pong sweep run inside the same process group.
"""

from __future__ import annotations

import platform
import statistics
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sim.costs import CostModel, layer_costs
from sim.errors import SpecError
from sim.graph import LayerGraph
from sim.ir import OpKind, Plan
from sim.profile import PROFILE_FORMAT_VERSION
from sim.topology import Topology
from sim.trace import Trace

__all__ = ["compare_report", "stage_medians", "calibrated_profile"]


def _relative(measured: float, predicted: float) -> float | None:
    return (measured - predicted) / measured if measured > 0 else None


def compare_report(predicted: Trace, measured: Sequence[Trace], *, cost_source: str) -> dict[str, Any]:
    """The ``compare.json`` object.

    Args:
        predicted: the simulated trace of the plan.
        measured: the measured traces of the iterations after warm-up.
        cost_source: where the prediction's costs came from, e.g. ``"profile runs/cal.json"`` or ``"roofline"``.

    Returns:
        ``predicted_iteration_time_s``, ``measured_iteration_time_s`` (median over ``measured``),
        ``relative_error`` = (measured − predicted) / measured, ``measured_iterations_s``, and ``ops``: per op kind the
        ``count`` per iteration, ``predicted_mean_s``, ``measured_mean_s`` (over all measured iterations) and
        ``relative_error``.

    Raises:
        ValueError: no measured iteration.
    """
    if not measured:
        raise ValueError("no measured iterations to compare with")
    times = [trace.makespan for trace in measured]
    measured_time = statistics.median(times)
    predicted_time = predicted.makespan
    pred_kinds: dict[str, list[float]] = defaultdict(list)
    for span in predicted.spans:
        pred_kinds[span.kind].append(span.duration)
    meas_kinds: dict[str, list[float]] = defaultdict(list)
    for trace in measured:
        for span in trace.spans:
            meas_kinds[span.kind].append(span.duration)
    ops = {}
    for kind in sorted(set(pred_kinds) | set(meas_kinds)):
        p = statistics.fmean(pred_kinds[kind]) if pred_kinds[kind] else None
        m = statistics.fmean(meas_kinds[kind]) if meas_kinds[kind] else None
        ops[kind] = {
            "count": len(pred_kinds[kind]) or len(meas_kinds[kind]) // len(measured),
            "predicted_mean_s": p,
            "measured_mean_s": m,
            "relative_error": _relative(m, p) if p is not None and m is not None else None,
        }
    return {
        "predicted_iteration_time_s": predicted_time,
        "measured_iteration_time_s": measured_time,
        "relative_error": _relative(measured_time, predicted_time),
        "measured_iterations_s": times,
        "cost_source": cost_source,
        "ops": ops,
    }


def stage_medians(measured: Sequence[Trace]) -> dict[tuple[int, str], float]:
    """Median duration of each (vstage, kind) over all microbatches and iterations, for F, B and OPT_STEP, s."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    wanted = {OpKind.F.value, OpKind.B.value, OpKind.OPT_STEP.value}
    for trace in measured:
        for span in trace.spans:
            if span.kind in wanted:
                samples[(span.vstage, span.kind)].append(span.duration)
    return {key: statistics.median(values) for key, values in sorted(samples.items())}


def _split(total: float, prior: Sequence[float]) -> list[float]:
    """``total`` split in proportion to ``prior`` (evenly when the prior is all zero)."""
    weight = sum(prior)
    if weight <= 0:
        return [total / len(prior)] * len(prior)
    return [total * p / weight for p in prior]


def calibrated_profile(plan: Plan, graph: LayerGraph, topology: Topology, prior: CostModel,
                       medians: dict[tuple[int, str], float], *, p2p: tuple[float, float] | None,
                       machine: dict[str, Any], software: dict[str, Any], iterations: int) -> dict[str, Any]:
    """A measured-profile JSON object (``profiles/README.md``) from in-place stage medians.

    Args:
        plan: the plan that ran.
        graph: its model.
        topology: its topology; every rank must be the same device (a profile names one device).
        prior: the cost model the plan was simulated with; its per-layer times set each layer's share.
        medians: :func:`stage_medians` of the measured iterations.
        p2p: ``(latency s, bandwidth bytes/s)`` fitted in place, or ``None``.
        machine, software: provenance.
        iterations: how many iterations the medians are over.

    Raises:
        SpecError: the plan's ranks run on different devices, or a stage has no measured F or B.
    """
    names = {topology.devices[r].name for r in range(plan.num_ranks)}
    if len(names) != 1:
        raise SpecError(f"--calibrate-out needs every rank on one device kind (a profile names one), got "
                        f"{', '.join(sorted(names))}")
    device = topology.devices[0].name
    base = layer_costs(graph, topology.devices[0], plan.microbatch_size, prior.profile)
    layers: list[dict[str, Any]] = []
    for v, (start, end) in enumerate(plan.placement.vstage_layers):
        for kind in ("F", "B"):
            if (v, kind) not in medians:
                raise SpecError(f"cannot calibrate: no measured {kind} for stage {v}")
        fwd = _split(medians[(v, "F")], base.fwd[start:end])
        bwd = _split(medians[(v, "B")], base.bwd[start:end])
        opt = _split(medians.get((v, "OPT_STEP"), 0.0), base.opt[start:end])
        for i in range(start, end):
            layers.append({"name": graph.layers[i].name, "fwd_s": fwd[i - start], "bwd_s": bwd[i - start],
                           "opt_s": opt[i - start]})
    profile: dict[str, Any] = {
        "format": "pipedejavu-profile",
        "format_version": PROFILE_FORMAT_VERSION,
        "model": graph.spec,
        "device": device,
        "microbatch_size": plan.microbatch_size,
        "layers": layers,
        "method": {
            "kind": "calibrated in place (executor.run --calibrate-out)",
            "plan": {"schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
                     "layers_per_stage": list(plan.placement.layer_counts()), "num_ranks": plan.num_ranks},
            "iterations": iterations,
            "statistic": "median over all microbatches and iterations after warm-up, per stage; split over the "
                         "stage's layers in proportion to the prior estimate",
            "prior": f"profile {prior.profile.source}" if prior.profile is not None else "roofline",
        },
        "machine": {"hostname": platform.node(), **machine},
        "software": software,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if p2p is not None:
        profile["p2p"] = {"latency_s": p2p[0], "bandwidth_bytes_per_s": p2p[1]}
    return profile
