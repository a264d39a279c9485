"""Peak memory on a seeded random suite of small plans, predicted against ``executor.run --measure-memory`` on every
CPU rank (issue #40's target: every rank within 5 %).

``memory_real`` runs the cases it was built around; this draws plans it did not choose. With ``random.Random(seed)``
(the same seed, the same suite) each plan gets:

* a GPT from a small space (:data:`MODEL_SPACE`: layers, hidden size, heads, sequence length, vocabulary);
* a layout on the N CPU ranks: a pipeline of N; data parallelism over N with ZeRO 0, 1 or 2; tensor parallelism over N
  (where N divides the heads); or, on 4 ranks, a pipeline of 2 over 2 data-parallel replicas;
* under a pipeline, a schedule (gpipe, 1f1b, interleaved with 2 chunks, zb1p, pipedream) and full recomputation or
  none; otherwise 1F1B;
* 2 to 6 microbatches (a multiple of the pipeline ranks under interleaving).

Each plan is predicted as a user calibrates: a profile of its model measured on this host's CPU first
(``profiles.measure``, as ``memory_real`` does: the catalog's sizes describe fp16 Megatron training on GPUs, the
executor trains in fp32 on the CPU); a TP plan's profile measures one tensor-parallel shard of each layer
(``profiles.measure --tp N``), what each of its ranks runs. A plan the product refuses (a layout or schedule rule) is
listed with the reason, not counted. The verdict: how many ranks are within :data:`TARGET_ERROR` of the measured peak,
error = predicted / measured − 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from experiments.memory_real import TARGET_ERROR, measure_profile, run_case, summarize
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_json_atomic, write_text_atomic
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

__all__ = ["MODEL_SPACE", "SCHEDULES", "SuitePlan", "Result", "draw_plans", "parser", "run", "report", "write"]

#: The GPTs a plan's model is drawn from: every combination of these.
MODEL_SPACE = {"layers": (4, 6), "hidden": (128, 256), "heads": (2, 4), "seq": (64, 128), "vocab": (500, 1000)}
#: The schedules a pipeline plan draws from (interleaved with 2 chunks per rank).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream")


@dataclass(frozen=True)
class SuitePlan:
    """One drawn plan: its name (``plan<i>``, then what it is) and its ``sim.run`` inputs (without a profile: the
    suite measures one per model and tensor-parallel degree)."""

    name: str
    inputs: PlanInputs


def draw_plans(seed: int, count: int, ranks: int) -> list[SuitePlan]:
    """``count`` plans on ``ranks`` CPU ranks drawn by ``random.Random(seed)`` (module docstring); deterministic."""
    rng = random.Random(seed)
    plans = []
    for i in range(count):
        dims = {key: rng.choice(values) for key, values in MODEL_SPACE.items()}
        model = "gpt:" + ",".join(f"{key}={value}" for key, value in dims.items())
        layouts = ["pp", "dp"] + (["tp"] if dims["heads"] % ranks == 0 else []) + (["dp-pp"] if ranks == 4 else [])
        layout = rng.choice(layouts)
        microbatches = rng.randint(2, 6)
        topology = f"{ranks}xcpu"
        if layout in ("pp", "dp-pp"):
            pp = ranks if layout == "pp" else 2
            dp = ranks // pp
            schedule = rng.choice(SCHEDULES)
            recompute = rng.random() < 0.5
            chunks = 2 if schedule == "interleaved" else 1
            if schedule == "interleaved":
                microbatches = pp * max(1, microbatches // pp)
            zero = rng.choice((0, 1)) if dp > 1 else 0
            inputs = PlanInputs(model, topology, schedule, microbatch_size=1, chunks=chunks, recompute=recompute,
                                pp=pp, dp=dp, zero=zero, global_batch=microbatches * dp)
            what = f"pp{pp}{f'-dp{dp}-zero{zero}' if dp > 1 else ''}-{schedule}{'-recompute' if recompute else ''}"
        elif layout == "dp":
            zero = rng.choice((0, 1, 2))
            inputs = PlanInputs(model, topology, "1f1b", microbatch_size=1, dp=ranks, pp=1, zero=zero,
                                global_batch=microbatches * ranks)
            what = f"dp{ranks}-zero{zero}"
        else:
            inputs = PlanInputs(model, topology, "1f1b", microbatches=microbatches, microbatch_size=1, tp=ranks, pp=1)
            what = f"tp{ranks}"
        plans.append(SuitePlan(f"plan{i}-{what}-m{microbatches}", inputs))
    return plans


@dataclass(frozen=True)
class Result:
    """The suite: ``seed`` and ``ranks``; per plan run (``results``) its model, layout and per rank the predicted and
    measured peak (bytes) and the error (predicted / measured − 1); the plans refused and why (``skipped``); and the
    summary (``memory_real.summarize``: ranks within the target, median and max |error|, the verdict)."""

    seed: int
    ranks: int
    results: tuple[dict[str, Any], ...]
    skipped: tuple[tuple[str, str], ...]
    summary: dict[str, Any]


def parser() -> CliParser:
    """``python -m experiments.run memory_suite [--seed S] [--plans N] [--ranks R] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run memory_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/memory_suite", help="output directory (default runs/memory_suite)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the suite (default 0)")
    parser.add_argument("--plans", type=int, default=12, help="plans drawn (default 12)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks, 2 to 4 (default 2)")
    parser.add_argument("--quick", action="store_true", help="2 plans (the test)")
    return parser


