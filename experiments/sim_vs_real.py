"""Simulator fidelity: predict each plan with a calibrated profile, run it for real, compare.

Procedure, on this host with 2 CPU ranks (topology ``2xcpu``, gloo):

1. **Calibrate.** Simulate a 1F1B plan with ``--calibrate-m`` microbatches and run it with ``executor.run
   --calibrate-out``: the per-stage F, B and optimizer-step medians measured in place (every rank busy) and the
   point-to-point fit become ``calibration.json``. This run is not one of the cases below, and by default (m = 6) not
   their plan either, so no case is predicted from a run of itself. A calibration that shared the host with another
   process, or whose stage medians moved by more than 3 % between its first and second half, is run again (up to
   :data:`CALIBRATION_TRIES` runs; the steadiest is kept).
2. **Predict and measure each case.** For every schedule in {gpipe, 1f1b} and microbatch count in {4, 8, 16}:
   ``sim.run --profile calibration.json`` writes the plan and its prediction, ``executor.run`` runs that plan and
   writes ``compare.json`` (predicted vs the median measured iteration).
3. **Calibrate again** after the cases, the same way (``calibration-2.json``), and predict every case from it too.
   The two predictions differ only by the calibration's own noise (the machine's speed at two times a minute apart),
   so their difference is the run-to-run spread of the profile, reported beside the error; the error itself is the
   first calibration's, made before any case ran.
4. **Report** per case the prediction, the measured median and the measured iterations' min–max (the measurement's
   own spread), the error, and the CPU that other processes used during the run (:mod:`experiments.host_load`);
   then the median and the maximum |error| against the issue's target (median ≤ 3 %, max ≤ 8 %). A run during
   which other processes kept more than :data:`BUSY_CORES` of a core busy is marked: its error measures them;
   ``--wait-idle S`` lets each run first wait up to S seconds for them to go quiet.
   ``--schedules`` adds the rest of the family (interleaved, zb1p, pipedream, 1f1b-recompute), each predicted from
   the same 1F1B calibration. Published simulators reach 3–9 % on GPUs (``../shared/reference/simulators.md``).

Everything goes through the command-line tools, so the numbers are what a user of the product would get.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.calibration import MAX_HALF_DRIFT
from experiments.host_load import foreign_cores, snapshot, wait_until_idle
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_json_atomic, write_text_atomic

__all__ = ["Result", "parser", "run", "report", "write", "wrote", "run_cases", "summarize", "format_table", "spread",
           "run_module", "TARGET_MEDIAN", "TARGET_MAX", "BUSY_CORES"]

DEFAULT_MODEL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"
#: Case name → ``sim.run`` flags. Interleaving uses 2 chunks per rank; ``-recompute`` adds activation recomputation.
CASES: dict[str, list[str]] = {
    "gpipe": ["--schedule", "gpipe"],
    "1f1b": ["--schedule", "1f1b"],
    "interleaved": ["--schedule", "interleaved", "--chunks", "2"],
    "zb1p": ["--schedule", "zb1p"],
    "pipedream": ["--schedule", "pipedream"],
    "1f1b-recompute": ["--schedule", "1f1b", "--recompute"],
}
#: The target for the default cases, two separate runs each on a fresh 2-core machine: median |error| <= 3 %,
#: max <= 8 %.
TARGET_MEDIAN, TARGET_MAX = 0.03, 0.08
#: Cores other processes may keep busy, on average over a run, before the run is marked as measured on a busy host
#: (a quarter of a core: on 2 cores, one other busy process slows each rank by 30-40 %, a quarter of that is already
#: above the 3 % target).
BUSY_CORES = 0.25
#: A run whose iterations range over more than this fraction of their median is marked unsteady: on an idle machine
#: the default cases ranged over 3-13 %; a run in which the machine slowed down without any other process using CPU
#: (the VM's host, invisible from inside) ranged over 54 %.
UNSTEADY_RANGE = 0.25
#: Measured iterations of a calibration run (see executor.calibration.MIN_STABLE_ITERATIONS for why not fewer).
CALIBRATE_ITERATIONS = 9
#: Runs a calibration may take to be steady (see _calibrate): on the shared development box, 4 of the 6 calibrations
#: of three full runs shared the host with another agent's job, and one such profile was 4-6 % slow.
CALIBRATION_TRIES = 3


def run_module(module: str, *args: str) -> str:
    """Run ``python -m module args``; its stdout, or SpecError with the tail of its stderr."""
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
        raise SpecError(f"python -m {module} {' '.join(args)} failed (status {result.returncode}): "
                        + " | ".join(tail))
    return result.stdout


def _measure(wait_idle_s: float, *args: str) -> float | None:
    """``executor.run args``, after waiting up to ``wait_idle_s`` s for an idle host; the cores other processes used
    during the run (:func:`foreign_cores`)."""
    if wait_idle_s > 0:
        wait_until_idle(wait_idle_s, BUSY_CORES / 2)
    before = snapshot()
    run_module("executor.run", *args)
    return foreign_cores(before, snapshot())


def _simulate(out: Path, model: str, case: str, m: int, mbs: int, profile: Path | None) -> tuple[Path, float]:
    """Simulate one case; its plan's path and its predicted iteration time in s."""
    args = ["--topology", "2xcpu", "--model", model, *CASES[case], "-m", str(m), "--microbatch-size",
            str(mbs), "--partition", "balanced", "--out", str(out)]
    if profile is not None:
        args += ["--profile", str(profile)]
    run_module("sim.run", *args)
    return out / "plan.json", json.loads((out / "metrics.json").read_text())["iteration_time_s"]


