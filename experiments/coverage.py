"""What the intervals are worth: every published run predicted, its residual taken, and the split-conformal intervals
of ``sim.report.interval`` calibrated on a seeded half of each data set and checked on the other half.

The data sets (``experiments/data``): vTrain's A100 runs (``ground_truth_single.csv`` and ``ground_truth_multi.csv``,
iteration times), torchtitan's Llama 3.1 runs and Megatron-Bridge's expressible rows (tokens per second per GPU), each
predicted as its own experiment predicts it (``experiments.vtrain``, ``experiments.torchtitan``,
``experiments.megatron_bridge``). A run's residual is ``log(published time / predicted time)`` (for a rate,
``log(predicted rate / published rate)``), kept with its plan's regime (``metrics.json``'s ``regime``).

The check: each data set's runs are split by ``--seed`` into a calibration half and a held-out half; every held-out
run gets the interval its regime's calibration runs (the calibration halves of all the data sets together) give at
90 %, and the report prints, per data set, how many of its held-out published figures fall inside (target: at least
85 %, issue #40), the median width of the intervals (high / low - 1) and the share of held-out runs inside a validated
regime (at least ``MIN_RUNS`` calibration runs sharing every feature). ``--write`` then stores every run's residual
(both halves) as the tool's calibration, ``profiles/calibration/residuals.csv``, which ``sim.run`` and the search read.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments import megatron_bridge, torchtitan, vtrain
from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.report.interval import LEVEL, MIN_RUNS, RESIDUALS, CalibrationIndex, Regime, Residual, write_residuals
from sim.report.png import figure_png

__all__ = ["DATASETS", "TARGET", "gather", "split", "check", "Result", "parser", "run", "report", "write"]

#: The data sets, in the order they are reported.
DATASETS = ("vtrain", "torchtitan", "megatron_bridge")
#: The least share of held-out published figures a 90 % interval must cover, per data set (issue #40).
TARGET = 0.85
_VTRAIN_FILES = ("ground_truth_single.csv", "ground_truth_multi.csv")


def _regime(entry: dict[str, str]) -> Regime:
    return Regime(**entry)


def _vtrain(progress: Callable[[str], None] | None) -> list[Residual]:
    residuals = []
    with tempfile.TemporaryDirectory(prefix="coverage-topologies-") as folder:
        for name in _VTRAIN_FILES:
            runs = vtrain.load_runs(vtrain.DATA.parent / name)
            for index, one in enumerate(runs):
                if one.layers % one.pp:  # refused by vtrain.predict_metrics: Megatron-DeepSpeed's partition needs it
                    continue
                metrics = vtrain.predict_metrics(one, folder=Path(folder))
                residuals.append(Residual("vtrain", f"{name.removesuffix('.csv')}:{index + 2}",
                                          _regime(metrics["regime"]),
                                          math.log(one.measured_s / metrics["iteration_time_s"])))
            if progress is not None:
                progress(f"  vtrain {name}: {len(runs)} runs")
    return residuals


def _rows(dataset: str, results: list, name: Callable[[object], str]) -> list[Residual]:
    return [Residual(dataset, name(r.row), _regime(r.regime), math.log(r.predicted / r.row.tokens_per_s_per_gpu))
            for r in results]


def gather(datasets: tuple[str, ...] = DATASETS,
           progress: Callable[[str], None] | None = None) -> list[Residual]:
    """Every run of ``datasets`` predicted, as residuals, in data set then file order."""
    residuals: list[Residual] = []
    for dataset in datasets:
        if dataset == "vtrain":
            residuals += _vtrain(progress)
        elif dataset == "torchtitan":
            residuals += _rows(dataset, torchtitan.evaluate(), lambda row: row.row_id)
        elif dataset == "megatron_bridge":
            rows = [row for row in megatron_bridge.load_rows() if megatron_bridge.expressible(row) is None]
            residuals += _rows(dataset, [megatron_bridge.predict_row(row) for row in rows],
                               lambda row: f"line{row.line}")
        else:
            raise SpecError(f"unknown data set {dataset!r} (known: {', '.join(DATASETS)})")
        if progress is not None:
            progress(f"  {dataset}: predicted")
    return residuals


def split(residuals: list[Residual], seed: int) -> list[str]:
    """Each residual's half, ``"calibration"`` or ``"held-out"``: each data set's runs shuffled by ``seed`` (in
    sorted id order first), every other one calibrates."""
    halves = ["held-out"] * len(residuals)
    for dataset in dict.fromkeys(r.dataset for r in residuals):
        ids = sorted(r.run for r in residuals if r.dataset == dataset)
        random.Random(seed).shuffle(ids)
        calibrating = set(ids[0::2])
        for i, r in enumerate(residuals):
            if r.dataset == dataset and r.run in calibrating:
                halves[i] = "calibration"
    return halves


@dataclass(frozen=True)
class DatasetCoverage:
    """One data set's held-out check: runs, how many intervals cover the published figure, their median width
    (high / low - 1), how many runs lie in a validated regime, and how many got no interval."""

    dataset: str
    runs: int
    covered: int
    median_width: float
    validated: int
    uncalibrated: int

    @property
    def coverage(self) -> float:
        return self.covered / self.runs if self.runs else math.nan


def check(residuals: list[Residual], halves: list[str], level: float = LEVEL) -> list[DatasetCoverage]:
    """Per data set, its held-out runs against the intervals the calibration halves give (module docstring)."""
    index = CalibrationIndex([r for r, half in zip(residuals, halves, strict=True) if half == "calibration"])
    found = []
    for dataset in dict.fromkeys(r.dataset for r in residuals):
        covered = validated = uncalibrated = 0
        widths = []
        held = [r for r, half in zip(residuals, halves, strict=True) if half == "held-out" and r.dataset == dataset]
        for r in held:
            calibration = index.calibrate(r.regime, level)
            if calibration.low is None:
                uncalibrated += 1
                continue
            covered += calibration.low <= r.log_ratio <= calibration.high
            validated += calibration.validated
            widths.append(math.exp(calibration.high - calibration.low) - 1)
        found.append(DatasetCoverage(dataset, len(held), covered, statistics.median(widths) if widths else math.nan,
                                     validated, uncalibrated))
    return found


@dataclass(frozen=True)
class Result:
    """The residuals, their halves, the held-out check per data set and the seed."""

    residuals: tuple[Residual, ...]
    halves: tuple[str, ...]
    coverage: tuple[DatasetCoverage, ...]
    seed: int
    wrote_calibration: bool


def parser() -> CliParser:
    parser = CliParser(prog="python -m experiments.run coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the seed of each data set's split (default 0)")
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help=f"comma-separated data sets (default {','.join(DATASETS)})")
    parser.add_argument("--write", action="store_true",
                        help="store every run's residual as the tool's calibration "
                        "(profiles/calibration/residuals.csv)")
    parser.add_argument("--out", help="where to write coverage.csv and coverage.png")
    return parser


def run(*, seed: int = 0, datasets: str = ",".join(DATASETS), write: bool = False,
        progress: Callable[[str], None] | None = None) -> Result:
    """Gather the residuals of ``datasets``, check the held-out halves of ``seed``'s split, and with ``write`` store
    every residual as the shipped calibration."""
    chosen = tuple(name.strip() for name in datasets.split(",") if name.strip())
    unknown = [name for name in chosen if name not in DATASETS]
    if unknown or not chosen:
        raise SpecError(f"--datasets must name some of {', '.join(DATASETS)}, got {datasets!r}")
    if write and set(chosen) != set(DATASETS):  # the shipped calibration is every data set's, never a part
        raise SpecError(f"--write stores the calibration of every data set; leave out --datasets (got {datasets!r})")
    residuals = gather(chosen, progress)
    halves = split(residuals, seed)
    coverage = check(residuals, halves)
    if write:
        write_text_atomic(write_residuals(residuals), RESIDUALS)
    return Result(tuple(residuals), tuple(halves), tuple(coverage), seed, write)


def report(result: Result) -> str:
    """Per data set: held-out runs, coverage against the target, median width, validated share."""
    lines = [f"{len(result.residuals):,} published runs predicted; each data set split by seed {result.seed}, the "
             f"calibration halves pooled; {LEVEL:.0%} split-conformal intervals per regime (at least {MIN_RUNS} "
             "calibration runs; features relaxed where fewer share them all)",
             f"{'data set':<16} {'held out':>8} {'covered':>8} {'coverage':>9} {'median width':>13} "
             f"{'validated':>10} {'no interval':>12}"]
    for entry in result.coverage:
        lines.append(f"{entry.dataset:<16} {entry.runs:>8} {entry.covered:>8} {entry.coverage:>9.1%} "
                     f"{entry.median_width:>13.1%} {entry.validated:>10} {entry.uncalibrated:>12}")
    for entry in result.coverage:
        verdict = "met" if entry.coverage >= TARGET else f"missed by {100 * (TARGET - entry.coverage):.1f} points"
        lines.append(f"target {entry.dataset}: >= {TARGET:.0%} of held-out runs covered ({entry.coverage:.1%}: "
                     f"{verdict})")
    if result.wrote_calibration:
        lines.append(f"wrote the calibration of {len(result.residuals):,} residuals: {RESIDUALS}")
    return "\n".join(lines)


def _plot(result: Result) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    names = [entry.dataset for entry in result.coverage]
    axis.bar(names, [entry.coverage for entry in result.coverage], color="#4c72b0")
    axis.axhline(TARGET, color="#c44e52", linestyle="--", label=f"target {TARGET:.0%}")
    axis.axhline(LEVEL, color="#55a868", linestyle=":", label=f"nominal {LEVEL:.0%}")
    axis.set_ylim(0, 1)
    axis.set_ylabel("held-out runs covered")
    axis.legend(loc="lower right")
    figure.tight_layout()
    return figure_png(figure)


def write(result: Result, out: Path) -> list[Path]:
    """``coverage.csv`` (a row per run: its data set, id, half, regime and residual) and ``coverage.png``."""
    lines = ["dataset,run,half,generation,family,precision,dims,scale,log_ratio"]
    for r, half in zip(result.residuals, result.halves, strict=True):
        regime = r.regime
        lines.append(f"{r.dataset},{r.run},{half},{regime.generation},{regime.family},{regime.precision},"
                     f"{regime.dims},{regime.scale},{r.log_ratio!r}")
    return write_csv_png(out, "coverage", "\n".join(lines) + "\n", _plot(result))
