"""Predicted versus measured: ``compare.json``, and the calibrated profile a run can write (DESIGN §7).

The prediction is the simulator run on the very plan that executed, with the cost source the user names (a profile,
or the hardware catalog's roofline). The measurement is the median iteration after warm-up (:func:`median_iteration`).
Per op kind both mean durations are listed, which is where a wrong prediction shows *why* it is wrong (compute too
slow or fast, transfers, the optimizer step).

Calibration (``executor.run --calibrate-out``) turns a run into a profile for the simulator: the per-stage medians of
F, B and OPT_STEP measured in place, with every rank busy, which on a shared CPU is 30–60% slower than the same op
measured alone (``../shared/reference/simulators.md``). A stage's measured time is split over its layers in
proportion to the prior per-layer estimate (the profile or roofline the plan was simulated with), so the stage sums
are the measured ones exactly and the layer shares keep the prior's shape; the point-to-point fit comes from a
ping-pong sweep run inside the same process group.

The profile is labelled with the device the ranks were measured on (:func:`profile_device`), not the device the
plan names: a plan for V100s run on this host's CPU (no CUDA here, or ``--backend gloo``) yields a ``cpu`` profile,
which ``sim.run`` then applies to ``cpu`` ranks only, where the numbers are true. Ranks on different kinds of
device, or on a CUDA device the hardware catalog has no id for, cannot make one profile and are refused
(``executor.run`` checks this before launch where it can see the devices).
"""

from __future__ import annotations

import platform
import statistics
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from executor.provenance import catalog_id_for_gpu
from sim.core.errors import SpecError
from sim.cost.model import CostModel
from sim.cost.oracle import CostOracle
from sim.cost.profile import PROFILE_FORMAT_VERSION
from sim.hw.catalog import get_device
from sim.ir.plan import OpKind, Plan
from sim.ir.trace import Trace
from sim.models.graph import LayerGraph

__all__ = ["compare_report", "stage_medians", "calibrated_profile", "median_iteration", "MEDIAN_RULE",
           "device_catalog_id", "profile_device"]

#: How "the median iteration" is chosen, for the files that report it (compare.json, metrics.json).
MEDIAN_RULE = ("median over the iterations after warm-up; with an even count the lower of the two middle ones, so "
               "the reported time is always that of a real iteration, the one drawn in trace.json and gantt.png")


def _relative(measured: float, predicted: float) -> float | None:
    return (measured - predicted) / measured if measured > 0 else None


def median_iteration(times: Sequence[float], warmup: int) -> tuple[int, float]:
    """The index and time (s) of the median iteration after the first ``warmup`` ones (:data:`MEDIAN_RULE`).

    The one definition of the measured iteration time: ``compare.json``, ``metrics.json``, the drawn trace and the
    printed summary all use it. Ties between equal times go to the earliest iteration.

    Raises:
        ValueError: no iteration after warm-up.
    """
    measured = list(enumerate(times))[warmup:]
    if not measured:
        raise ValueError(f"no iterations after {warmup} warm-up iteration(s)")
    median = statistics.median_low(t for _, t in measured)
    index = next(i for i, t in measured if t == median)
    return index, median


def compare_report(predicted: Trace, measured: Sequence[Trace], *, median_index: int,
                   cost_source: str) -> dict[str, Any]:
    """The ``compare.json`` object.

    Args:
        predicted: the simulated trace of the plan.
        measured: the measured traces of the iterations after warm-up.
        median_index: the position in ``measured`` of the median iteration, as the caller's
            :func:`median_iteration` chose it (this function does not choose again).
        cost_source: where the prediction's costs came from, e.g. ``"profile runs/cal.json"`` or ``"roofline"``.

    Returns:
        ``predicted_iteration_time_s``, ``measured_iteration_time_s`` (the time of ``measured[median_index]``,
        the rule stated in ``measured_statistic``),
        ``relative_error`` = (measured − predicted) / measured, ``measured_iterations_s``, and ``ops``: per op kind the
        ``count`` per iteration, ``predicted_mean_s``, ``measured_mean_s`` (over all measured iterations) and
        ``relative_error``.

    Raises:
        ValueError: no measured iteration, or ``median_index`` is not one of them.
    """
    if not measured:
        raise ValueError("no measured iterations to compare with")
    if not 0 <= median_index < len(measured):
        raise ValueError(f"median_index {median_index} is not one of the {len(measured)} measured iterations")
    times = [trace.makespan for trace in measured]
    measured_time = times[median_index]
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
        "measured_statistic": MEDIAN_RULE,
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


def device_catalog_id(name: str) -> str | None:
    """The hardware-catalog id of a device a rank reported: ``"cpu"``, or a CUDA device name looked up as
    ``profiles.measure`` does (:func:`executor.provenance.catalog_id_for_gpu`: ``"NVIDIA H100 80GB HBM3"`` →
    ``"h100-sxm5-80gb"``); ``None`` if it has none."""
    return "cpu" if name == "cpu" else catalog_id_for_gpu(name)


def profile_device(measured_names: Sequence[str]) -> str:
    """The catalog id a calibrated profile is labelled with: the one device every rank was measured on.

    Args:
        measured_names: per rank, the device it runs on, as :class:`executor.measured.RankReport` names it
            (``"cpu"`` or ``torch.cuda.get_device_name``).

    Raises:
        SpecError: the ranks ran on different kinds of device, or on a CUDA device with no catalog id.
    """
    ids = {name: device_catalog_id(name) for name in measured_names}
    unknown = sorted(name for name, found in ids.items() if found is None)
    if unknown:
        raise SpecError(f"--calibrate-out: the ranks run on {', '.join(map(repr, unknown))}, which the hardware "
                        f"catalog (profiles/hardware/devices.yaml) has no id for; a profile must name a catalog device")
    kinds = sorted(set(ids.values()))
    if len(kinds) != 1:
        raise SpecError(f"--calibrate-out needs every rank on one device kind (a profile names one), but the ranks "
                        f"run on {', '.join(kinds) or 'no device'}")
    return kinds[0]


def calibrated_profile(plan: Plan, graph: LayerGraph, prior: CostModel, medians: dict[tuple[int, str], float], *,
                       device: str, p2p: tuple[float, float] | None, machine: dict[str, Any],
                       software: dict[str, Any], iterations: int) -> dict[str, Any]:
    """A measured-profile JSON object (``profiles/README.md``) from in-place stage medians.

    Args:
        plan: the plan that ran.
        graph: its model.
        prior: the cost model the plan was simulated with; its profile (if any) with the roofline of ``device`` sets
            each layer's share of its stage's time.
        medians: :func:`stage_medians` of the measured iterations, s.
        device: catalog id of the device every rank ran on (:func:`profile_device`); the profile's ``device``.
        p2p: ``(latency s, bandwidth bytes/s)`` fitted in place, or ``None``.
        machine, software: provenance.
        iterations: how many iterations the medians are over.

    Raises:
        SpecError: ``device`` is not in the catalog, or a stage has no measured F or B.
    """
    device_spec = get_device(device)
    base = CostOracle(graph, plan.microbatch_size, prior.profile).layer_costs(device_spec)
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
        "device": device_spec.name,
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
