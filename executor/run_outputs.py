"""Rank 0's end of a run: measured traces, the prediction, and every output file (DESIGN §1, §7).

Writes into ``--out`` exactly what ``sim.run`` writes for a simulation, through the same function
(:func:`sim.report.outputs.write_run_outputs`): ``metrics.json``, ``trace.json`` and ``gantt.png`` of the median
measured iteration; plus ``compare.json`` (predicted vs measured), ``plan.json`` (the plan that ran) and, with
``--calibrate-out``, a calibrated profile: all of them or none (rank 0 closes its own output set).
``metrics.json`` also carries every iteration's time and the losses (a 3D plan's: every replica's, in the order of the
global batch). A 3D plan's measured trace has one row per process (``executor.measured``) and the prediction one per
pipeline rank of the simulated replica; ``compare.json``'s ``parallel`` entry says so and how they are compared.
Both ``compare.json`` and ``metrics.json`` (its ``measurement``) have a ``slowdown`` entry: ``null`` for a real run,
else which ranks ``--slowdown`` slowed and by how much (``executor.slowdown``), which ``trace.json``'s metadata, the
printed summary and the chart's title say too, so an emulated run is never read as a real one.

"The median iteration" has one definition (:func:`executor.compare.median_iteration`: the lower median when the count
is even), so the iteration time in ``metrics.json``, the ``measured_iteration_time_s`` of ``compare.json``, the drawn
trace and the printed summary are the same number.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executor.calibration import (
    P2P_METHOD,
    calibrated_profile,
    device_catalog_id,
    in_place_p2p,
    profile_device,
    stage_medians,
)
from executor.clock import ClockOffset
from executor.compare import MEDIAN_RULE, compare_report, format_memory_line, median_iteration, memory_report
from executor.measured import RankReport, iteration_times, measured_trace
from executor.options import RunOptions, host_cores
from executor.provenance import cpu_model, software_versions
from executor.slowdown import describe_slowdown, slowdown_record
from sim.core.fileio import prepare_output_dir, write_json_atomic, write_text_atomic
from sim.core.output_set import all_or_none
from sim.cost.model_flops import training_rates
from sim.cost.profile import load_profile
from sim.hw.topology import Topology
from sim.predict import predict
from sim.report.metrics import compute_metrics, plan_header
from sim.report.outputs import format_summary, write_run_outputs
from sim.report.partime import format_partime_summary, partime_metrics

__all__ = ["finish_run", "prediction_profile", "restart_line"]


def prediction_profile(plan, explicit: str | None) -> str | None:
    """The profile the prediction uses: ``--profile``, else the one the plan was simulated with, else none."""
    return explicit if explicit is not None else plan.option("profile")


def finish_run(plan, topology: Topology, options: RunOptions, reports: Sequence[RankReport],
               offsets: Sequence[ClockOffset], sweep: tuple[tuple[int, ...], list[float]] | None) -> None:
    """Build the measured traces, simulate the plan, and write every output; prints a short summary.

    ``topology`` is the plan's, as ``executor.run`` parsed and checked it (``load_checked_plan``) in this process.
    """
    # Rank 0 leaves with os._exit, so it must close its own output set: every file of the run, or none.
    with all_or_none():
        _finish_run(plan, topology, options, reports, offsets, sweep)


def _finish_run(plan, topology: Topology, options: RunOptions, reports: Sequence[RankReport],
                offsets: Sequence[ClockOffset], sweep: tuple[tuple[int, ...], list[float]] | None) -> None:
    # Checked before anything is written (executor.run checks it before launch where it can see the devices).
    calibration_device = profile_device([r.device for r in reports]) if options.calibrate_out else None
    out = prepare_output_dir(options.out, "--out")
    times = iteration_times(plan, reports, offsets)
    index, median_time = median_iteration(times, options.warmup)
    meta = {"devices_threads": [r.threads for r in reports],
            "clock_uncertainty_s": max(o.uncertainty_s for o in offsets)}
    if options.slowdown:  # trace.json too says the run was emulated
        meta["slowdown"] = slowdown_record(options.slowdown)
    measured = [measured_trace(plan, reports, offsets, i, meta) for i in range(options.warmup, len(times))]
    median_trace = measured[index - options.warmup]

    profile_path = prediction_profile(plan, options.profile)
    profile = load_profile(profile_path) if profile_path else None
    prediction = predict(plan, profile, topology=topology, check_memory=False)
    costs, predicted = prediction.costs, prediction.trace
    assert costs is not None  # a fixed-program plan (csp plans finish in executor.csp)
    graph = costs.graph
    cost_source = prediction.cost_source
    compare = compare_report(predicted, measured, median_index=index - options.warmup, cost_source=cost_source)
    measured_devices = sorted({r.device for r in reports})  # as the ranks name them: "cpu" or the CUDA device name
    planned_devices = sorted({d.name for d in topology.devices[: plan.world_size]})
    # Both as catalog ids, so they compare; a CUDA device the catalog has no id for keeps its own name.
    measured_ids = sorted({device_catalog_id(name) or name for name in measured_devices})
    compare["planned_devices"], compare["measured_devices"] = planned_devices, measured_ids
    # The prediction's interval (sim.report.interval) and whether the measured median fell inside it: on CPU ranks,
    # a regime no published run is in, so its interval is the widest pool's and says so.
    interval = prediction.metrics["iteration_time_s_interval"]
    low, high = interval["low"], interval["high"]
    covers = None if low is None else bool(low <= compare["measured_iteration_time_s"] <= high)
    compare["predicted_iteration_time_s_interval"] = {**interval, "covers_measured": covers}
    # An emulated slower device (--slowdown) is written down in both files, so it is never read as a real run.
    compare["slowdown"] = slowdown_record(options.slowdown)
    # Peak memory per process, predicted by the same simulation and measured by each rank (executor.memory).
    method = next((r.memory_method for r in reports if r.memory_method is not None), None)
    compare["memory"] = memory_report(plan, prediction.peak_memory_bytes, [r.peak_memory_bytes for r in reports],
                                      method)
    if plan.parallel is not None:
        compare["parallel"] = _rows_rule(plan, predicted)
    # A GPU plan run on this host's CPU was announced before launch (executor.backend.choose_backend); this catches the
    # rest, e.g. a V100 plan run on A100s.
    if measured_ids != planned_devices and measured_ids != ["cpu"]:
        print(f"warning: the plan was made for {', '.join(planned_devices)} but ran on "
              f"{', '.join(measured_devices)}; the prediction describes the planned hardware", file=sys.stderr)

    metrics = compute_metrics(median_trace, num_microbatches=plan.num_microbatches,
                              microbatch_size=plan.microbatch_size, replicas=plan.layout.dp)
    metrics["plan"] = plan_header(plan)
    # Against the peaks of the devices the plan names, as the prediction's; a run on other hardware is warned of above.
    metrics.update(training_rates(plan, topology, metrics["iteration_time_s"]))
    if plan.weight_policy == "stream":  # PARTIME: step time and latency, measured beside predicted
        metrics["stream"] = partime_metrics(median_trace, num_stages=plan.num_vstages,
                                            num_frames=plan.num_microbatches, fps=plan.option("fps"))
        compare["stream"] = {key: {"predicted": prediction.metrics["stream"].get(key),
                                   "measured": metrics["stream"].get(key)}
                             for key in ("step_time_s", "steady_latency_s", "stage_step_time_s")}
    metrics["measurement"] = {
        "iteration": index,
        "warmup_iterations": options.warmup,
        "iteration_times_s": times,
        "median_iteration_time_s": median_time,
        "statistic": MEDIAN_RULE,
        "threads_per_rank": [r.threads for r in reports],
        "clock_uncertainty_s": meta["clock_uncertainty_s"],
        "optimizer": options.optimizer,
        "losses": [list(step) for step in _losses(plan, reports)],
        "slowdown": compare["slowdown"],
    }
    if options.restarts is not None:  # the run crashed and came back (executor.restart)
        metrics["restarts"] = options.restarts
    write_text_atomic(plan.dumps(), out / "plan.json")
    title = f"measured · {plan.schedule} · {plan.model} · {', '.join(measured_devices)} · m={plan.num_microbatches}"
    if options.slowdown:
        title += f" · emulated slowdown {describe_slowdown(options.slowdown)}"
    names = write_run_outputs(out, median_trace, metrics, title=title, gantt=options.gantt)
    write_json_atomic(compare, out / "compare.json")
    names = ["plan.json", *names, "compare.json"]

    if options.calibrate_out:
        p2p = in_place_p2p(plan, costs, measured, sweep) if sweep else None
        gpus = [name for name in measured_devices if name != "cpu"]
        machine = {"cpu": cpu_model(), "gpu": ", ".join(gpus) or None, "cores": host_cores(),
                   "threads_per_rank": [r.threads for r in reports], "device": measured_devices}
        calibrated = calibrated_profile(plan, graph, costs, stage_medians(measured),
                                        device=calibration_device, p2p=p2p,
                                        machine=machine, software=software_versions(), iterations=len(measured),
                                        measured=measured)
        if sweep:
            # With no fit (too noisy) the profile still keeps the sweep, so the reason can be inspected, but has no
            # latency or bandwidth: sim.cost.cost_view then keeps the topology's link model for transfers.
            calibrated.setdefault("p2p", {}).update({"sweep_sizes_bytes": list(sweep[0]),
                                                     "sweep_one_way_s": list(sweep[1]), "method": P2P_METHOD})
        target = Path(options.calibrate_out)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(calibrated, target)
        print(f"wrote calibrated profile {target}")

    print(format_summary(metrics))
    if "stream" in metrics:
        print("measured " + format_partime_summary(metrics["stream"]))
    if options.slowdown:
        print(f"emulated slowdown: {describe_slowdown(options.slowdown)} (compute ops stretched by sleeping; the "
              f"prediction is the plan's own)")
    if options.restarts is not None:
        print(restart_line(options.restarts))
    _print_compare(compare)
    print(format_memory_line(compare["memory"]))
    print(f"wrote {out}/{{{', '.join(names)}}}")


def _losses(plan, reports: Sequence[RankReport]) -> tuple[tuple[float, ...], ...]:
    """Per iteration, the per-microbatch losses, from the processes that computed them: the last vstage's, shard 0
    (every shard has the same loss), replica after replica, so that the list is in the order of the global batch
    (``executor.parallel.microbatch_index``); under context parallelism the mean of each replica's sequence parts."""
    layout, last = plan.layout, plan.placement.vstage_to_rank[-1]
    ranks = [layout.device(last, d, 0) for d in range(layout.data_ranks)]
    by_rank = {report.rank: report.losses for report in reports}
    if not all(by_rank.get(rank) for rank in ranks):
        return ()
    cp = layout.cp  # a replica's loss is the mean of its C sequence parts' (each the mean over as many tokens)
    replicas = [ranks[r * cp:(r + 1) * cp] for r in range(layout.dp)]
    return tuple(tuple(sum(by_rank[rank][i][j] for rank in parts) / cp for parts in replicas
                       for j in range(len(by_rank[parts[0]][i])))
                 for i in range(len(by_rank[ranks[0]])))


