"""Costing one candidate of a search by the one prediction path: its plan built as ``sim.run`` builds it
(:func:`sim.plan.build.build_plan`), simulated by :func:`sim.predict.predict`.

A candidate is infeasible when its plan cannot be built (the message of the rule it breaks: heads not divisible by
TP, a global batch that is not a whole number of microbatches, more stages than layers, a plan too large to hold)
or when a device needs more memory than it has (or than ``--memory-limit`` allows); such a candidate keeps its
simulated time, so a reader sees what it would have cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.ir.plan import Plan
from sim.plan.build import build_plan
from sim.predict import predict_built
from sim.search.space import Candidate, SearchProblem

__all__ = ["Evaluation", "evaluate", "build_candidate_plan", "memory_verdict"]


@dataclass(frozen=True)
class Evaluation:
    """What a candidate costs.

    Attributes:
        candidate: the candidate.
        feasible: whether its plan builds and fits in memory.
        reason: why it is infeasible (empty when feasible).
        iteration_time_s: simulated time of one iteration, s (``None`` when the plan could not be built).
        throughput_samples_per_s: samples per second over all replicas (``None`` likewise).
        microbatches: microbatches per iteration per replica (0 when the plan could not be built).
        layer_counts: layers of each virtual stage, in order (the partition; empty when not built).
        peak_memory_bytes: highest memory in use on each simulated rank, bytes: the pipeline ranks of one replica
            when the data-parallel replicas are alike, else of each replica in turn (replica-major), since replicas
            on different device models have different capacities.
        memory_capacity_bytes: what each of those ranks may use: its device's memory, or the search's limit (None:
            unlimited, the ideal device).
        method: how the time was obtained: ``"engine"`` (the one prediction path, :func:`sim.predict.predict`),
            ``"critical path"`` (:mod:`sim.bench.fast`, equal to the engine's) or ``"critical path, lower bound"``
            (a link would be contended: the engine's time is at least this).
    """

    candidate: Candidate
    feasible: bool
    reason: str = ""
    iteration_time_s: float | None = None
    throughput_samples_per_s: float | None = None
    microbatches: int = 0
    layer_counts: tuple[int, ...] = ()
    peak_memory_bytes: tuple[int, ...] = ()
    memory_capacity_bytes: tuple[int | None, ...] = ()
    method: str = "engine"

    @property
    def max_peak_memory_bytes(self) -> int:
        """The highest per-device peak, bytes (0 when not simulated)."""
        return max(self.peak_memory_bytes, default=0)


def build_candidate_plan(problem: SearchProblem, candidate: Candidate) -> Plan:
    """The lowered, validated plan of ``candidate`` (what ``plan.json`` holds).

    Raises:
        SpecError: the candidate breaks a rule (see the module docstring).
    """
    return build_plan(candidate.plan_inputs(problem)).plan


def evaluate(problem: SearchProblem, candidate: Candidate) -> Evaluation:
    """Build and simulate ``candidate``; never raises for an infeasible one (it says why instead)."""
    try:
        built = build_plan(candidate.plan_inputs(problem))
        prediction = predict_built(built, check_memory=False, perturbation=problem.perturbation)
    except SpecError as exc:
        return Evaluation(candidate, False, reason=str(exc))
    metrics = prediction.metrics
    # Every simulated row, not only replica 0's: a mixed cluster's replicas are simulated one by one, and a replica on
    # smaller devices may overflow where the first fits.
    devices = metrics["devices"]
    peaks = tuple(int(d["peak_memory_bytes"]) for d in devices)
    capacity, reason = memory_verdict(peaks, [d["memory_capacity_bytes"] for d in devices],
                                      [d["device"] for d in devices], built.plan.num_ranks, problem)
    return Evaluation(candidate, not reason, reason, float(metrics["iteration_time_s"]),
                      float(metrics["throughput_samples_per_s"]), built.plan.num_microbatches,
                      tuple(built.plan.placement.layer_counts()), peaks, capacity)


def memory_verdict(peaks: tuple[int, ...], capacities: list[int | float | None], names: list[str], pipeline: int,
                   problem: SearchProblem) -> tuple[tuple[int | None, ...], str]:
    """What each simulated rank may use (its device's memory, or the problem's memory limit when smaller; ``None``:
    no limit, the catalog's ideal device), bytes, and why the plan does not fit ("" when it does): the rank most over
    what its allocated peak may reach, that capacity less the problem's headroom (:meth:`SearchProblem.usable_bytes`),
    named by pipeline rank (and simulated replica when several are)."""
    capacity = tuple(problem.capacity_bytes(cap) for cap in capacities)
    usable = [problem.usable_bytes(cap) for cap in capacities]
    over = [(row, peak, cap) for row, (peak, cap) in enumerate(zip(peaks, usable)) if cap is not None and peak > cap]
    if not over:
        return capacity, ""
    row, peak, cap = max(over, key=lambda item: item[1] - item[2])
    replica, rank = divmod(row, pipeline)
    where = f"pipeline rank {rank}" + (f" of replica {replica}" if len(peaks) > pipeline else "")
    limited = problem.memory_limit_bytes is not None and capacity[row] == problem.memory_limit_bytes
    headroom = (f" after a {problem.memory_headroom:.0%} headroom (--memory-headroom)" if problem.memory_headroom
                else "")
    return capacity, (f"out of memory: {where} ({names[row]}) needs {_size(peak)}, has {_size(cap)}"
                      f"{headroom}{' (--memory-limit)' if limited else ''}")


def _size(nbytes: int) -> str:
    """Bytes for a message: GB with two decimals from 1 GB, else MB with one (so small plans do not read 0.02 GB)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
