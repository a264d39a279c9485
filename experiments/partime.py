"""PARTIME's scaling, simulated beside the authors' findings, and its step time measured on CPU ranks.

**The authors' setting** (the PARTIME talk in the seed notes, "Preliminary results"): a stack of 'same' convolutions
without downscaling (``cnn``), basic configuration 10 layers x 16 features x kernel 5, and the same with layers x3
(30), features x3 (48) and kernel x3 (15); pipelines of 1 to 8 stages on "an 8-GPU node" (CINECA; the GPU is not
named, so the simulated node is a DGX-1-like ``8xV100`` and the figures describe that node); with and without CUDA
graphs. Input resolutions 256 and 1024 (PARTIME's released scripts feed 3 x 256 x 256 and 3 x 1024 x 1024 frames).

**Simulated.** Every (configuration, resolution, stage count N, eager or captured) is ``sim.run --schedule stream``'s
plan on the first N devices of the node (balanced partition), costed by the one prediction path: its steady-state
step time (:mod:`sim.report.partime`) over :data:`FRAMES` frames. Eager steps pay the catalog's per-op overhead
(``launch_overhead_us``, an assumed 5 µs per kernel: ``profiles/hardware/devices.yaml`` says why), captured ones
(``--cuda-graphs``) one launch per step. Speed-up = step time on one stage ÷ step time on N (frames per second
gained). The authors' five findings are checked against the table with the thresholds of :data:`CLAIMS`, fixed
before the first run.

**Measured.** The basic configuration at 64 x 64 pixels (256 x 256 takes about a third of a second per step per
stage on this 2-core CPU) on 2 CPU ranks (``executor.run``, gloo), in rounds: a calibration run writes the ``cpu``
profile (``--calibrate-out``), the plan is simulated with it, and a second run measures the step time; the error
is (predicted − measured) ÷ measured per round (target: within 10 %).

Writes ``partime.csv`` (simulated), ``partime_real.csv`` (rounds), ``partime.png`` (speed-up against N, one panel
per configuration); ``--quick`` simulates the basic configuration on 1, 2 and 4 stages and measures one round of a
smaller model (CI).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments.sim_vs_real import run_module
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_bytes_atomic, write_text_atomic
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["CONFIGS", "RESOLUTIONS", "NODE", "FRAMES", "CLAIMS", "Point", "simulate", "sweep", "check_claims",
           "real_rounds", "Result", "parser", "run", "report", "write"]

#: The authors' four configurations: (layers, features, kernel).
CONFIGS: dict[str, tuple[int, int, int]] = {"basic": (10, 16, 5), "layers x3": (30, 16, 5),
                                            "features x3": (10, 48, 5), "kernel x3": (10, 16, 15)}
RESOLUTIONS = (256, 1024)
NODE = "8xV100"
#: Frames per simulated stream: 2(N − 1) = 14 fill the 8-stage pipeline, the other 18 are its steady state.
FRAMES = 32
#: The real runs: the basic configuration at this size on 2 CPU ranks.
REAL_MODEL = "cnn:layers=10,features=16,kernel=5,size=64"
QUICK_REAL_MODEL = "cnn:layers=4,features=8,kernel=3,size=32"
TARGET_ERROR = 0.10
#: The authors' findings and how the table is read for each (thresholds fixed before the first run).
CLAIMS = (
    ("deeper networks scale more linearly", "layers x3 has a larger 8-stage speed-up than basic, at both "
     "resolutions, eager and captured"),
    ("higher resolution scales better", "1024 has a larger 8-stage speed-up than 256, for every configuration, "
     "eager and captured"),
    ("without CUDA graphs overheads leave no significant speed-up", "eager 8-stage speed-up of basic at 256 below "
     "half of the captured one"),
    ("large kernel at high resolution scales even without CUDA graphs", "eager 8-stage speed-up of kernel x3 at "
     "1024 at least 4"),
    ("shallow networks plateau", "basic gains under 20 % from 4 to 8 stages (eager, 256)"),
)


@dataclass(frozen=True)
class Point:
    """One simulated plan: its configuration, resolution (pixels), stage count, whether captured, steady step time
    (s), latency (s) and speed-up over one stage."""

    config: str
    size: int
    stages: int
    cuda_graphs: bool
    step_s: float
    latency_s: float
    speedup: float


def model_of(config: str, size: int) -> str:
    layers, features, kernel = CONFIGS[config]
    return f"cnn:layers={layers},features={features},kernel={kernel},size={size}"


def simulate(model: str, stages: int, cuda_graphs: bool, frames: int = FRAMES) -> tuple[float, float]:
    """The steady step time and latency (s) of ``model`` streamed over ``stages`` stages of :data:`NODE`."""
    built = build_plan(PlanInputs(model=model, topology=NODE, schedule="stream", microbatches=frames, pp=stages,
                                  cuda_graphs=cuda_graphs))
    stream = predict_built(built).metrics["stream"]
    return stream["step_time_s"], stream["steady_latency_s"]


def sweep(configs: tuple[str, ...], sizes: tuple[int, ...], stage_counts: tuple[int, ...]) -> list[Point]:
    """Every (configuration, size, N, eager or captured) simulated; speed-ups against the same row's N = 1."""
    points = []
    for config in configs:
        for size in sizes:
            for captured in (False, True):
                # One stage is the baseline of every speed-up, and a point of the row when asked for: simulated once.
                runs = {n: simulate(model_of(config, size), n, captured) for n in sorted({1, *stage_counts})}
                for n in stage_counts:
                    step, latency = runs[n]
                    points.append(Point(config, size, n, captured, step, latency, runs[1][0] / step))
    return points