def _quiet(line: str) -> None:
    """The default progress: none."""


def _calibrate(out: Path, name: str, model: str, m: int, mbs: int, iterations: int, warmup: int,
               wait_idle_s: float, progress: Callable[[str], None] = _quiet) -> tuple[float | None, int]:
    """Run the calibration plan (1F1B, ``m`` microbatches) with ``--calibrate-out``, again (up to
    :data:`CALIBRATION_TRIES` runs in all) while a run shared the host or its stage medians drifted by more than
    ``executor.calibration.MAX_HALF_DRIFT``; ``out/name.json`` is the first steady run's profile, else the one that
    drifted least. Returns that run's foreign cores and how many runs were made; ``progress`` is given a line per
    step."""
    plan, _ = _simulate(out / f"{name}-sim", model, "1f1b", m, mbs, None)
    tried: list[tuple[bool, float, str, float | None]] = []  # (shared the host, drift, profile text, foreign cores)
    for attempt in range(1, CALIBRATION_TRIES + 1):
        progress(f"{name}: 1f1b, m={m}, {iterations} iterations ...")
        profile = out / f"{name}-run{attempt}.json"
        busy = _measure(wait_idle_s, "--plan", str(plan), "--out", str(out / f"{name}-real"), "--iterations",
                        str(iterations), "--warmup", str(warmup), "--calibrate-out", str(profile), "--no-gantt")
        text = profile.read_text()
        stability = json.loads(text)["method"]["stability"]
        progress(f"  stage medians moved {stability['max_half_drift'] * 100:.1f}% between the run's halves, IQR up "
                 f"to {stability['max_relative_iqr'] * 100:.1f}% of the median{_busy_note(busy)}")
        shared = (busy or 0.0) > BUSY_CORES
        tried.append((shared, stability["max_half_drift"], text, busy))
        if not shared and stability["max_half_drift"] <= MAX_HALF_DRIFT:
            break
        if attempt < CALIBRATION_TRIES:
            progress("  unsteady (another process, or the machine's speed moved): calibrating again")
    shared, drift, text, busy = min(tried, key=lambda run: run[:2])
    if len(tried) > 1:
        progress(f"  using run {[run[2] for run in tried].index(text) + 1} of {len(tried)} (drift {drift * 100:.1f}%)")
    write_text_atomic(text, out / f"{name}.json")
    return busy, len(tried)


def spread(times: list[float]) -> dict[str, float]:
    """``min_s``, ``max_s`` and ``range``, (max - min) / median, of a run's measured iteration times (s)."""
    median = statistics.median(times)
    return {"min_s": min(times), "max_s": max(times), "range": (max(times) - min(times)) / median}


