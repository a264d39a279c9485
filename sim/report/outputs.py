"""Writing a run's outputs: ``metrics.json``, ``trace.json`` and ``gantt.png`` (DESIGN §1).

Simulated runs (``sim.run``) and real runs (``executor.run``) both call :func:`write_run_outputs`, so the files mean
the same thing whichever produced them. Every file is written atomically, and the three are all or none
(:func:`sim.core.output_set.all_or_none`): if one cannot be written (a full disk, Ctrl-C), the others written so far
are removed and the files they replaced put back, so a failed run leaves no set of files that looks complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sim.core.fileio import (
    prepare_output_dir,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
    write_text_chunks_atomic,
)
from sim.core.output_set import all_or_none
from sim.ir.plan import Plan
from sim.ir.schedule_csv import dumps_schedule_csv
from sim.ir.trace import Trace
from sim.report.chrome_trace import write_chrome_trace
from sim.report.interval import MIN_RUNS
from sim.report.metrics import rank_label, split_text

__all__ = ["write_run_outputs", "format_summary"]


def plan_title(plan: Plan) -> str:
    """The title of a simulated plan's Gantt chart: schedule (chunks, recomputation) · model · topology (its tensor ×
    context × data × pipeline layout) · microbatches."""
    chunks, recompute = plan.option("chunks"), plan.option("recompute")
    layout = plan.layout
    shape = (f" · TP{layout.tp}{f'×CP{layout.cp}' if layout.cp > 1 else ''}×DP{layout.dp}×PP{layout.pp}"
             if plan.parallel is not None else "")
    return (f"{plan.schedule}{f' v={chunks}' if chunks else ''}"
            f"{' + selective recompute' if recompute == 'selective' else ' + recompute' if recompute else ''} · "
            f"{plan.model} · {plan.topology}{shape} · m={plan.num_microbatches}")


def write_plan_files(out_dir: Path, plan: Plan) -> list[str]:
    """Write ``plan.json`` (what the executor runs) and ``schedule.csv`` (its compute-only view) of ``plan`` into the
    existing directory ``out_dir``; returns the file names."""
    write_text_chunks_atomic(plan.iter_dumps(), out_dir / "plan.json")
    write_text_atomic(dumps_schedule_csv(plan.programs), out_dir / "schedule.csv")
    return ["plan.json", "schedule.csv"]


def write_run_outputs(out_dir: Path, trace: Trace, metrics: dict[str, Any], *, title: str,
                      gantt: bool = True, charts: Mapping[str, Callable[[], bytes]] | None = None) -> list[str]:
    """Write metrics, Chrome trace and (unless ``gantt`` is false) the Gantt chart and the other ``charts`` (file
    name → what draws its PNG bytes), all or none; returns the file names.

    Raises:
        SpecError: ``out_dir`` cannot be made or written in, or a file cannot be written; nothing is left of this call.
    """
    with all_or_none():
        prepare_output_dir(out_dir, "output directory")
        write_json_atomic(metrics, out_dir / "metrics.json")
        write_chrome_trace(trace, out_dir / "trace.json")
        names = ["metrics.json", "trace.json"]
        if gantt:
            from sim.report.gantt import draw_gantt  # matplotlib only when a picture is wanted

            # The title says where the devices' time went, so the picture is never read without it.
            draw_gantt(trace, out_dir / "gantt.png", title=f"{title} · {split_text(metrics)}")
            names.append("gantt.png")
            for name, draw in (charts or {}).items():
                write_bytes_atomic(out_dir / name, draw())
                names.append(name)
    return names


def _flop(flops: float) -> str:
    """FLOPs with the prefix that shows them best: ``3,795.4 TFLOP``, ``12.6 GFLOP``."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops:,.0f} FLOP"


def _gb(nbytes: float | None) -> str:
    return "unlimited" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def mfu_text(metrics: dict[str, Any]) -> str:
    """``metrics``' MFU with the peak it is against, and against the 16-bit peak beside any other: ``16.7 % of FP8
    peak (33.4 % of BF16 peak)``."""
    precision = metrics["mfu_peak"]["precision"]
    text = f"{metrics['mfu'] * 100:.1f} % of {precision.upper()} peak"
    if precision != "bf16" and metrics.get("mfu_bf16") is not None:
        text += f" ({metrics['mfu_bf16'] * 100:.1f} % of BF16 peak)"
    return text