def check_claims(points: list[Point]) -> list[tuple[str, str, bool | None, str]]:
    """Each claim of :data:`CLAIMS`: (claim, reading, agrees (``None``: not in the table), the figures)."""
    at = {(p.config, p.size, p.stages, p.cuda_graphs): p.speedup for p in points}

    def s(config: str, size: int, n: int, captured: bool) -> float | None:
        return at.get((config, size, n, captured))

    found = []
    pairs = [(size, captured) for size in RESOLUTIONS for captured in (False, True)]
    deep = [(s("layers x3", z, 8, c), s("basic", z, 8, c)) for z, c in pairs]
    found.append(_verdict(deep, lambda a, b: a > b, "layers x3 vs basic at N=8"))
    res = [(s(k, 1024, 8, c), s(k, 256, 8, c)) for k in CONFIGS for c in (False, True)]
    found.append(_verdict(res, lambda a, b: a > b, "1024 vs 256 at N=8"))
    found.append(_verdict([(s("basic", 256, 8, False), s("basic", 256, 8, True))], lambda a, b: a < 0.5 * b,
                          "basic 256, eager vs captured at N=8"))
    found.append(_verdict([(s("kernel x3", 1024, 8, False), 4.0)], lambda a, b: a >= b,
                          "kernel x3 1024 eager at N=8 vs 4"))
    found.append(_verdict([(s("basic", 256, 8, False), s("basic", 256, 4, False))], lambda a, b: a < 1.2 * b,
                          "basic 256 eager, N=8 vs N=4"))
    return [(claim, reading, agrees, figures) for (claim, reading), (agrees, figures) in zip(CLAIMS, found)]


def _verdict(pairs, holds, label: str) -> tuple[bool | None, str]:
    known = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not known:
        return None, f"{label}: not simulated"
    figures = "; ".join(f"{a:.2f} vs {b:.2f}" for a, b in known)
    return all(holds(a, b) for a, b in known), f"{label}: {figures}"


def real_rounds(out: Path, rounds: int, model: str, frames: int, iterations: int) -> list[dict]:
    """Calibrate, predict and measure the stream of ``model`` on 2 CPU ranks, ``rounds`` times (module docstring)."""
    found = []
    for r in range(rounds):
        base = out / f"real-{r}"
        common = ["--topology", "2xcpu", "--model", model, "--schedule", "stream", "--frames", str(frames),
                  "--no-gantt"]
        run_module("sim.run", *common, "--out", str(base / "plan"))
        profile = base / "cpu-profile.json"
        run_module("executor.run", "--plan", str(base / "plan" / "plan.json"), "--out", str(base / "calibration"),
                   "--iterations", str(iterations), "--warmup", "1", "--optimizer", "sgd", "--no-gantt",
                   "--calibrate-out", str(profile))
        run_module("sim.run", *common, "--profile", str(profile), "--out", str(base / "predicted"))
        run_module("executor.run", "--plan", str(base / "predicted" / "plan.json"), "--out", str(base / "measured"),
                   "--iterations", str(iterations), "--warmup", "1", "--optimizer", "sgd", "--no-gantt")
        predicted = json.loads((base / "predicted" / "metrics.json").read_text())["stream"]["step_time_s"]
        measured = json.loads((base / "measured" / "metrics.json").read_text())["stream"]["step_time_s"]
        found.append({"round": r, "model": model, "frames": frames, "predicted_step_s": predicted,
                      "measured_step_s": measured, "error": (predicted - measured) / measured})
    return found