def run_cases(out: Path, *, model: str, schedules: list[str], microbatches: list[int], microbatch_size: int,
              iterations: int, warmup: int, calibrate_m: int,
              calibrate_iterations: int, wait_idle_s: float = 0.0,
              progress: Callable[[str], None] = _quiet) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Calibrate, predict and measure every case, calibrate again; one row per case and the calibrations' record.
    Each run first waits up to ``wait_idle_s`` s for other processes to go quiet (:func:`wait_until_idle`);
    ``progress`` is given a line per calibration step and per case."""
    calibration, recalibration = out / "calibration.json", out / "calibration-2.json"
    cal_args = (model, calibrate_m, microbatch_size, calibrate_iterations, warmup, wait_idle_s)
    first = _calibrate(out, "calibration", *cal_args, progress)
    rows = []
    for schedule in schedules:
        for m in microbatches:
            case = out / f"{schedule}-m{m}"
            plan, _ = _simulate(case / "sim", model, schedule, m, microbatch_size, calibration)
            busy = _measure(wait_idle_s, "--plan", str(plan), "--out", str(case / "real"), "--iterations",
                            str(iterations), "--warmup", str(warmup))
            compare = json.loads((case / "real" / "compare.json").read_text())
            row = {"schedule": schedule, "microbatches": m,
                   "predicted_s": compare["predicted_iteration_time_s"],
                   "measured_s": compare["measured_iteration_time_s"],
                   "relative_error": compare["relative_error"],
                   "measured_iterations_s": compare["measured_iterations_s"],
                   "measured_spread": spread(compare["measured_iterations_s"]),
                   "foreign_cores": busy,
                   "ops": compare["ops"]}
            rows.append(row)
            progress(f"  {schedule:<6} m={m:<3} predicted {row['predicted_s'] * 1e3:8.1f} ms   measured "
                     f"{row['measured_s'] * 1e3:8.1f} ms ({row['measured_spread']['min_s'] * 1e3:.0f}-"
                     f"{row['measured_spread']['max_s'] * 1e3:.0f})   error {row['relative_error'] * 100:+6.1f}%"
                     f"{_busy_note(busy)}")
    second = _calibrate(out, "calibration-2", *cal_args, progress)
    calibrations = {"foreign_cores": [first[0], second[0]], "runs": [first[1], second[1]]}
    for row in rows:
        _, again = _simulate(out / f"{row['schedule']}-m{row['microbatches']}" / "sim-2", model, row["schedule"],
                             row["microbatches"], microbatch_size, recalibration)
        row["predicted_2_s"] = again
        row["relative_error_2"] = again / row["measured_s"] - 1  # compare.json's convention: predicted / measured − 1
    return rows, calibrations


def _busy_note(cores: float | None) -> str:
    return f"   [others used {cores:.2f} cores]" if cores is not None and cores > BUSY_CORES else ""


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and maximum |relative error| over the cases, with the spreads they are to be read against.

    ``calibration_spread``: the largest |relative difference| between a case's predictions from the two calibrations
    (absent when the rows have no second prediction); ``measured_range``: the median over the cases of their measured
    iterations' (max - min) / median; ``busy_runs``: how many runs had other processes using more than
    :data:`BUSY_CORES` cores; ``unsteady_runs``: how many had iterations ranging over more than
    :data:`UNSTEADY_RANGE` of their median.
    """
    errors = [abs(row["relative_error"]) for row in rows]
    summary: dict[str, Any] = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
    if all("predicted_2_s" in row for row in rows):
        summary["calibration_spread"] = max(abs(row["predicted_2_s"] - row["predicted_s"]) / row["predicted_s"]
                                            for row in rows)
        summary["median_abs_error_2"] = statistics.median(abs(row["relative_error_2"]) for row in rows)
        summary["max_abs_error_2"] = max(abs(row["relative_error_2"]) for row in rows)
    if all("measured_spread" in row for row in rows):
        summary["measured_range"] = statistics.median(row["measured_spread"]["range"] for row in rows)
    summary["busy_runs"] = sum(1 for row in rows if (row.get("foreign_cores") or 0.0) > BUSY_CORES)
    summary["unsteady_runs"] = sum(1 for row in rows if "measured_spread" in row
                                   and row["measured_spread"]["range"] > UNSTEADY_RANGE)
    summary["target_met"] = summary["median_abs_error"] <= TARGET_MEDIAN and summary["max_abs_error"] <= TARGET_MAX
    return summary