def run(*, out: Path, seed: int = 0, plans: int = 12, ranks: int = 2, quick: bool = False,
        progress: Callable[[str], None] | None = None) -> Result:
    """Draw the suite, measure each model's profile once, build and run every plan (module docstring).

    Raises:
        SpecError: ``ranks`` outside 2-4 or ``plans`` < 1 (named by their flags).
    """
    if not 2 <= ranks <= 4:
        raise SpecError(f"--ranks must be 2, 3 or 4, got {ranks}")
    if plans < 1:
        raise SpecError(f"--plans must be >= 1, got {plans}")
    count = 2 if quick else plans
    profiles: dict[tuple[str, int], Path] = {}
    results, skipped = [], []
    for plan in draw_plans(seed, count, ranks):
        inputs = plan.inputs
        key = (inputs.model, inputs.tp)
        if key not in profiles:
            where = out / f"profile-{len(profiles)}"
            where.mkdir(parents=True, exist_ok=True)
            profiles[key] = measure_profile(where, inputs.model, inputs.microbatch_size, inputs.tp)
        inputs = replace(inputs, profile=str(profiles[key]))
        try:
            build_plan(inputs)
        except SpecError as exc:
            skipped.append((plan.name, str(exc)))
            continue
        if progress is not None:
            progress(f"{plan.name}: {inputs.model}")
        case = run_case(out, plan.name, inputs, iterations=2, warmup=1)
        results.append({"case": plan.name, "model": inputs.model, "layout": case["layout"], "ranks": case["ranks"]})
    return Result(seed, ranks, tuple(results), tuple(skipped), summarize(results))


def report(result: Result) -> str:
    """Per plan and rank the predicted and measured peak (MB, 10^6 bytes) and the error; the plans refused; the
    verdict against the target."""
    lines = [f"{len(result.results)} plans drawn with seed {result.seed} on {result.ranks} CPU ranks, predicted "
             f"against executor.run --measure-memory (error = predicted / measured - 1)",
             "| plan | model | rank | predicted MB | measured MB | error |", "|---|---|---:|---:|---:|---:|"]
    for case in result.results:
        for r in case["ranks"]:
            lines.append(f"| {case['case']} | {case['model']} | {r['rank']} | {r['predicted_bytes'] / 1e6:.2f} | "
                         f"{r['measured_bytes'] / 1e6:.2f} | {r['relative_error'] * 100:+.1f}% |")
    lines += [f"refused: {name}: {why}" for name, why in result.skipped]
    summary = result.summary
    verdict = "met" if summary["target_met"] else "NOT met"
    lines.append(f"{summary['within_target']} of {summary['ranks']} ranks within {TARGET_ERROR * 100:.0f}% (median "
                 f"|error| {summary['median_abs_error'] * 100:.1f}%, max {summary['max_abs_error'] * 100:.1f}%): "
                 f"target {verdict} (issue #40)")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``memory_suite.csv`` (a row per plan and rank) and ``memory_suite.json`` (everything) in ``out``, beside the
    runs' and profiles' directories."""
    rows = ["plan,model,layout,rank,predicted_peak_memory_bytes,measured_peak_memory_bytes,relative_error"]
    for case in result.results:
        for r in case["ranks"]:
            rows.append(f"{case['case']},\"{case['model']}\",{case['layout']},{r['rank']},{r['predicted_bytes']},"
                        f"{r['measured_bytes']},{r['relative_error']:.6f}")
    write_text_atomic("\n".join(rows) + "\n", out / "memory_suite.csv")
    write_json_atomic({"seed": result.seed, "ranks": result.ranks, "results": list(result.results),
                       "skipped": [list(item) for item in result.skipped], "summary": result.summary},
                      out / "memory_suite.json")
    return [out / "memory_suite.csv", out / "memory_suite.json"]
