"""Peak memory, predicted and measured: every schedule, with and without recomputation, and a DP and a TP plan, run on
CPU ranks with ``executor.run --measure-memory`` beside the simulator's peak per rank.

Procedure, on this host with N CPU ranks (``--ranks``, 2 to 4; gloo):

0. **Profile.** ``profiles.measure`` on this host's CPU measures the model's layers, their times and their memory
   (``profiles.layer_memory``: what each forward keeps, the transients of its forward and backward phases, what a
   split backward's I keeps for its W, the state bytes), and that the executor's gradients live per step. The plans
   are costed with it, as a user calibrates before predicting: the catalog's sizes describe fp16 Megatron training on
   GPUs, the executor trains in fp32 on the CPU.
1. **Plans.** For each case, the plan is built by ``sim.run``'s library path (``sim.plan.build.build_plan``): gpipe,
   1f1b, interleaved (2 chunks per rank), zb1p and pipedream, each with and without ``--recompute`` (full), on N
   pipeline ranks with a balanced partition; ``dp``, 1F1B with DP = N (each replica ``--microbatches`` microbatches);
   ``tp``, 1F1B with TP = N (skipped when N does not divide the heads), costed by the catalog's sizes: a profile
   measures whole layers, a TP plan runs shards of them.
2. **Runs.** ``executor.run --measure-memory`` on each plan: every rank counts its peak tensor memory over the
   measured iterations (``executor.memory``: live tensor storages, operator by operator, on the CPU), and
   ``compare.json``'s ``memory`` sets it beside the prediction's peak of that rank (``sim.predict.predict`` on the
   same plan: the simulator's memory ledger over ``sim.cost.oracle.CostOracle``'s bytes).
3. **Verdict** against the target: every rank's |predicted / measured − 1| within :data:`TARGET_ERROR`.
   The experiment reports what it measured whether or not the target is met.
4. **Per layer** (:func:`layer_breakdown`): for the embedding, one block and the head at the experiment's shapes,
   the catalog's bytes (Korthikanti et al. 2022's per-layer activations of fp16 Megatron training, ``workspace``,
   16 bytes of state per parameter) beside the profile's measured ones: why a CPU plan is predicted with a profile.
5. **Overhead** (``--overhead-repeats`` pairs, 0 to skip): the 1f1b case run alternately without and with
   ``--measure-memory``; the median iteration time of each, and how much slower counting made it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.sim_vs_real import run_module
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_json_atomic, write_text_atomic
from sim.cost.oracle import CostOracle
from sim.cost.profile import load_profile
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

__all__ = ["Result", "parser", "run", "report", "write", "run_experiment", "CASES", "QUICK_CASES", "TARGET_ERROR",
           "DEFAULT_MODEL", "plan_inputs", "run_case", "measure_profile", "layer_breakdown", "overhead", "summarize",
           "format_table"]

DEFAULT_MODEL = "gpt:layers=4,hidden=256,seq=128,vocab=1000"
#: The target: every rank's measured peak within 5 % of the predicted one.
TARGET_ERROR = 0.05
#: Case name → the ``sim.run`` choices besides model, topology and microbatches (``dp``/``tp`` take N ranks).
CASES: dict[str, dict[str, Any]] = {
    **{f"{name}{suffix}": {"schedule": name, "recompute": bool(suffix), **({"chunks": 2} if name == "interleaved"
                                                                          else {})}
       for name in ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream") for suffix in ("", "-recompute")},
    "dp": {"schedule": "1f1b", "dp": None},
    "tp": {"schedule": "1f1b", "tp": None},
}
#: What ``--quick`` (the test) runs.
QUICK_CASES = ("1f1b", "gpipe-recompute")


def plan_inputs(case: str, model: str, ranks: int, microbatches: int, microbatch_size: int,
                profile: Path | None = None) -> PlanInputs:
    """The ``sim.run`` inputs of one case on ``{ranks}xcpu``, costed with ``profile`` when given; the ``tp`` case is
    costed by the model's sizes (a profile measures whole layers, a TP plan runs shards of them)."""
    choices = dict(CASES[case])
    topology = f"{ranks}xcpu"
    measured = str(profile) if profile is not None else None
    if "dp" in choices:
        return PlanInputs(model, topology, choices["schedule"], microbatch_size=microbatch_size, dp=ranks,
                          global_batch=microbatches * microbatch_size * ranks, profile=measured)
    if "tp" in choices:
        return PlanInputs(model, topology, choices["schedule"], microbatches=microbatches,
                          microbatch_size=microbatch_size, tp=ranks)
    return PlanInputs(model, topology, microbatches=microbatches, microbatch_size=microbatch_size, profile=measured,
                      **choices)