def _csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _plot(points: list[Point]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(p.config for p in points))
    fig, axes = plt.subplots(1, len(configs), figsize=(4 * len(configs), 3.6), squeeze=False)
    top = max(p.stages for p in points)
    for ax, config in zip(axes[0], configs):
        for size in RESOLUTIONS:
            for captured, style in ((False, "--"), (True, "-")):
                row = [p for p in points if (p.config, p.size, p.cuda_graphs) == (config, size, captured)]
                if row:
                    ax.plot([p.stages for p in row], [p.speedup for p in row], style, marker="o",
                            label=f"{size}px {'CUDA graphs' if captured else 'eager'}")
        ax.plot([1, top], [1, top], ":", color="grey", label="linear")
        ax.set_title(config)
        ax.set_xlabel("stages")
    axes[0][0].set_ylabel("speed-up over one stage (frames/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"PARTIME stream on {NODE}, simulated (steady-state step time)")
    fig.tight_layout()
    return figure_png(fig)


@dataclass(frozen=True)
class Result:
    """The simulated sweep (configurations, stage counts, every point) and its claims' verdicts; the real rounds
    (each a dict of predicted and measured step times in s and the error) with the model, frames and measured
    iterations they ran, or none under ``--no-real``."""

    configs: tuple[str, ...]
    stage_counts: tuple[int, ...]
    points: tuple[Point, ...]
    real: tuple[dict, ...] = ()
    real_setup: tuple[str, int, int] | None = None


def parser() -> CliParser:
    """``python -m experiments.run partime [--quick] [--rounds N] [--no-real] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run partime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/partime", help="output directory (default runs/partime)")
    parser.add_argument("--quick", action="store_true", help="basic configuration on 1, 2, 4 stages; one small "
                        "real round (CI)")
    parser.add_argument("--rounds", type=int, default=3, help="real rounds (default 3; --quick: 1)")
    parser.add_argument("--no-real", action="store_true", help="simulate only")
    return parser


def run(*, out: Path, quick: bool = False, rounds: int = 3, no_real: bool = False) -> Result:
    """The sweep (``quick``: the basic configuration on 1, 2, 4 stages), then unless ``no_real`` the real rounds on
    2 CPU ranks (``quick``: one small round), their directories written into ``out``.

    Raises:
        SpecError: ``rounds`` out of 1..20 (named ``--rounds``).
    """
    if not 1 <= rounds <= 20:
        raise SpecError(f"--rounds must be from 1 to 20, got {rounds}")
    configs = ("basic",) if quick else tuple(CONFIGS)
    stage_counts = (1, 2, 4) if quick else tuple(range(1, 9))
    points = tuple(sweep(configs, RESOLUTIONS, stage_counts))
    if no_real:
        return Result(configs, stage_counts, points)
    model, frames, iterations = (QUICK_REAL_MODEL, 8, 2) if quick else (REAL_MODEL, 24, 3)
    real = real_rounds(out, 1 if quick else rounds, model, frames, iterations)
    return Result(configs, stage_counts, points, tuple(real), (model, frames, iterations))


def report(result: Result) -> str:
    """The speed-up table, the authors' findings read from it, and the real rounds against their predictions."""
    points = list(result.points)
    lines = [f"PARTIME stream on {NODE}, simulated: speed-up over one stage (step time in ms), {FRAMES} frames",
             f"{'configuration':<13} {'px':>5} {'mode':<8} "
             + " ".join(f"{'N=' + str(n):>14}" for n in result.stage_counts)]
    for config in result.configs:
        for size in RESOLUTIONS:
            for captured in (False, True):
                row = [p for p in points if (p.config, p.size, p.cuda_graphs) == (config, size, captured)]
                lines.append(f"{config:<13} {size:>5} {'graphs' if captured else 'eager':<8} "
                             + " ".join(f"{p.speedup:>5.2f} ({p.step_s * 1e3:6.2f})" for p in row))
    lines.append("\nthe authors' findings, read from the table:")
    for claim, reading, agrees, figures in check_claims(points):
        verdict = "not simulated" if agrees is None else "agrees" if agrees else "DOES NOT agree"
        lines.append(f"  {claim}: {verdict} ({reading}; {figures})")
    if result.real_setup is not None:
        model, frames, iterations = result.real_setup
        lines.append(f"\nreal runs: {model} on 2 CPU ranks, {frames} frames, {iterations} measured iterations per "
                     f"run")
        lines += [f"  round {row['round']}: predicted {row['predicted_step_s'] * 1e3:.2f} ms, measured "
                  f"{row['measured_step_s'] * 1e3:.2f} ms, error {row['error']:+.1%}" for row in result.real]
        within = sum(abs(row["error"]) <= TARGET_ERROR for row in result.real)
        lines.append(f"  within {TARGET_ERROR:.0%}: {within} of {len(result.real)} rounds; median |error| "
                     f"{statistics.median(abs(row['error']) for row in result.real):.1%}")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``partime.csv`` (every simulated point), ``partime.png`` and, with real rounds, ``partime_real.csv`` in
    ``out`` (beside the rounds' directories)."""
    rows = [{"config": p.config, "size": p.size, "stages": p.stages, "cuda_graphs": p.cuda_graphs,
             "step_time_s": repr(p.step_s), "steady_latency_s": repr(p.latency_s), "speedup": f"{p.speedup:.6f}"}
            for p in result.points]
    write_text_atomic(_csv(rows), out / "partime.csv")
    write_bytes_atomic(out / "partime.png", _plot(list(result.points)))
    if result.real_setup is None:
        return [out / "partime.csv", out / "partime.png"]
    write_text_atomic(_csv(list(result.real)), out / "partime_real.csv")
    return [out / "partime.csv", out / "partime.png", out / "partime_real.csv"]
