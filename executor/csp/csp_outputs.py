"""Rank 0's end of a CSP plan's run: the measured trace, the prediction for the same plan, and every output file.

Writes what ``executor.run`` writes for a fixed plan, through the same functions: ``metrics.json``,
``trace.json`` and ``gantt.png`` (:func:`sim.report.outputs.write_run_outputs`) of the run, ``plan.json``, and
``compare.json`` (:func:`executor.compare.compare_report`: the simulator's prediction of the very plan that ran,
:func:`sim.predict.predict`, against the measured run). ``metrics.json`` adds the CSP block of the simulator
(:func:`sim.csp.csp_metrics.csp_metrics`, with the measured copy statistics), ``final_params_sha256``, every subnet's
loss and the order in which each stage ran its forwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from executor.compare import compare_report
from executor.csp.trace import csp_trace
from executor.options import RunOptions
from executor.run_outputs import restart_line
from sim.core.fileio import prepare_output_dir, write_json_atomic, write_text_atomic
from sim.core.output_set import all_or_none
from sim.csp.csp_metrics import csp_metrics
from sim.ir.plan import Plan
from sim.predict import predict
from sim.report.metrics import compute_metrics, plan_header
from sim.report.outputs import format_summary, write_run_outputs

__all__ = ["finish_csp_run", "params_sha256"]


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name and raw bytes, in name order: equal iff the parameters are bitwise equal."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def finish_csp_run(plan: Plan, options: RunOptions, gathered: Sequence[tuple[dict, Any, float]],
                   offsets_s: Sequence[float]) -> None:
    """Write every output of a CSP run into ``options.out`` and print a summary.

    Args:
        plan: the csp plan that ran.
        options: the run's options.
        gathered: per rank, ``(state_dict, CspRankResult, wall s)``.
        offsets_s: per rank, what to add to its clock to get rank 0's, s.
    """
    # Rank 0 leaves with os._exit, so it must close its own output set: every file of the run, or none.
    with all_or_none():
        _finish_csp_run(plan, options, gathered, offsets_s)


def _finish_csp_run(plan: Plan, options: RunOptions, gathered: Sequence[tuple[dict, Any, float]],
                    offsets_s: Sequence[float]) -> None:
    world = len(gathered)
    state: dict = {}
    losses: dict[int, float] = {}
    for part, result, _ in gathered:
        state.update(part)
        losses.update(result.losses)
    meta = {"lookahead": plan.option("lookahead"), "num_subnets": plan.num_microbatches,
            "prefetch": plan.option("prefetch", "resident"),
            "param_budget_bytes": plan.option("device_param_budget_bytes")}
    trace = csp_trace([r.spans for _, r, _ in gathered], offsets_s, ["cpu"] * world, meta)
    metrics = compute_metrics(trace, num_microbatches=plan.num_microbatches, microbatch_size=plan.microbatch_size)
    wall = max(w for _, _, w in gathered)
    copies = [r.copies for _, r, _ in gathered if r.copies is not None]
    metrics["plan"] = plan_header(plan)
    metrics["csp"] = csp_metrics(plan, makespan_s=trace.makespan, copies=copies)
    metrics.update({
        "mode": "csp", "stages": world, "wall_s": wall,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "forward_order_per_stage": [[s for _, s in r.decisions] for _, r, _ in gathered],
        "final_params_sha256": params_sha256(state),
    })
    first = options.first_iteration
    if first:  # resumed: this run trained the subnets from the checkpoint's on; the losses are the whole sequence's
        metrics["resumed_at_subnet"] = first
    checkpoint_s = [s for _, r, _ in gathered for s in r.checkpoint_s]
    if checkpoint_s:
        metrics["checkpoints"] = {"every_subnets": options.checkpoint_every,
                                  "count": len(gathered[0][1].checkpoint_s),
                                  "mean_s": sum(checkpoint_s) / len(checkpoint_s)}
    if options.restarts is not None:  # the run crashed and came back (executor.restart)
        metrics["restarts"] = options.restarts
    prediction = predict(plan, check_memory=False)
    compare = compare_report(prediction.trace, [trace], median_index=0, cost_source=prediction.cost_source)
    out = prepare_output_dir(options.out, "--out")
    write_text_atomic(plan.dumps(), out / "plan.json")
    budget = plan.option("device_param_budget_bytes")
    title = (f"measured csp · {plan.model} · {world} ranks · {plan.num_microbatches} subnets"
             + (f" · budget {budget} B, {plan.option('prefetch')}" if budget is not None else ""))
    names = write_run_outputs(out, trace, metrics, title=title, gantt=options.gantt)
    write_json_atomic(compare, out / "compare.json")
    print(format_summary(metrics, unit="subnets"))
    print(f"final parameters sha256 {metrics['final_params_sha256']}")
    print(f"predicted {compare['predicted_iteration_time_s'] * 1e3:.2f} ms, measured "
          f"{compare['measured_iteration_time_s'] * 1e3:.2f} ms, relative error "
          f"{compare['relative_error'] * 100:+.1f}%  [costs: {compare['cost_source']}]")
    # Said, not corrected: the prediction is of the whole sequence without pauses.
    if first:
        print(f"  the measurement covers subnets {first}..{plan.num_microbatches - 1} (resumed after subnet {first}); "
              f"the prediction all {plan.num_microbatches}")
    if "checkpoints" in metrics:
        c = metrics["checkpoints"]
        print(f"  the measurement includes {c['count']} checkpoint(s), each draining the pipeline (mean "
              f"{c['mean_s'] * 1e3:.1f} ms to write); the prediction has none")
    if options.restarts is not None:
        print(restart_line(options.restarts, unit="subnet"))
    for c in copies:
        print(f"  stage {c['stage']} ({plan.option('prefetch')}): {c['h2d_bytes']} B in ({c['prefetches']} "
              f"copies), {c['d2h_bytes']} B out ({c['evictions']} keys), waited {c['copy_wait_s'] * 1e3:.2f} ms, "
              f"peak {c['peak_resident_bytes']} B resident")
    print(f"wrote {out}/{{{', '.join(['plan.json', *names, 'compare.json'])}}}")