def run_case(out: Path, case: str, inputs: PlanInputs, *, iterations: int, warmup: int,
             measure: bool = True) -> dict[str, Any]:
    """Build the case's plan, run it with ``executor.run``, and return its ``compare.json`` rows.

    Returns:
        ``case``, ``iteration_time_s`` (the measured median, s), ``predicted_time_s``, and ``ranks``: per process
        ``rank``, ``predicted_bytes``, ``measured_bytes`` and ``relative_error`` (``None`` unless ``measure``).
    """
    built = build_plan(inputs)
    case_dir = out / case
    case_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(built.plan.dumps(), case_dir / "plan.json")
    run_dir = case_dir / ("run" if measure else "run-unmeasured")
    run_module("executor.run", "--plan", str(case_dir / "plan.json"), "--out", str(run_dir), "--iterations",
               str(iterations), "--warmup", str(warmup), "--no-gantt", *(["--measure-memory"] if measure else []))
    compare = json.loads((run_dir / "compare.json").read_text())
    ranks = [{"rank": row["rank"], "predicted_bytes": row["predicted_peak_memory_bytes"],
              "measured_bytes": row["measured_peak_memory_bytes"], "relative_error": row["relative_error"]}
             for row in compare["memory"]["ranks"]]
    return {"case": case, "layout": built.plan.layout.describe(), "iteration_time_s": compare[
        "measured_iteration_time_s"], "predicted_time_s": compare["predicted_iteration_time_s"], "ranks": ranks}


def measure_profile(out: Path, model: str, microbatch_size: int, tp: int = 1) -> Path:
    """A measured profile of ``model`` on this host's CPU (``profiles.measure``): per layer its times and its memory
    (``profiles.layer_memory``), of one tensor-parallel shard of each layer where ``tp`` > 1. Timing repeats are few
    (3 after 1 warm-up): the experiment is about memory, whose figures do not vary between runs."""
    path = out / "profile.json"
    run_module("profiles.measure", "--model", model, "--device", "cpu", "--microbatch-size", str(microbatch_size),
               "--tp", str(tp), "--no-p2p", "--warmup", "1", "--repeats", "3", "--out", str(path))
    return path


def layer_breakdown(model: str, microbatch_size: int, profile: Path) -> list[dict[str, Any]]:
    """Per layer kind (the embedding, the first block, the head): the model's bytes (the catalog's fp16 Megatron
    figures, what the simulator uses without a profile) beside the measured profile's, for one microbatch."""
    graph = build_model(model)
    oracle = CostOracle(graph, microbatch_size)
    measured = load_profile(profile).memory
    assert measured is not None, "profiles.measure writes memory"
    rows = []
    for i in (0, 1, len(graph) - 1):
        layer, got = graph.layers[i], measured[i]
        rows.append({"layer": layer.name, "model_kept_bytes": microbatch_size * layer.saved_bytes,
                     "measured_kept_bytes": got.retained_bytes,
                     "model_workspace_bytes": oracle.memory.workspace_bytes(i, i + 1),
                     "measured_forward_transient_bytes": got.forward_transient_bytes,
                     "measured_backward_transient_bytes": got.backward_transient_bytes,
                     "model_state_bytes": oracle.memory.state_bytes(i, i + 1),
                     "measured_state_bytes": got.param_bytes + got.gradient_bytes + got.optimizer_bytes})
    return rows


