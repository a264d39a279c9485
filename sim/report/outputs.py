"""Writing a run's outputs: ``metrics.json``, ``trace.json`` and ``gantt.png`` (DESIGN §1).

Simulated runs (``sim.run``) and real runs (``executor.run``) both call :func:`write_run_outputs`, so the files mean
the same thing whichever produced them. Every file is written atomically; a failed run leaves no file that looks
complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.core.fileio import write_json_atomic
from sim.ir.trace import Trace
from sim.report.chrome_trace import write_chrome_trace

__all__ = ["write_run_outputs", "format_summary"]


def write_run_outputs(out_dir: Path, trace: Trace, metrics: dict[str, Any], *, title: str,
                      gantt: bool = True) -> list[str]:
    """Write metrics, Chrome trace and (unless ``gantt`` is false) the Gantt chart; returns the file names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(metrics, out_dir / "metrics.json")
    write_chrome_trace(trace, out_dir / "trace.json")
    names = ["metrics.json", "trace.json"]
    if gantt:
        from sim.report.gantt import draw_gantt  # matplotlib only when a picture is wanted

        draw_gantt(trace, out_dir / "gantt.png", title=title)
        names.append("gantt.png")
    return names


def _gb(nbytes: float | None) -> str:
    return "unlimited" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def format_summary(metrics: dict[str, Any]) -> str:
    """Human summary of ``metrics.json``: iteration time, throughput, bubble, and per-device busy/memory."""
    lines = [
        f"iteration time    {metrics['iteration_time_s'] * 1e3:.3f} ms",
        f"throughput        {metrics['throughput_samples_per_s'] or 0:.2f} samples/s",
        f"bubble fraction   {metrics['bubble_fraction']:.4f}",
        "per device        busy        bubble   peak memory / capacity",
    ]
    for device in metrics["devices"]:
        memory = ""
        if "peak_memory_bytes" in device:
            memory = f"{_gb(device['peak_memory_bytes'])} / {_gb(device.get('memory_capacity_bytes'))}"
        lines.append(f"  r{device['rank']:<3} {device['device']:<16} {device['busy_s'] * 1e3:9.3f} ms  "
                     f"{device['bubble_fraction']:.4f}   {memory}")
    return "\n".join(lines)