def _rows_rule(plan, predicted) -> dict[str, Any]:
    """How a 3D plan's measured rows compare with the predicted ones (``compare.json``'s ``parallel``)."""
    return {
        "layout": plan.layout.describe(),
        "predicted_rows": predicted.num_ranks,
        "measured_rows": plan.world_size,
        "rule": ("the prediction simulates one replica's pipeline ranks (one row each; identical replicas and shards "
                 "are stood for by symmetry), the measurement has one row per process; an iteration is the first "
                 "op's start to the last op's end over all rows of each, and an op kind's mean is over all its spans "
                 "of each"),
    }


def _print_compare(compare: dict[str, Any]) -> None:
    predicted, measured = compare["predicted_iteration_time_s"], compare["measured_iteration_time_s"]
    print(f"predicted {predicted * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms (median), relative error "
          f"{compare['relative_error'] * 100:+.1f}%  [costs: {compare['cost_source']}]")
    interval = compare.get("predicted_iteration_time_s_interval")
    if interval is not None and interval["low"] is not None:
        print(f"  {interval['level'] * 100:.0f} % interval {interval['low'] * 1e3:.2f}-{interval['high'] * 1e3:.2f} ms "
              f"({'covers' if interval['covers_measured'] else 'misses'} the measurement; from {interval['runs']:,} "
              f"published runs, outside the validated regimes in {', '.join(interval['relaxed']) or 'nothing'})")
    print("  op kind      predicted mean   measured mean")
    for kind, row in compare["ops"].items():
        p = f"{row['predicted_mean_s'] * 1e3:10.3f} ms" if row["predicted_mean_s"] is not None else "         -   "
        m = f"{row['measured_mean_s'] * 1e3:10.3f} ms" if row["measured_mean_s"] is not None else "         -   "
        print(f"  {kind:<10} {p}    {m}")


def restart_line(restarts: dict, unit: str = "iteration") -> str:
    """One line: how often the run came back, from what, and what it cost (``executor.restart``); ``unit``: what the
    run's iterations are (a csp run's are subnets)."""
    failures = restarts["failures"]
    what = failures[0]["message"] if failures else "a rank died without a record (killed from outside)"
    cost = f"; the restart took {restarts['restart_s']:.1f} s" if restarts["restart_s"] is not None else ""
    again = (f", {restarts['iterations_computed_again']} {unit}(s) computed again"
             if restarts["iterations_computed_again"] is not None else "")
    return (f"restarted {restarts['count']} time(s): {what}; resumed after {unit} "
            f"{restarts['resumed_after_iteration']}{again}{cost}")