def format_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """A Markdown table of the cases plus the summary lines."""
    lines = ["| schedule | m | predicted (ms) | measured median (ms) | measured min–max (ms) | error | "
             "error, 2nd calibration | others' cores |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        low_high = (f"{row['measured_spread']['min_s'] * 1e3:.1f}–{row['measured_spread']['max_s'] * 1e3:.1f}"
                    if "measured_spread" in row else "–")
        second = f"{row['relative_error_2'] * 100:+.1f}%" if "relative_error_2" in row else "–"
        busy = row.get("foreign_cores")
        lines.append(f"| {row['schedule']} | {row['microbatches']} | {row['predicted_s'] * 1e3:.1f} | "
                     f"{row['measured_s'] * 1e3:.1f} | {low_high} | {row['relative_error'] * 100:+.1f}% | {second} | "
                     f"{'–' if busy is None else f'{busy:.2f}'} |")
    lines.append("")
    lines.append(f"median |error| {summary['median_abs_error'] * 100:.1f}% (target ≤ {TARGET_MEDIAN * 100:.0f}%), "
                 f"max |error| {summary['max_abs_error'] * 100:.1f}% (target ≤ {TARGET_MAX * 100:.0f}%): "
                 f"{'target met' if summary['target_met'] else 'target NOT met'}")
    spreads = []
    if "measured_range" in summary:
        spreads.append(f"measured iterations' (max - min) / median, median over the cases "
                       f"{summary['measured_range'] * 100:.1f}%")
    if "calibration_spread" in summary:
        spreads.append(f"a second calibration after the cases moves the predictions by up to "
                       f"{summary['calibration_spread'] * 100:.1f}% (its errors: median "
                       f"{summary['median_abs_error_2'] * 100:.1f}%, max {summary['max_abs_error_2'] * 100:.1f}%)")
    if spreads:
        lines.append("spread of the measurement: " + "; ".join(spreads))
    if summary["busy_runs"]:
        lines.append(f"warning: during {summary['busy_runs']} run(s) other processes used more than {BUSY_CORES} of "
                     f"a core on average: those errors include their load; measure again on an idle machine")
    if summary["unsteady_runs"]:
        lines.append(f"warning: in {summary['unsteady_runs']} run(s) the iterations ranged over more than "
                     f"{UNSTEADY_RANGE * 100:.0f}% of their median: the machine's speed changed during them")
    if summary.get("busy_calibrations"):
        lines.append(f"warning: during {summary['busy_calibrations']} calibration run(s) other processes used more "
                     f"than {BUSY_CORES} of a core on average: the profile includes their load")
    return "\n".join(lines)


