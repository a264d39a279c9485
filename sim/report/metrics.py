"""Metrics of a trace: iteration time, throughput, bubble fraction, per-device busy time and memory, link traffic.

The same function serves simulated and measured traces, so ``metrics.json`` means the same thing for both.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sim.ir.plan import Plan
from sim.ir.trace import Trace

__all__ = ["compute_metrics", "plan_header", "rank_label"]


def rank_label(rank: int, device: str, device_rank: int | None = None) -> str:
    """How the Gantt chart and the printed summary both name a trace rank: ``r1 a100-sxm4-80gb``, or for a 3D plan,
    whose trace shows one device per pipeline rank (``device_rank``: the topology device it ran on),
    ``r1 gpu2 a100-sxm4-80gb``, so that the table and the chart name the same device the same way."""
    return f"r{rank} {device}" if device_rank is None else f"r{rank} gpu{device_rank} {device}"


def plan_header(plan: Plan, *, costs: str | None = None) -> dict[str, Any]:
    """The ``plan`` object of every ``metrics.json``, simulated or measured: what ran, where, split how.

    Args:
        plan: the plan.
        costs: where the durations come from (:func:`sim.predict.describe_cost_source`), for a prediction.
    """
    header: dict[str, Any] = {
        "schedule": plan.schedule, "model": plan.model, "topology": plan.topology,
        "layers_per_stage": list(plan.placement.layer_counts()),
        "vstage_to_rank": list(plan.placement.vstage_to_rank), "recompute": bool(plan.option("recompute")),
    }
    if plan.option("recompute") == "selective":
        header["recompute"] = "selective"
    if plan.parallel is not None:
        layout = plan.parallel
        header["parallel"] = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "order": layout.order,
                              "sequence_parallel": layout.sequence_parallel, "zero": layout.zero,
                              "devices": layout.world_size}
    if costs is not None:
        header["costs"] = costs
    return header


def compute_metrics(
    trace: Trace,
    *,
    num_microbatches: int,
    microbatch_size: int,
    peak_memory_bytes: Sequence[int] | None = None,
    memory_capacity_bytes: Sequence[float] | None = None,
    link_bytes: Sequence[tuple[tuple[str, str], int]] = (),
    replicas: int = 1,
    device_of_rank: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The ``metrics.json`` object of one iteration.

    Args:
        trace: the iteration's spans.
        num_microbatches: microbatches in the iteration.
        microbatch_size: samples per microbatch.
        peak_memory_bytes: per-rank peak memory, bytes (omitted from the output when unknown).
        memory_capacity_bytes: per-rank device memory, bytes.
        link_bytes: ``((src, dst), bytes)`` carried by each directed link.
        replicas: data-parallel replicas, each running ``num_microbatches`` microbatches (throughput counts all).
        device_of_rank: the topology device each trace rank ran on, when it is not the trace rank itself (a 3D
            plan's trace shows one device per pipeline rank); written as each device's ``device_rank``.

    Returns:
        ``iteration_time_s`` (s), ``throughput_samples_per_s``, ``bubble_fraction`` (1 − Σ compute busy ÷ (devices ×
        iteration time)), per-device ``rank``, ``device``, ``busy_s``, ``bubble_fraction``, ``peak_memory_bytes``,
        per-kind op counts and mean durations, and bytes per link.
    """
    iteration = trace.makespan
    busy = [0.0] * trace.num_ranks
    # Durations as C doubles (8 bytes each, not a 24-byte float object and an 8-byte slot): the mean is still
    # sum() over them in trace order, the same figure as over a list.
    per_kind: dict[str, array[float]] = defaultdict(lambda: array("d"))
    for span in trace.spans:
        duration = span.end - span.start
        if span.stream == "compute":
            busy[span.rank] += duration
        per_kind[span.kind].append(duration)
    devices = []
    for rank, device in enumerate(trace.devices):
        entry: dict[str, Any] = {
            "rank": rank,
            **({"device_rank": int(device_of_rank[rank])} if device_of_rank is not None else {}),
            "device": device,
            "busy_s": busy[rank],
            "bubble_fraction": 1.0 - busy[rank] / iteration if iteration > 0 else 0.0,
        }
        if peak_memory_bytes is not None:
            entry["peak_memory_bytes"] = int(peak_memory_bytes[rank])
        if memory_capacity_bytes is not None:
            capacity = memory_capacity_bytes[rank]
            entry["memory_capacity_bytes"] = int(capacity) if capacity != float("inf") else None
        devices.append(entry)
    samples = num_microbatches * microbatch_size * replicas
    return {
        "iteration_time_s": iteration,
        "throughput_samples_per_s": samples / iteration if iteration > 0 else None,
        "bubble_fraction": 1.0 - sum(busy) / (trace.num_ranks * iteration) if iteration > 0 else 0.0,
        "num_microbatches": num_microbatches,
        "microbatch_size": microbatch_size,
        **({"replicas": replicas} if replicas != 1 else {}),
        "devices": devices,
        "ops": {kind: {"count": len(d), "mean_duration_s": sum(d) / len(d)} for kind, d in sorted(per_kind.items())},
        "links": [{"src": src, "dst": dst, "bytes": nbytes} for (src, dst), nbytes in link_bytes],
    }
