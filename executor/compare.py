"""Predicted versus measured: ``compare.json`` (DESIGN §7).

The prediction is the simulator run on the very plan that executed, with the cost source the user names (a profile,
or the hardware catalog's costs). The measurement is the median iteration after warm-up (:func:`median_iteration`).
Per op kind both mean durations are listed, which is where a wrong prediction shows *why* it is wrong (compute too
slow or fast, transfers, the optimizer step).

Memory is compared per process (:func:`memory_report`): the simulated peak of the plan's rank against the peak that
process measured (``executor.memory``), both in bytes.

The calibrated profile a run can write is :mod:`executor.calibration`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sim.ir.plan import Plan
from sim.ir.trace import Trace

__all__ = ["compare_report", "median_iteration", "memory_report", "format_memory_line", "MEDIAN_RULE"]

#: How "the median iteration" is chosen, for the files that report it (compare.json, metrics.json).
MEDIAN_RULE = ("median over the iterations after warm-up; with an even count the lower of the two middle ones, so "
               "the reported time is always that of a real iteration, the one drawn in trace.json and gantt.png")


def _error(predicted: float, measured: float) -> float | None:
    """predicted / measured − 1, the product's one sign convention for an error (the experiments' "predicted /
    published − 1"): negative when the prediction is low. ``None`` for a measurement of 0."""
    return predicted / measured - 1 if measured > 0 else None


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
        ``relative_error`` = predicted / measured − 1, ``measured_iterations_s``, and ``ops``: per op kind the
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
            "relative_error": _error(p, m) if p is not None and m is not None else None,
        }
    return {
        "predicted_iteration_time_s": predicted_time,
        "measured_iteration_time_s": measured_time,
        "measured_statistic": MEDIAN_RULE,
        "relative_error": _error(predicted_time, measured_time),
        "measured_iterations_s": times,
        "cost_source": cost_source,
        "ops": ops,
    }


def memory_report(plan: Plan, predicted_peaks: Sequence[int], measured_peaks: Sequence[int | None],
                  method: str | None) -> dict[str, Any]:
    """``compare.json``'s ``memory`` entry: per process, the predicted and the measured peak memory, bytes.

    Args:
        plan: the plan that ran.
        predicted_peaks: the prediction's ``peak_memory_bytes``, one per simulated rank: the pipeline ranks of one
            replica, or of every replica when they were simulated one by one (``sim.cost.cost_view.replica_views``).
        measured_peaks: per process (global rank), its measured peak, or ``None`` where it was not measured.
        method: how the peaks were measured (``executor.memory``), or ``None``.

    Returns:
        ``method`` and ``ranks``: per process ``rank``, ``predicted_peak_memory_bytes`` (that of its pipeline rank in
        its replica; its tensor shard is what the prediction's graph describes), ``measured_peak_memory_bytes`` and
        ``relative_error`` = predicted / measured − 1 (``None`` when not measured); ``max_abs_relative_error``
        over the processes that measured.

    Raises:
        ValueError: ``predicted_peaks`` is not a whole number of replicas' pipeline ranks.
    """
    pipeline = plan.num_ranks
    if not predicted_peaks or len(predicted_peaks) % pipeline:
        raise ValueError(f"{len(predicted_peaks)} predicted peaks for {pipeline} pipeline ranks")
    per_replica = len(predicted_peaks) > pipeline  # every replica simulated: replica d's ranks follow replica d-1's
    ranks = []
    for rank, measured in enumerate(measured_peaks):
        p, d, _ = plan.layout.coords(rank)
        predicted = int(predicted_peaks[(d if per_replica else 0) * pipeline + p])
        ranks.append({"rank": rank, "predicted_peak_memory_bytes": predicted, "measured_peak_memory_bytes": measured,
                      "relative_error": _error(predicted, measured) if measured is not None else None})
    errors = [abs(row["relative_error"]) for row in ranks if row["relative_error"] is not None]
    return {"method": method, "ranks": ranks, "max_abs_relative_error": max(errors) if errors else None}


def format_memory_line(memory: dict[str, Any]) -> str:
    """The run summary's one line about memory: each process's predicted and measured peak, MB (10^6 bytes)."""
    rows = memory["ranks"]
    if all(row["measured_peak_memory_bytes"] is None for row in rows):
        predicted = ", ".join(f"{row['predicted_peak_memory_bytes'] / 1e6:.1f}" for row in rows)
        return f"peak memory per rank: predicted {predicted} MB; not measured (--measure-memory counts it on the CPU)"
    parts = []
    for row in rows:
        measured, error = row["measured_peak_memory_bytes"], row["relative_error"]
        seen = f"{measured / 1e6:.1f} MB ({error * 100:+.1f}%)" if measured is not None else "-"
        parts.append(f"rank {row['rank']} {row['predicted_peak_memory_bytes'] / 1e6:.1f} / {seen}")
    return "peak memory per rank, predicted / measured: " + ", ".join(parts)
