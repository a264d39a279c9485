"""A real run on emulated mixed hardware: does the plan searched for a cluster with one slower device beat, measured,
the plan searched believing the cluster homogeneous, and does its prediction hold? The search's hardware awareness,
measured rather than simulated.

Procedure, on this host's CPU with N executor ranks (default 2), rank R slowed F times (default rank 1, F = 2):

1. **The cluster.** ``mixed.yaml`` is N ``cpu`` ranks on this host with ``slowdown: {R: F}`` (``sim.hw.grammar``): the
   cluster ``executor.run --slowdown R:F`` emulates. The homogeneous belief is ``Nxcpu``.
2. **Calibrate.** A 1F1B plan on ``Nxcpu`` (``--calibrate-m`` microbatches of ``--calibrate-microbatch-size``)
   runs with ``executor.run --calibrate-out``, without any slowdown: ``calibration.json`` is the ``cpu`` profile.
   The slowed rank's costs are that profile times F: the oracle applies a ``cpu`` profile to a slowed copy of
   ``cpu`` and multiplies every compute time by its factor (``sim.cost.oracle``), as the emulation stretches every
   compute op by F; messages keep the profile's measured point-to-point fit (the emulation does not slow them).
3. **Search** with that profile (``python -m sim.search``): on ``mixed.yaml`` (the *searched* plan), on ``Nxcpu``
   (the *homogeneous-assumption* plan, the best plan for the cluster believed homogeneous), and on ``Nxcpu`` over
   pipeline plans only (``--candidates`` with TP = DP = 1: the *homogeneous pipeline* plan, an even split, which
   isolates what the partition and placement choice is worth). The plans are chosen once.
4. **Measure and predict**, in ``--repeats`` rounds. Each round runs every plan once in turn with ``executor.run
   --slowdown R:F`` (``--warmup`` then ``--iterations`` measured iterations), so a change in the host's load hits
   the plans alike, and predicts each plan on the mixed cluster (``sim.predict.predict`` with ``mixed.yaml``: the
   plan as written, its costs as the cluster is) from a calibration made just before the round (the first round
   uses step 2's; each later one calibrates again). Why again: on the shared 2-core machine the speed of a rank
   follows the other processes' load, which changes within minutes (a calibration made while another job kept a
   core busy predicted 2.1 s for a plan that ran in 1.0 s once that job had ended), and a prediction is only as
   good as the profile's conditions match the run's. A run's time is its median iteration; each run and each
   calibration records the CPU other processes used meanwhile (:mod:`experiments.host_load`).
5. **Verdict** against the issue's targets: the searched plan is *faster* when in every round its run was faster
   than the homogeneous-assumption plan's, and its prediction is *within 10 %* when every one of its runs' measured
   time is within 10 % of its round's prediction.

What the emulation cannot be: a slowed rank sleeps through its stretch and gives its core back, so on a host whose
cores are shared with other processes the ranks' speeds depend on which of them compute at that moment, and a sleep
under load wakes late (``executor.slowdown``), neither of which a device that is really slower would cause. On the
shared 2-core machine the plans whose bottleneck is the slowed rank ran up to 17 % slower than predicted and the
searched plan, whose bottleneck is the fast rank, up to 14 % faster; the causes were not separated.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.calibration import MAX_HALF_DRIFT, MIN_STABLE_ITERATIONS
from experiments.host_load import foreign_cores, snapshot, wait_until_idle
from experiments.sim_vs_real import BUSY_CORES, run_module, spread
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_json_atomic, write_text_atomic
from sim.cost.profile import load_profile
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.predict import predict

__all__ = ["Result", "parser", "run", "report", "write", "wrote", "write_topology", "pipeline_settings",
           "predicted_on", "measure", "summarize", "format_table", "PLANS", "TARGET_ERROR", "DEFAULT_MODEL"]

DEFAULT_MODEL = "gpt:layers=8,hidden=256,heads=4,seq=128,vocab=1000"
#: The issue's target for the searched plan: |measured - predicted| / measured <= 10 % in every run.
TARGET_ERROR = 0.10
#: The plans compared, in the order of the table and of each round of runs: name → what it is.
PLANS = {
    "searched": "sim.search on the mixed cluster",
    "homogeneous": "sim.search on the cluster believed homogeneous",
    "homogeneous-pipeline": "the same over pipeline plans only (TP = DP = 1)",
}


def write_topology(path: Path, ranks: int, slow_rank: int, factor: float) -> str:
    """Write the mixed cluster's topology file (``ranks`` cpu ranks, ``slow_rank`` slowed ``factor`` times) and
    return its spec (its path)."""
    write_text_atomic(f"# {ranks} executor ranks on this host; rank {slow_rank} computes {factor:g}x slower, as "
                      f"executor.run --slowdown {slow_rank}:{factor:g} emulates\n"
                      f"nodes:\n  - {{device: cpu, count: {ranks}}}\nslowdown: {{{slow_rank}: {factor!r}}}\n", path)
    return str(path)


def pipeline_settings(ranks: int, global_batch: int) -> str:
    """``--candidates`` CSV of the pipeline plans on ``ranks`` ranks: TP = DP = 1, PP = ``ranks``, every power-of-two
    microbatch size up to ``global_batch`` (the search's own default sizes)."""
    sizes, size = [], 1
    while size <= global_batch:
        sizes.append(size)
        size *= 2
    return "tp,dp,pp,microbatch_size\n" + "".join(f"1,1,{ranks},{b}\n" for b in sizes)


def predicted_on(plan_path: Path, topology: str, profile: Path | None) -> float:
    """Predicted iteration time (s) of the plan at ``plan_path`` on ``topology``, with ``profile`` where it applies:
    the one prediction path, for the plan as written on a cluster other than the one it was planned for."""
    plan = Plan.loads(plan_path.read_text(), str(plan_path))
    loaded = load_profile(profile) if profile is not None else None
    return predict(plan, loaded, topology=Topology.parse(topology), check_memory=False).metrics["iteration_time_s"]


def measure(plan_path: Path, out: Path, *, slowdown: str, iterations: int, warmup: int,
            wait_idle_s: float = 0.0) -> dict[str, Any]:
    """Run the plan with ``executor.run --slowdown`` once: its median iteration (s), every measured iteration (s),
    the executor's own prediction (the plan's, s) and the cores other processes used meanwhile."""
    if wait_idle_s > 0:
        wait_until_idle(wait_idle_s, BUSY_CORES / 2)
    before = snapshot()
    run_module("executor.run", "--plan", str(plan_path), "--out", str(out), "--iterations", str(iterations),
          "--warmup", str(warmup), "--slowdown", slowdown, "--no-gantt")
    busy = foreign_cores(before, snapshot())
    compare = json.loads((out / "compare.json").read_text())
    return {"median_s": compare["measured_iteration_time_s"], "iterations_s": compare["measured_iterations_s"],
            "executor_predicted_s": compare["predicted_iteration_time_s"], "foreign_cores": busy, "dir": str(out)}


def _quiet(line: str) -> None:
    """The default progress: none."""


def _calibrate(out: Path, ranks: int, model: str, m: int, mbs: int, iterations: int, warmup: int,
               name: str = "calibration", wait_idle_s: float = 0.0,
               progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """Calibrate into ``out/name.json`` (again once if the run shared the host or its stage medians drifted; the
    steadier is kept); its record. ``progress`` is given a line per step."""
    run_module("sim.run", "--topology", f"{ranks}xcpu", "--model", model, "--schedule", "1f1b", "-m", str(m),
          "--microbatch-size", str(mbs), "--partition", "balanced", "--no-gantt", "--out", str(out / "calibration-sim"))
    tried = []
    for attempt in (1, 2):
        progress(f"{name}: 1f1b on {ranks}xcpu, m={m}, {iterations} iterations ...")
        if wait_idle_s > 0:
            wait_until_idle(wait_idle_s, BUSY_CORES / 2)
        profile, before = out / f"{name}-run{attempt}.json", snapshot()
        run_module("executor.run", "--plan", str(out / "calibration-sim" / "plan.json"), "--out",
              str(out / "calibration-real"), "--iterations", str(iterations), "--warmup", str(warmup),
              "--calibrate-out", str(profile), "--no-gantt")
        busy = foreign_cores(before, snapshot())
        drift = json.loads(profile.read_text())["method"]["stability"]["max_half_drift"]
        tried.append(((busy or 0.0) > BUSY_CORES, drift, profile, busy))
        progress(f"  stage medians moved {drift * 100:.1f}% between the run's halves; others used "
                 f"{'?' if busy is None else f'{busy:.2f}'} cores")
        if not tried[-1][0] and drift <= MAX_HALF_DRIFT:
            break
    shared, drift, profile, busy = min(tried, key=lambda run: run[:2])
    write_text_atomic(profile.read_text(), out / f"{name}.json")
    return {"profile": str(out / f"{name}.json"), "runs": len(tried), "max_half_drift": drift, "foreign_cores": busy,
            "shared_host": shared}


def _search(out: Path, topology: str, model: str, global_batch: int, profile: Path, *extra: str) -> dict[str, Any]:
    """``sim.search`` into ``out``: its best candidate (``search.json``) and the plan's path."""
    run_module("sim.search", "--topology", topology, "--model", model, "--global-batch", str(global_batch), "--profile",
          str(profile), "--no-progress", "--out", str(out), *extra)
    best = json.loads((out / "search.json").read_text())["best"]
    return {"label": best["label"], "layer_counts": best["layer_counts"], "predicted_believed_s":
            best["iteration_time_s"], "plan": str(out / "plan.json"), "searched_on": topology}


def summarize(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Speed-ups and verdicts from the rows (plan name → ``runs``, each with its ``median_s``, ``iterations_s`` and
    ``predicted_s``, the prediction on the mixed cluster from its round's calibration); fills each row's
    ``measured_s`` and ``predicted_s`` (medians over its runs' iterations and predictions), ``spread`` and per-run
    ``errors`` (predicted / measured − 1, ``compare.json``'s convention: negative when the prediction is low).

    ``faster``: in every round the searched plan ran faster than the homogeneous-assumption plan.
    ``within_target``: every run of the searched plan is within :data:`TARGET_ERROR` of its prediction.
    """
    for row in rows.values():
        pooled = [t for run in row["runs"] for t in run["iterations_s"]]
        row["measured_s"] = statistics.median(pooled)
        row["predicted_s"] = statistics.median(run["predicted_s"] for run in row["runs"])
        row["spread"] = spread(pooled)
        row["errors"] = [run["predicted_s"] / run["median_s"] - 1 for run in row["runs"]]
    searched = rows["searched"]
    summary: dict[str, Any] = {"target_error": TARGET_ERROR}
    for name in (n for n in PLANS if n != "searched" and n in rows):
        other = rows[name]
        summary[name] = {
            "same_plan": (other["label"], other["layer_counts"]) == (searched["label"], searched["layer_counts"]),
            "speedup_measured": other["measured_s"] / searched["measured_s"],
            "speedup_predicted": other["predicted_s"] / searched["predicted_s"],
            "speedup_each_round": [o["median_s"] / s["median_s"] for s, o in zip(searched["runs"], other["runs"])],
        }
        summary[name]["faster"] = all(ratio > 1 for ratio in summary[name]["speedup_each_round"])
    summary["max_abs_error"] = max(abs(e) for e in searched["errors"])
    summary["within_target"] = summary["max_abs_error"] <= TARGET_ERROR
    summary["faster"] = summary["homogeneous"]["faster"]
    summary["target_met"] = summary["faster"] and summary["within_target"]
    summary["busy_runs"] = sum(1 for row in rows.values() for run in row["runs"]
                               if (run.get("foreign_cores") or 0.0) > BUSY_CORES)
    summary["load_changed_runs"] = sum(1 for row in rows.values() for run in row["runs"]
                                       if _load_changed(run))
    return summary


def _load_changed(run: dict[str, Any]) -> bool:
    """Whether other processes used more than :data:`BUSY_CORES` cores more, or less, during the run than during the
    calibration its prediction comes from (unknown counts as unchanged)."""
    now, then = run.get("foreign_cores"), run.get("calibration_foreign_cores")
    return now is not None and then is not None and abs(now - then) > BUSY_CORES


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def format_table(rows: dict[str, dict[str, Any]], summary: dict[str, Any], slowdown: str) -> str:
    """A Markdown table of the plans and the verdict lines (``summarize`` first)."""
    lines = ["| plan | picked by | label | layers per stage | predicted as believed (ms) | predicted on the mixed "
             "cluster, each round (ms) | measured, each round (ms) | min–max (ms) | error, each round | others' "
             "cores, run (calibration) |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def cores(value: float | None) -> str:
        return "?" if value is None else f"{value:.2f}"

    for name, row in rows.items():
        predicted = " / ".join(_ms(run["predicted_s"]) for run in row["runs"])
        runs = " / ".join(_ms(run["median_s"]) for run in row["runs"])
        errors = " / ".join(f"{e * 100:+.1f}%" for e in row["errors"])
        busy = " / ".join(f"{cores(r.get('foreign_cores'))} ({cores(r.get('calibration_foreign_cores'))})"
                          for r in row["runs"])
        lines.append(f"| {name} | {PLANS[name]} | {row['label']} | {','.join(map(str, row['layer_counts']))} | "
                     f"{_ms(row['predicted_believed_s'])} | {predicted} | {runs} | {_ms(row['spread']['min_s'])}–"
                     f"{_ms(row['spread']['max_s'])} | {errors} | {busy} |")
    lines.append("")
    lines.append(f"every run with executor.run --slowdown {slowdown}; a run's time is its median iteration; error = "
                 f"predicted on the mixed cluster from the round's calibration / measured - 1")
    for name in (n for n in PLANS if n in summary):
        verdict = summary[name]
        same = " (the same plan)" if verdict["same_plan"] else ""
        each = " / ".join(f"{ratio:.2f}x" for ratio in verdict["speedup_each_round"])
        lines.append(f"searched vs {name}{same}: measured speed-up {each} (each round), "
                     f"{verdict['speedup_measured']:.2f}x over all iterations; predicted "
                     f"{verdict['speedup_predicted']:.2f}x")
    lines.append(f"target: the searched plan runs faster than the homogeneous-assumption plan in "
                 f"every round: {'met' if summary['faster'] else 'NOT met'}; its prediction within "
                 f"{TARGET_ERROR * 100:.0f}% of every run (max |error| {summary['max_abs_error'] * 100:.1f}%): "
                 f"{'met' if summary['within_target'] else 'NOT met'}")
    if summary["busy_runs"]:
        lines.append(f"warning: during {summary['busy_runs']} run(s) other processes used more than {BUSY_CORES} of a "
                     f"core on average; their load is in those measurements")
    if summary["load_changed_runs"]:
        lines.append(f"warning: during {summary['load_changed_runs']} run(s) other processes used more than "
                     f"{BUSY_CORES} of a core more or less than during the calibration their prediction comes from; "
                     f"those errors measure the change in load")
    return "\n".join(lines)


@dataclass(frozen=True)
class Result:
    """The settings, the mixed cluster's topology file, the calibrations (one per round), each plan with its
    prediction as believed and its runs (measured median and iterations, prediction on the mixed cluster, s), and
    the summary (errors, verdicts, the load)."""

    settings: dict[str, Any]
    topology: str
    slowdown: str
    calibrations: tuple[dict[str, Any], ...]
    plans: dict[str, dict[str, Any]]
    summary: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        """What ``results.json`` holds."""
        s = self.settings
        return {"model": s["model"], "global_batch": s["global_batch"], "ranks": s["ranks"],
                "slowdown": {"rank": s["slow_rank"], "factor": s["factor"]}, "topology": self.topology,
                "iterations": s["iterations"], "warmup": s["warmup"], "repeats": s["repeats"],
                "calibrations": list(self.calibrations), "busy_cores_limit": BUSY_CORES, "plans": self.plans,
                **self.summary}


def parser() -> CliParser:
    """``python -m experiments.run mixed_real [options]``."""
    parser = CliParser(prog="python -m experiments.run mixed_real", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/mixed_real", help="output directory (default runs/mixed_real)")
    parser.add_argument("--quick", action="store_true", help=f"one round of runs and a calibration of "
                        f"{MIN_STABLE_ITERATIONS} iterations (about a minute less)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec (default {DEFAULT_MODEL})")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per iteration (default 16)")
    parser.add_argument("--ranks", type=int, default=2, help="executor ranks, 2 to 4 (default 2: the ranks share "
                        "this host's cores, and more than 2 on 2 cores measure the sharing)")
    parser.add_argument("--slow-rank", type=int, default=1, help="the rank slowed (default 1)")
    parser.add_argument("--factor", type=float, default=2.0, help="its slowdown (default 2)")
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up iterations per run (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of runs of every plan (default 2)")
    parser.add_argument("--calibrate-m", type=int, default=6, help="microbatches of the calibration plan (default 6)")
    parser.add_argument("--calibrate-microbatch-size", type=int, default=2, help="its microbatch size (default 2)")
    parser.add_argument("--calibrate-iterations", type=int, default=9, help="its measured iterations (default 9)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S", help="before each run, wait up to S "
                        f"seconds until other processes use at most {BUSY_CORES / 2} of a core (default 0)")
    return parser


def _check(o: dict[str, Any]) -> None:
    if not 2 <= o["ranks"] <= 4:
        raise SpecError(f"--ranks must be 2 to 4, got {o['ranks']}")
    if not 0 <= o["slow_rank"] < o["ranks"]:
        raise SpecError(f"--slow-rank must be a rank of the {o['ranks']} (0..{o['ranks'] - 1}), got {o['slow_rank']}")
    if not 1 < o["factor"] <= 1000:  # also NaN
        raise SpecError(f"--factor must be a number above 1 and at most 1000, got {o['factor']}")
    for name in ("global_batch", "iterations", "repeats", "calibrate_m", "calibrate_microbatch_size"):
        if o[name] < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be >= 1, got {o[name]}")
    if o["warmup"] < 0:
        raise SpecError(f"--warmup must be >= 0, got {o['warmup']}")
    if o["calibrate_iterations"] < MIN_STABLE_ITERATIONS:
        raise SpecError(f"--calibrate-iterations must be >= {MIN_STABLE_ITERATIONS} (the calibration's stability "
                        f"check), got {o['calibrate_iterations']}")
    if not o["wait_idle"] >= 0:
        raise SpecError(f"--wait-idle must be >= 0 seconds, got {o['wait_idle']}")


def run(*, out: Path, quick: bool = False, model: str = DEFAULT_MODEL, global_batch: int = 16, ranks: int = 2,
        slow_rank: int = 1, factor: float = 2.0, iterations: int = 3, warmup: int = 1, repeats: int = 2,
        calibrate_m: int = 6, calibrate_microbatch_size: int = 2, calibrate_iterations: int = 9,
        wait_idle: float = 0.0, progress: Callable[[str], None] = _quiet) -> Result:
    """Calibrate, search the mixed cluster and the homogeneous assumption, and run each plan ``repeats`` rounds on
    ``ranks`` CPU ranks with ``slow_rank`` slowed ``factor`` times (``quick``: one round, the shortest stable
    calibration); every file of the runs and searches is written into ``out``; ``progress`` is given a line per
    step.

    Raises:
        SpecError: a value out of range (named by its flag).
    """
    settings = {"model": model, "global_batch": global_batch, "ranks": ranks, "slow_rank": slow_rank,
                "factor": factor, "iterations": iterations, "warmup": warmup, "repeats": repeats,
                "calibrate_m": calibrate_m, "calibrate_microbatch_size": calibrate_microbatch_size,
                "calibrate_iterations": calibrate_iterations, "wait_idle": wait_idle}
    _check(settings)
    if quick:
        settings["repeats"], settings["calibrate_iterations"] = 1, MIN_STABLE_ITERATIONS
    calibrate = (out, ranks, model, calibrate_m, calibrate_microbatch_size, settings["calibrate_iterations"], 2)
    mixed = write_topology(out / "mixed.yaml", ranks, slow_rank, factor)
    slowdown = f"{slow_rank}:{factor:g}"
    calibration = _calibrate(*calibrate, wait_idle_s=wait_idle, progress=progress)
    profile = out / "calibration.json"
    write_text_atomic(pipeline_settings(ranks, global_batch), out / "pipeline-settings.csv")
    homogeneous = f"{ranks}xcpu"
    rows = {"searched": _search(out / "search-mixed", mixed, model, global_batch, profile),
            "homogeneous": _search(out / "search-homogeneous", homogeneous, model, global_batch, profile),
            "homogeneous-pipeline": _search(out / "search-homogeneous-pipeline", homogeneous, model, global_batch,
                                            profile, "--candidates", str(out / "pipeline-settings.csv"))}
    for name, row in rows.items():
        row["runs"] = []
        progress(f"{name}: {row['label']}, layers {row['layer_counts']}: predicted {_ms(row['predicted_believed_s'])} "
                 f"ms as believed")
    calibrations = [calibration]
    for repeat in range(1, settings["repeats"] + 1):
        round_profile = profile
        if repeat > 1:
            round_profile = out / f"calibration-round{repeat}.json"
            calibrations.append(_calibrate(*calibrate, name=round_profile.stem, wait_idle_s=wait_idle,
                                           progress=progress))
        for name, row in rows.items():
            measured = measure(Path(row["plan"]), out / f"run{repeat}-{name}", slowdown=slowdown,
                               iterations=iterations, warmup=warmup, wait_idle_s=wait_idle)
            measured["predicted_s"] = predicted_on(Path(row["plan"]), mixed, round_profile)
            measured["calibration"] = str(round_profile)
            measured["calibration_foreign_cores"] = calibrations[-1]["foreign_cores"]
            row["runs"].append(measured)
            progress(f"  round {repeat}, {name}: predicted {_ms(measured['predicted_s'])} ms on the mixed cluster, "
                     f"measured {_ms(measured['median_s'])} ms "
                     f"({', '.join(_ms(t) for t in measured['iterations_s'])})")
    return Result(settings, mixed, slowdown, tuple(calibrations), rows, summarize(rows))


def report(result: Result) -> str:
    """The table of plans, measured against predicted, and the verdicts (the progress lines went to ``progress``)."""
    return format_table(result.plans, result.summary, result.slowdown)


def write(result: Result, out: Path) -> list[Path]:
    """``results.json`` and ``table.md`` in ``out``, beside the cluster file, calibrations, searches and runs."""
    write_json_atomic(result.as_json(), out / "results.json")
    write_text_atomic(report(result) + "\n", out / "table.md")
    return [out / "results.json", out / "table.md"]


def wrote(out: Path, files: list[Path]) -> str:
    """The ``wrote`` line, naming what ``run`` wrote beside ``write``'s files."""
    return f"wrote {out}/{{results.json, table.md, mixed.yaml, calibration.json}}, the searches and the runs"