def _interval_text(interval: dict[str, Any] | None, scale: float, spec: str, unit: str) -> str:
    """`` (90 % interval 1.234-1.456 ms)`` for a prediction's interval, or nothing without one."""
    if interval is None or interval.get("low") is None:
        return ""
    return (f" ({interval['level'] * 100:.0f} % interval {interval['low'] * scale:{spec}}-"
            f"{interval['high'] * scale:{spec}}"
            f"{unit})")


def calibration_text(interval: dict[str, Any], regime: dict[str, str]) -> str:
    """What a prediction's interval rests on, in one line: how many published runs share which features of its
    regime, and along which features it lies outside the validated regimes (:mod:`sim.report.interval`)."""
    if interval.get("low") is None:
        return "no published run to calibrate an interval on (profiles/calibration/residuals.csv absent or empty)"
    matched = ", ".join(f"{name} {regime.get(name, '?')}" for name in interval["matched"])
    text = f"interval from {interval['runs']:,} published runs" + (f" sharing its {matched}" if matched else "")
    if interval["relaxed"]:
        outside = ", ".join(f"{name} {regime.get(name, '?')}" for name in interval["relaxed"])
        text += f"; outside the validated regimes: fewer than {MIN_RUNS} published runs share its {outside} as well"
    return text


def format_summary(metrics: dict[str, Any], *, unit: str = "samples") -> str:
    """Human summary of ``metrics.json``: iteration time, throughput, where the devices' time goes (compute, pipeline
    bubble, exposed communication by kind), MFU against its named peak, and per-device busy/memory.

    ``unit="subnets"`` (a CSP run) reports ``csp.subnets_per_s`` beside the samples/s.
    """
    throughput = f"{metrics['throughput_samples_per_s'] or 0:.2f} samples/s"
    if unit == "subnets":
        throughput = f"{metrics['csp']['subnets_per_s'] or 0:.2f} subnets/s ({throughput})"
    lines = [
        f"{'run time' if unit == 'subnets' else 'iteration time':<18}{metrics['iteration_time_s'] * 1e3:.3f} ms"
        + _interval_text(metrics.get("iteration_time_s_interval"), 1e3, ".3f", " ms"),
        f"throughput        {throughput}",
        f"device time       {split_text(metrics)}",
    ]
    if metrics.get("tokens_per_s") is not None:
        lines.append(f"tokens            {metrics['tokens_per_s']:,.0f} tokens/s, "
                     f"{metrics['tokens_per_s_per_device']:,.0f} per device"
                     + _interval_text(metrics.get("tokens_per_s_per_device_interval"), 1, ",.0f", ""))
    interval = metrics.get("iteration_time_s_interval")
    if interval is not None:
        lines.append(f"trust             {calibration_text(interval, metrics.get('regime', {}))}")
    if metrics.get("mfu") is not None:
        lines.append(f"model FLOPs       {_flop(metrics['model_flops_per_iteration'])} per iteration, "
                     f"MFU {mfu_text(metrics)}")
    devices = metrics["devices"]
    # Named as the Gantt chart names them; a measured run without --measure-memory has no memory to show, and then
    # no memory column either, rather than an empty one.
    names = [rank_label(d["rank"], d["device"], d.get("device_rank")) for d in devices]
    width = max([21, *map(len, names)])
    memory = any("peak_memory_bytes" in d for d in devices)
    reserved = any("reserved_memory_bytes" in d for d in devices)
    header = f"{'per device':<{width + 3}}{'busy':>9}     bubble  exposed"  # each heading over its column
    lines.append(header + ("" if not memory else "   peak memory allocated, reserved / capacity" if reserved
                           else "   peak memory / capacity"))
    for name, device in zip(names, devices):
        exposed = sum(device["exposed_comm_fraction"].values())
        line = (f"  {name:<{width}} {device['busy_s'] * 1e3:9.3f} ms  {device['bubble_fraction'] * 100:5.1f} %"
                f"  {exposed * 100:5.1f} %")
        if "peak_memory_bytes" in device:
            held = device.get("reserved_memory_bytes")
            line += (f"   {_gb(device['peak_memory_bytes'])}{'' if held is None else ', ' + _gb(held)} / "
                     f"{_gb(device.get('memory_capacity_bytes'))}")
        lines.append(line)
    return "\n".join(lines)