def _positive_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SpecError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SpecError(f"expected comma-separated positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class Result:
    """The settings, one row per case (predicted and measured iteration times in s, the error, the spread, the
    second calibration's prediction, the per-op comparison) and the summary (medians, maxima, the verdict, the
    calibrations' load and runs)."""

    settings: dict[str, Any]
    cases: tuple[dict[str, Any], ...]
    summary: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        """What ``results.json`` holds."""
        return {**self.settings, "cases": list(self.cases), **self.summary}


def parser() -> CliParser:
    """``python -m experiments.run sim_vs_real [options]``."""
    parser = CliParser(prog="python -m experiments.run sim_vs_real", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/sim_vs_real", help="output directory (default runs/sim_vs_real)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    parser.add_argument("--schedules", default="gpipe,1f1b", help=f"comma-separated cases from {', '.join(CASES)} "
                        "(default gpipe,1f1b, the issue's benchmark)")
    parser.add_argument("--microbatches", default="4,8,16", help="comma-separated (default 4,8,16)")
    parser.add_argument("--microbatch-size", type=int, default=2, help="samples per microbatch (default 2)")
    # Odd, so the median measured iteration is the middle one, not the lower of two (executor.compare).
    parser.add_argument("--iterations", type=int, default=7, help="measured iterations per run (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations per run (default 2)")
    parser.add_argument("--calibrate-m", type=int, default=6, help="microbatches of the calibration run (default 6, "
                        "a plan none of the default cases runs)")
    parser.add_argument("--calibrate-iterations", type=int, default=CALIBRATE_ITERATIONS,
                        help=f"measured iterations of each calibration run (default {CALIBRATE_ITERATIONS})")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before each run, wait up to S seconds until other processes use at most "
                        f"{BUSY_CORES / 2} of a core (default 0: do not wait); runs that still share the host are "
                        "marked in the table either way")
    return parser


def run(*, out: Path, model: str = DEFAULT_MODEL, schedules: str = "gpipe,1f1b", microbatches: str = "4,8,16",
        microbatch_size: int = 2, iterations: int = 7, warmup: int = 2, calibrate_m: int = 6,
        calibrate_iterations: int = CALIBRATE_ITERATIONS, wait_idle: float = 0.0,
        progress: Callable[[str], None] = _quiet) -> Result:
    """Calibrate, predict and measure every case of ``schedules`` × ``microbatches`` (comma-separated) on 2 CPU
    ranks, calibrate again; every run's directory is written into ``out``; ``progress`` is given a line per step.

    Raises:
        SpecError: an unknown case, a count below 1 or a negative wait (each named by its flag).
    """
    counts = _positive_list(microbatches)
    cases = [s for s in schedules.split(",") if s]
    unknown = [s for s in cases if s not in CASES]
    if unknown or not cases:
        raise SpecError(f"unknown case(s) {unknown or schedules!r} (known: {', '.join(CASES)})")
    for name, value in (("--microbatch-size", microbatch_size), ("--iterations", iterations),
                        ("--calibrate-m", calibrate_m), ("--calibrate-iterations", calibrate_iterations)):
        if value < 1:
            raise SpecError(f"{name} must be >= 1, got {value}")
    if not wait_idle >= 0:  # also NaN
        raise SpecError(f"--wait-idle must be >= 0 seconds, got {wait_idle}")
    rows, calibrations = run_cases(out, model=model, schedules=cases, microbatches=counts,
                                   microbatch_size=microbatch_size, iterations=iterations, warmup=warmup,
                                   calibrate_m=calibrate_m, calibrate_iterations=calibrate_iterations,
                                   wait_idle_s=wait_idle, progress=progress)
    summary = summarize(rows)
    summary["busy_calibrations"] = sum(1 for cores in calibrations["foreign_cores"] if (cores or 0.0) > BUSY_CORES)
    settings = {"model": model, "microbatch_size": microbatch_size, "iterations": iterations, "warmup": warmup,
                "calibration_microbatches": calibrate_m, "calibration_iterations": calibrate_iterations,
                "calibration_foreign_cores": calibrations["foreign_cores"], "calibration_runs": calibrations["runs"],
                "busy_cores_limit": BUSY_CORES, "target": {"median_abs_error": TARGET_MEDIAN,
                                                          "max_abs_error": TARGET_MAX}}
    return Result(settings, tuple(rows), summary)


def report(result: Result) -> str:
    """The table of cases against the targets (the progress lines before it went to ``progress``)."""
    return format_table(list(result.cases), result.summary)


def write(result: Result, out: Path) -> list[Path]:
    """``results.json`` and ``table.md`` in ``out``, beside the calibrations and one directory per case."""
    write_json_atomic(result.as_json(), out / "results.json")
    write_text_atomic(format_table(list(result.cases), result.summary) + "\n", out / "table.md")
    return [out / "results.json", out / "table.md"]


def wrote(out: Path, files: list[Path]) -> str:
    """The ``wrote`` line, naming the calibrations and case directories ``run`` wrote."""
    return f"wrote {out}/{{results.json, table.md, calibration.json, calibration-2.json}} and one directory per case"