def overhead(out: Path, inputs: PlanInputs, *, repeats: int, iterations: int, warmup: int) -> dict[str, Any]:
    """The 1f1b case without and with ``--measure-memory``, alternately ``repeats`` times: median iteration times."""
    without, with_ = [], []
    for _ in range(repeats):
        without.append(run_case(out, "overhead", inputs, iterations=iterations, warmup=warmup,
                                measure=False)["iteration_time_s"])
        with_.append(run_case(out, "overhead", inputs, iterations=iterations, warmup=warmup)["iteration_time_s"])
    base, counted = statistics.median(without), statistics.median(with_)
    return {"without_s": without, "with_s": with_, "slowdown": counted / base - 1}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest |error| over every rank of every case, how many ranks are within :data:`TARGET_ERROR`, and the
    verdict."""
    errors = [abs(r["relative_error"]) for case in results for r in case["ranks"]]
    within = sum(e <= TARGET_ERROR for e in errors)
    return {"ranks": len(errors), "within_target": within, "max_abs_error": max(errors, default=0.0),
            "median_abs_error": statistics.median(errors) if errors else 0.0, "target_met": within == len(errors)}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f}"


def format_table(results: list[dict[str, Any]], summary: dict[str, Any], layers: list[dict[str, Any]],
                 slowdown: dict[str, Any] | None) -> str:
    """Markdown: per case and rank the predicted and measured peak (MB, 10^6 bytes) and the error; the verdict; the
    per-layer breakdown; the overhead of counting."""
    lines = ["| case | rank | predicted MB | measured MB | error |", "|---|---:|---:|---:|---:|"]
    for case in results:
        for r in case["ranks"]:
            lines.append(f"| {case['case']} | {r['rank']} | {_mb(r['predicted_bytes'])} | {_mb(r['measured_bytes'])} "
                         f"| {r['relative_error'] * 100:+.1f}% |")
    verdict = "met" if summary["target_met"] else "NOT met"
    median, largest = summary["median_abs_error"] * 100, summary["max_abs_error"] * 100
    lines += ["", f"{summary['within_target']} of {summary['ranks']} ranks within {TARGET_ERROR * 100:.0f}% "
                  f"(median |error| {median:.1f}%, max {largest:.1f}%): target {verdict}", "",
              "| layer | model kept | measured kept | model workspace | measured forward / backward transient | "
              "model state | measured state |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in layers:
        lines.append(f"| {row['layer']} | {row['model_kept_bytes']:,} | {row['measured_kept_bytes']:,} | "
                     f"{row['model_workspace_bytes']:,} | {row['measured_forward_transient_bytes']:,} / "
                     f"{row['measured_backward_transient_bytes']:,} | {row['model_state_bytes']:,} | "
                     f"{row['measured_state_bytes']:,} |")
    if slowdown is not None:
        ms = ", ".join(f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(slowdown["without_s"], slowdown["with_s"]))
        lines += ["", f"overhead of --measure-memory on 1f1b (median iteration ms, without/with): {ms}; "
                      f"{slowdown['slowdown'] * 100:+.1f}% (median of each)"]
    return "\n".join(lines)


def _csv(results: list[dict[str, Any]]) -> str:
    rows = ["case,layout,rank,predicted_peak_memory_bytes,measured_peak_memory_bytes,relative_error"]
    for case in results:
        for r in case["ranks"]:
            rows.append(f"{case['case']},{case['layout']},{r['rank']},{r['predicted_bytes']},{r['measured_bytes']},"
                        f"{r['relative_error']:.6f}")
    return "\n".join(rows) + "\n"


def _layers_csv(layers: list[dict[str, Any]]) -> str:
    keys = list(layers[0])
    return "\n".join([",".join(keys), *(",".join(str(row[k]) for k in keys) for row in layers)]) + "\n"


def parser() -> CliParser:
    """``python -m experiments.run memory_real [options]``."""
    parser = CliParser(prog="python -m experiments.run memory_real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/memory_real", help="output directory (default runs/memory_real)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks, 2 to 4 (default 2)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"gpt spec (default {DEFAULT_MODEL})")
    parser.add_argument("--microbatches", type=int, default=4, help="per replica (default 4)")
    parser.add_argument("--microbatch-size", type=int, default=1, help="default 1")
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations per run (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up iterations per run (default 1)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} "
                        f"(default all)")
    parser.add_argument("--overhead-repeats", type=int, default=2, help="pairs of 1f1b runs without and with "
                        "--measure-memory (default 2; 0 skips)")
    parser.add_argument("--quick", action="store_true", help=f"cases {', '.join(QUICK_CASES)}, 2 microbatches, "
                        f"1 + 1 iterations, no overhead runs (the test)")
    return parser


def run_experiment(out: Path, cases: list[str], *, model: str = DEFAULT_MODEL, ranks: int = 2, microbatches: int = 4,
                   microbatch_size: int = 1, iterations: int = 2, warmup: int = 1,
                   overhead_repeats: int = 0) -> dict[str, Any]:
    """Run ``cases`` (module docstring) and the per-layer breakdown; write nothing but the runs' own directories.

    Returns:
        ``results`` (per case: :func:`run_case`'s dict without its times), ``skipped`` (case → why), ``summary``
        (:func:`summarize`), ``layers`` (:func:`layer_breakdown`), ``overhead`` (:func:`overhead`, or ``None``) and
        the settings.
    """
    results, skipped = [], {}
    out.mkdir(parents=True, exist_ok=True)
    profile = measure_profile(out, model, microbatch_size)
    for case in cases:
        try:
            inputs = plan_inputs(case, model, ranks, microbatches, microbatch_size, profile)
            build_plan(inputs)
        except SpecError as exc:  # e.g. tp with N not dividing the heads, interleaving more vstages than layers
            skipped[case] = str(exc)
            continue
        result = run_case(out, case, inputs, iterations=iterations, warmup=warmup)
        results.append({key: value for key, value in result.items() if not key.endswith("time_s")})
    slowdown = None
    if overhead_repeats:
        inputs = plan_inputs("1f1b", model, ranks, microbatches, microbatch_size, profile)
        slowdown = overhead(out, inputs, repeats=overhead_repeats, iterations=max(iterations, 5), warmup=warmup)
    return {"results": results, "skipped": skipped, "summary": summarize(results),
            "layers": layer_breakdown(model, microbatch_size, profile), "overhead": slowdown, "model": model,
            "ranks": ranks,
            "microbatches": microbatches, "microbatch_size": microbatch_size, "iterations": iterations,
            "warmup": warmup}


@dataclass(frozen=True)
class Result:
    """The cases asked for, in :data:`CASES`' order, and what :func:`run_experiment` found (``memory_real.json``):
    per case run its ranks' predicted and measured bytes, the cases skipped and why, the summary, the per-layer
    breakdown, the overhead of measuring (or ``None``) and the settings."""

    cases: tuple[str, ...]
    found: dict[str, Any]


def run(*, out: Path, ranks: int = 2, model: str = DEFAULT_MODEL, microbatches: int = 4, microbatch_size: int = 1,
        iterations: int = 2, warmup: int = 1, cases: str = ",".join(CASES), overhead_repeats: int = 2,
        quick: bool = False) -> Result:
    """The cases of ``cases`` (comma-separated) on ``ranks`` CPU ranks, their runs written into ``out``
    (``quick``: :data:`QUICK_CASES`, 2 microbatches, 1 + 1 iterations, no overhead runs).

    Raises:
        SpecError: a value out of range, a model that is not a gpt, an unknown or empty case list (each named by
            its flag).
    """
    if not 2 <= ranks <= 4:
        raise SpecError(f"--ranks must be 2, 3 or 4, got {ranks}")
    for name, value in (("microbatches", microbatches), ("microbatch-size", microbatch_size),
                        ("iterations", iterations)):
        if value < 1:
            raise SpecError(f"--{name} must be >= 1, got {value}")
    for name, value in (("warmup", warmup), ("overhead-repeats", overhead_repeats)):
        if value < 0:
            raise SpecError(f"--{name} must be >= 0, got {value}")
    if not model.startswith("gpt:") and model != "gpt":
        raise SpecError(f"--model must be a gpt spec (the per-layer breakdown reads its blocks), got {model!r}")
    names = [c for c in cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        raise SpecError(f"--cases: unknown {', '.join(map(repr, unknown)) or 'empty list'} (known: "
                        f"{', '.join(CASES)})")
    chosen = [c for c in CASES if c in names]
    if quick:
        chosen, microbatches, iterations, warmup, overhead_repeats = list(QUICK_CASES), 2, 1, 1, 0
    found = run_experiment(out, chosen, model=model, ranks=ranks, microbatches=microbatches,
                           microbatch_size=microbatch_size, iterations=iterations, warmup=warmup,
                           overhead_repeats=overhead_repeats)
    return Result(tuple(chosen), found)


def _table(result: Result) -> str:
    found = result.found
    return format_table(found["results"], found["summary"], found["layers"], found["overhead"])


def report(result: Result) -> str:
    """Each case run or skipped (and why), then the table."""
    skipped = result.found["skipped"]
    lines = [f"{case}: skipped ({skipped[case]})" if case in skipped else f"{case}: running ..."
             for case in result.cases]
    return "\n".join([*lines, _table(result)])


def write(result: Result, out: Path) -> list[Path]:
    """``memory_real.csv``, ``layers.csv``, ``memory_real.md`` (the table) and ``memory_real.json`` (everything) in
    ``out``, beside the runs' directories."""
    found = result.found
    write_text_atomic(_csv(found["results"]), out / "memory_real.csv")
    write_text_atomic(_layers_csv(found["layers"]), out / "layers.csv")
    write_text_atomic(_table(result) + "\n", out / "memory_real.md")
    write_json_atomic(found, out / "memory_real.json")
    return [out / "memory_real.csv", out / "layers.csv", out / "memory_real.md", out / "memory_real.json"]
