"""What a CSP run reports besides the trace: the ``csp`` block of ``metrics.json`` and the ``csp.json`` decision log.

Both the simulation (``sim.predict`` on a csp plan) and the executor's real run write the same ``csp`` block, from
the plan's own options, so a measured and a predicted run of one plan read alike. Throughput of a CSP run is in
subnets/s: one subnet is one training step of ``microbatch_size`` samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sim.csp.problem import CspResult
from sim.ir.plan import Plan

__all__ = ["csp_metrics", "csp_decision_log", "copies_record"]


def copies_record(stage: int, h2d_bytes: int, d2h_bytes: int, copy_wait_s: float, admission_wait_s: float,
                  peak_resident_bytes: int, prefetches: int, evictions: int) -> dict[str, Any]:
    """One stage's context-switching figures (bytes, s, counts), the same keys for a simulated and a measured run."""
    return {"stage": stage, "h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes, "copy_wait_s": copy_wait_s,
            "admission_wait_s": admission_wait_s, "peak_resident_bytes": peak_resident_bytes,
            "prefetches": prefetches, "evictions": evictions}


def csp_metrics(plan: Plan, result: CspResult | None = None, *, makespan_s: float | None = None,
                copies: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The ``csp`` block of ``metrics.json``.

    Args:
        plan: the csp plan.
        result: a simulated run (decisions, stalls, copies, makespan), or ``None`` for a measured one.
        makespan_s: the run's duration in s when ``result`` is ``None``.
        copies: per-stage copy records (:func:`copies_record`) of a measured run.

    Returns:
        ``subnets``, ``seed``, ``lookahead``, ``space``, ``one_at_a_time``, ``subnets_per_s``, the budget and
        policy (``prefetch`` is ``"resident"`` without a budget: nothing is copied), ``copies`` and their total
        ``copy_wait_s``; for a simulation also ``decisions`` and ``stalls`` per stage.
    """
    makespan = result.makespan if result is not None else makespan_s
    if result is not None:
        copies = [copies_record(c.stage, c.h2d_bytes, c.d2h_bytes, c.copy_wait_s, c.admission_wait_s,
                                c.peak_resident_bytes, c.prefetches, c.evictions) for c in result.copies]
    copies = list(copies or [])
    block: dict[str, Any] = {
        "subnets": plan.num_microbatches, "seed": plan.option("seed"), "lookahead": plan.option("lookahead"),
        "space": plan.option("space"), "one_at_a_time": bool(plan.option("one_at_a_time", False)),
        "subnets_per_s": plan.num_microbatches / makespan if makespan else None,
        "device_param_budget_bytes": plan.option("device_param_budget_bytes"),
        "prefetch": plan.option("prefetch", "resident"),
        "copies": copies, "copy_wait_s": sum(c["copy_wait_s"] for c in copies),
    }
    if result is not None:
        block["decisions"] = len(result.decisions)
        block["stalls"] = [{"stage": s.stage, "blocked_s": s.blocked_s, "blocked_decisions": s.blocked_decisions}
                           for s in result.stalls]
    return block


def csp_decision_log(plan: Plan, result: CspResult) -> dict[str, Any]:
    """``csp.json``: the subnet table and every decision with its dependency edges (enough to replay the run)."""
    return {"subnets": [list(row) for row in plan.subnets],
            "decisions": [{"time_s": d.time, "stage": d.stage, "picked": d.picked, "arrived": list(d.arrived),
                           "unfinished": list(d.unfinished), "edges": [list(e) for e in d.edges]}
                          for d in result.decisions]}
