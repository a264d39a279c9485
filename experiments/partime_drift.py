"""What PARTIME's approximation costs: its online loss against exact online SGD on a slowly drifting stream and across
an abrupt scene cut, for 1, 2, 4 and 8 pipeline stages.

PARTIME updates every stage at every step with the gradient that has just arrived, computed through the stage's
*current* input although it came from a frame 2(N-1-s) steps older (:mod:`executor.partime.partime_reference`, the rule
the executor reproduces bitwise). Two things differ from exact online SGD: the gradient is paired with another frame's
input (harmless while consecutive frames are alike, wrong across a cut) and it was computed with weights up to 2(N-1-s)
updates old (delayed SGD, which tolerates a smaller learning rate as the delay grows).

Setup. The model is ``cnn:layers=8,features=8,kernel=3,size=32`` (PARTIME's conv stack without downscaling), its
layers built by :func:`executor.nn.stages.build_stage` and split evenly into N stages; plain SGD
(:func:`executor.nn.optim.make_optimizer`, bitwise ``torch.optim.SGD``) at each rate of ``--lr``: 0.5, where exact
online SGD learns the stream well (online loss from about 0.3 to 0.03-0.09 over the last 100 of 800 frames, by seed;
at 1.0 its ReLUs die and the loss stays near 0.27 on seed 0), and 0.05, where it learns slowly (to 0.06-0.11) but
every stage count stays finite. The stream (:class:`executor.partime.video.VideoSpec`, the same
size and features) drifts by 0.02 rad per frame and cuts to another scene at frame T // 2: the frames before the cut
are the drifting stream, those after it the abrupt change. Each of ``--repeats`` repetitions r uses seed
``--seed + r`` for the stream and the weights; exact SGD and every N start from the same weights.

Measures, per run (its online loss per frame: the last stage's loss of that frame before its update):

* **whole**, **drift**, **cut+15**, **cut+100**: the run's mean online loss over all frames, over the frames before
  the cut, over the first :data:`JUMP` (15 = 2(8-1) + 1, the frames in which an 8-stage pipeline pairs gradients and
  inputs across the cut) and the first :data:`WINDOW` frames from the cut, each over exact SGD's on the same frames;
* **peak**: frames from the cut to the run's highest online loss in the :data:`PEAK` frames from it;
* **recovery**: frames from the cut until the run's :data:`SMOOTH`-frame mean loss is back at its own mean over the
  :data:`WINDOW` frames before the cut (``-`` if never within the run).

A run stops as diverged at its first online loss that is not finite or above :data:`DIVERGED_LOSS`; its ratios are
then infinite (``-``). The table gives the median over the repetitions; the CSV holds every run's losses.

Writes ``partime_drift.csv`` (one row per learning rate, repetition, method and frame: the online loss) and
``partime_drift.png`` (per learning rate the loss curves, smoothed over :data:`SMOOTH` frames and averaged over the
repetitions, and the frames around the cut), all or none. ``--quick``: 1 and 2 stages, 60 frames of a 16-pixel
stream, one seed, lr 0.5 (CI).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.nn.optim import make_optimizer
from executor.nn.stages import build_stage, loss_fn
from executor.partime.partime_reference import exact_online_sgd, partime
from executor.partime.video import VideoSpec, frame
from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.report.png import figure_png

__all__ = ["Setup", "Run", "Result", "FULL", "QUICK", "run_all", "summarise", "parser", "run", "report", "write"]

LAYERS, FEATURES, KERNEL = 8, 8, 3
DRIFT = 0.02  # rad per frame: a wave moves at most 0.03 rad per frame, a period in 200 frames or more
WINDOW = 100  # frames after the cut compared, and the pre-cut level jump and recovery read
JUMP = 15  # 2(8 - 1) + 1: the frames in which an 8-stage pipeline pairs gradients and inputs across the cut
PEAK = 2 * JUMP  # frames from the cut in which the loss's peak is looked for
#: A run stops as diverged at its first online loss that is not finite or above this: targets lie in (0, 1), so a
#: mean squared error of 1e3 means outputs off by about 30 everywhere, four orders above the initial loss (~0.3).
DIVERGED_LOSS = 1e3
SMOOTH = 10  # frames of the moving mean that recovery and the plot read
MAX_FRAMES = 5000  # about 12 s per run on one CPU core: the bound on --frames
MIN_FRAMES = 2 * JUMP  # a drifting half and a cut half of at least JUMP frames each


@dataclass(frozen=True)
class Setup:
    """One configuration of the experiment.

    Attributes:
        size: frame and feature-map size S (pixels).
        frames: T, frames per run; the scene cut is at frame T // 2.
        stages: the stage counts N compared with exact SGD.
        repeats: repetitions (seeds ``seed .. seed + repeats - 1``).
        lrs: the SGD learning rates (dimensionless), each a separate set of runs.
    """

    size: int
    frames: int
    stages: tuple[int, ...]
    repeats: int
    lrs: tuple[float, ...]

    @property
    def model(self) -> str:
        return f"cnn:layers={LAYERS},features={FEATURES},kernel={KERNEL},size={self.size}"

    @property
    def cut(self) -> int:
        return self.frames // 2


FULL = Setup(size=32, frames=800, stages=(1, 2, 4, 8), repeats=3, lrs=(0.5, 0.05))
QUICK = Setup(size=16, frames=60, stages=(1, 2), repeats=1, lrs=(0.5,))


@dataclass(frozen=True)
class Run:
    """One run's online losses.

    Attributes:
        lr: its learning rate.
        repeat: the repetition r (seed ``seed + r``).
        stages: N for PARTIME; 0 for exact online SGD.
        losses: per frame up to the first whose loss is not finite (the run stops there), the online loss.
    """

    lr: float
    repeat: int
    stages: int
    losses: tuple[float, ...]

    @property
    def method(self) -> str:
        return "exact" if self.stages == 0 else f"partime N={self.stages}"

    @property
    def diverged_at(self) -> int | None:
        return next((f for f, loss in enumerate(self.losses) if not loss <= DIVERGED_LOSS), None)

    def padded(self, frames: int) -> tuple[float, ...]:
        """The losses of all ``frames``, ``inf`` from the divergence on."""
        kept = self.losses if self.diverged_at is None else self.losses[:self.diverged_at]
        return kept + (math.inf,) * (frames - len(kept))


class _Diverged(Exception):
    """Raised by the watched loss at the first non-finite online loss: the rest of the run would be nan."""


def _stages(setup: Setup, n: int, seed: int) -> list[torch.nn.Module]:
    return [build_stage(setup.model, LAYERS * i // n, LAYERS * (i + 1) // n, seed=seed) for i in range(n)]


def _online(train: Callable[..., object], stages: list[torch.nn.Module], optimizer, frames, count: int,
            loss) -> tuple[float, ...]:
    """Run ``train`` (partime or exact_online_sgd) and return its online losses, stopping at the first that is not
    finite. Both compute the frames' losses in frame order, so the watched loss sees frame 0, 1, ... in turn."""
    seen: list[float] = []

    def watched(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = loss(output, target)
        seen.append(float(value.detach()))
        if not seen[-1] <= DIVERGED_LOSS:  # also true for nan
            raise _Diverged
        return value

    try:
        result = train(stages, optimizer, frames, count, watched)
    except _Diverged:
        return tuple(seen)
    assert result.losses == tuple(seen)  # type: ignore[attr-defined]
    return tuple(seen)


def run_all(setup: Setup, seed: int, progress: Callable[[str], None] = lambda _: None) -> list[Run]:
    """Exact online SGD and PARTIME with each stage count of ``setup``, per learning rate and repetition."""
    loss = loss_fn(setup.model)
    runs = []
    for r in range(setup.repeats):
        spec = VideoSpec(size=setup.size, features=FEATURES, seed=seed + r, drift=DRIFT, cut_at=setup.cut)
        made = [frame(spec, f) for f in range(setup.frames)]  # made once, shared by every run of the repetition
        for lr in setup.lrs:
            def sgd(stage: torch.nn.Module, lr: float = lr):
                return make_optimizer("sgd", stage.parameters(), lr)

            for n in (0, *setup.stages):
                train = exact_online_sgd if n == 0 else partime
                losses = _online(train, _stages(setup, max(n, 1), seed + r), sgd, made.__getitem__, setup.frames,
                                 loss)
                runs.append(Run(lr, r, n, losses))
            progress(f"seed {seed + r}, lr {lr}: done")
    return runs


def _mean(values: tuple[float, ...] | list[float]) -> float:
    if not values:
        return math.nan
    if not all(math.isfinite(v) for v in values):
        return math.inf
    return math.fsum(values) / len(values)


def _ratio(mine: float, exact: float) -> float:
    if not math.isfinite(exact):
        return math.nan
    return mine / exact if math.isfinite(mine) else math.inf


def _recovery(losses: tuple[float, ...], cut: int) -> int | None:
    """Frames from ``cut`` until the run's SMOOTH-frame mean is back at its own mean over the WINDOW frames before."""
    level = _mean(losses[max(0, cut - WINDOW):cut])
    for k in range(len(losses) - cut - SMOOTH + 1):
        window = _mean(losses[cut + k:cut + k + SMOOTH])
        if not math.isfinite(window):
            return None
        if window <= level:
            return k
    return None


def _measures(run: Run, exact: Run, setup: Setup) -> dict[str, float | int | None]:
    """The module docstring's measures of ``run`` against ``exact`` (same learning rate and repetition)."""
    mine, theirs, cut = run.padded(setup.frames), exact.padded(setup.frames), setup.cut
    after = slice(cut, cut + WINDOW)
    near = mine[cut:cut + PEAK]
    return {"whole": _ratio(_mean(mine), _mean(theirs)),
            "drift": _ratio(_mean(mine[:cut]), _mean(theirs[:cut])),
            "cut15": _ratio(_mean(mine[cut:cut + JUMP]), _mean(theirs[cut:cut + JUMP])),
            "cut100": _ratio(_mean(mine[after]), _mean(theirs[after])),
            "peak": near.index(max(near)) if near and all(map(math.isfinite, near)) else None,
            "recovery": _recovery(mine, cut),
            "diverged_at": run.diverged_at}


def _median(values: list) -> float | None:
    known = [math.inf if v is None else v for v in values]
    return statistics.median(known) if known else None


def summarise(setup: Setup, runs: list[Run]) -> list[tuple[float, int, dict[str, float | None]]]:
    """Per learning rate and method (exact first, then each N): the median over repetitions of each measure (a
    recovery that never happened counts as infinite; ``diverged``: how many repetitions diverged, and the first
    frame that did)."""
    exact = {(run.lr, run.repeat): run for run in runs if run.stages == 0}
    rows = []
    for lr in setup.lrs:
        for n in (0, *setup.stages):
            each = [_measures(run, exact[lr, run.repeat], setup) for run in runs if run.lr == lr and run.stages == n]
            row: dict[str, float | None] = {key: _median([m[key] for m in each]) for key in each[0]
                                            if key != "diverged_at"}
            first = [m["diverged_at"] for m in each if m["diverged_at"] is not None]
            row["diverged"] = len(first)
            row["first_divergence"] = min(first) if first else None  # type: ignore[type-var]
            rows.append((lr, n, row))
    return rows


def _cell(value: float | None, form: str, width: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return f"{'-':>{width}}"
    return f"{value:{width}{form}}"


def _table(setup: Setup, summary: list[tuple[float, int, dict[str, float | None]]]) -> list[str]:
    lines = [f"{'lr':>5} {'method':<13} {'whole':>7} {'drift':>7} {'cut+15':>7} {'cut+100':>7} {'peak':>5} "
             f"{'recovery':>8} {'diverged':>9}",
             f"(online loss over exact online SGD's: whole run, drift = frames before the cut, cut+{JUMP} and "
             f"cut+{WINDOW} = frames from the cut; peak: frames from the cut to the run's highest loss in the next "
             f"{PEAK}; recovery: frames until its {SMOOTH}-frame mean is back at its mean over the {WINDOW} before "
             f"the cut; medians over {setup.repeats} seed(s); - diverged or never)"]
    for lr, n, row in summary:
        method = "exact" if n == 0 else f"partime N={n}"
        diverged = f"{row['diverged']}/{setup.repeats}" + (f" @{row['first_divergence']}" if row["diverged"] else "")
        lines.append(f"{lr:>5g} {method:<13} {_cell(row['whole'], '.3f', 7)} {_cell(row['drift'], '.3f', 7)} "
                     f"{_cell(row['cut15'], '.3f', 7)} {_cell(row['cut100'], '.3f', 7)} {_cell(row['peak'], '.0f', 5)} "
                     f"{_cell(row['recovery'], '.0f', 8)} {diverged:>9}")
    return lines


def _csv(runs: list[Run], seed: int) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["lr", "repeat", "seed", "method", "stages", "frame", "online_loss"])
    for run in runs:
        for f, loss in enumerate(run.losses):
            writer.writerow([repr(run.lr), run.repeat, seed + run.repeat, run.method, run.stages, f, repr(loss)])
    return buffer.getvalue()


def _curve(setup: Setup, runs: list[Run], lr: float, n: int, smooth: int) -> list[float]:
    """Per frame, the mean over repetitions of the trailing ``smooth``-frame mean loss (nan once one diverged)."""
    mine = [run.padded(setup.frames) for run in runs if run.lr == lr and run.stages == n]
    curve = []
    for f in range(setup.frames):
        values = [_mean(losses[max(0, f - smooth + 1):f + 1]) for losses in mine]
        curve.append(math.nan if any(math.isinf(v) for v in values) else math.fsum(values) / len(values))
    return curve


COLOURS = {0: "black", 1: "#17becf", 2: "#2ca02c", 4: "#ff7f0e", 8: "#d62728"}


def _plot(setup: Setup, runs: list[Run]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(setup.lrs)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.9 * rows), dpi=110, squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]})
    zoom = range(max(0, setup.cut - 20), min(setup.frames, setup.cut + 80))
    for (whole, near), lr in zip(axes, setup.lrs, strict=True):
        curves = {n: _curve(setup, runs, lr, n, SMOOTH) for n in (*setup.stages, 0)}
        finite = [v for curve in curves.values() for v in curve if math.isfinite(v)]
        for n, curve in curves.items():  # exact last, on top of the N = 1 curve it equals
            label = "exact online SGD" if n == 0 else f"PARTIME, {n} stage{'s' if n > 1 else ''}"
            style = {"color": COLOURS.get(n), "linewidth": 1.6 if n == 0 else 1.0,
                     "linestyle": (0, (4, 4)) if n == 0 else "-", "label": label}
            whole.plot(range(setup.frames), curve, **style)
            diverged = [run.diverged_at for run in runs if run.lr == lr and run.stages == n
                        and run.diverged_at is not None]
            if diverged:  # where the first repetition diverged: the curve ends there
                whole.plot([min(diverged)], [max(finite) if finite else 1.0], marker="x", color=COLOURS.get(n),
                           markersize=8, linestyle="none")
            raw = _curve(setup, runs, lr, n, 1)
            near.plot(zoom, [raw[f] for f in zoom], **style)
        if finite:  # a diverged run would stretch the axis over decades; x marks it instead
            whole.set_ylim(0.8 * min(finite), 1.25 * max(finite))
        for ax in (whole, near):
            ax.axvline(setup.cut, color="#888888", linewidth=0.8, linestyle=":")
            ax.set_yscale("log")
            ax.set_xlabel("frame")
        whole.set_ylabel(f"online MSE loss, mean of {setup.repeats} seed(s)")
        whole.set_title(f"SGD lr {lr:g}: {SMOOTH}-frame mean; drift {DRIFT} rad/frame, scene cut at frame {setup.cut}; "
                        f"x: a run diverged", fontsize=9)
        near.set_title(f"lr {lr:g}: around the cut, per frame", fontsize=9)
        whole.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"PARTIME's update vs exact online SGD, {setup.model}", fontsize=10)
    fig.tight_layout()
    return figure_png(fig)


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"--lr must be comma-separated numbers, got {text!r}") from None
    for rate in rates:
        if not (math.isfinite(rate) and 0 < rate <= 10):
            raise SpecError(f"--lr must be numbers in (0, 10], got {text!r}")
    if len(set(rates)) != len(rates) or len(rates) > 4:
        raise SpecError(f"--lr must be at most 4 different rates, got {text!r}")
    return rates


@dataclass(frozen=True)
class Result:
    """The setup, the first seed, whether quick, and every run: per repetition, per learning rate, exact SGD then
    PARTIME on each stage count."""

    setup: Setup
    seed: int
    quick: bool
    runs: tuple[Run, ...]


def parser() -> CliParser:
    """``python -m experiments.run partime_drift [--quick] [--seed S] [--frames T] [--repeats R] [--lr RATES]
    [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run partime_drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/partime_drift", help="output directory (default runs/partime_drift)")
    parser.add_argument("--quick", action="store_true", help="1 and 2 stages, 60 frames of 16 x 16, one seed (CI)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first repetition's stream and weights")
    parser.add_argument("--frames", type=int, default=None, metavar="T",
                        help=f"frames per run, the cut at T // 2 (default {FULL.frames}; {QUICK.frames} with --quick)")
    parser.add_argument("--repeats", type=int, default=None, metavar="R",
                        help=f"repetitions, seeds seed .. seed + R - 1 (default {FULL.repeats}; 1 with --quick)")
    parser.add_argument("--lr", default=None, metavar="RATES",
                        help=f"SGD learning rates, comma-separated (default {','.join(map(str, FULL.lrs))}; "
                             f"{QUICK.lrs[0]} with --quick)")
    return parser


def run(*, quick: bool = False, seed: int = 0, frames: int | None = None, repeats: int | None = None,
        lr: str | None = None) -> Result:
    """Exact online SGD and PARTIME on every stage count, per repetition (seeds ``seed`` ..) and learning rate
    (``lr``: comma-separated); ``frames``, ``repeats`` and ``lr`` default to :data:`FULL`'s (``quick``:
    :data:`QUICK`'s).

    Raises:
        SpecError: frames, repeats, seed or rates out of range (each named by its flag).
    """
    base = QUICK if quick else FULL
    frames = base.frames if frames is None else frames
    repeats = base.repeats if repeats is None else repeats
    if not MIN_FRAMES <= frames <= MAX_FRAMES:
        raise SpecError(f"--frames must be from {MIN_FRAMES} to {MAX_FRAMES}, got {frames}")
    if not 1 <= repeats <= 10:
        raise SpecError(f"--repeats must be from 1 to 10, got {repeats}")
    if seed < 0:
        raise SpecError(f"--seed must be >= 0, got {seed}")
    lrs = base.lrs if lr is None else _rates(lr)
    setup = Setup(base.size, frames, base.stages, repeats, lrs)
    threads = torch.get_num_threads()
    # One intra-op thread: these 32 x 32 convolutions gain little from more, the numbers then do not depend on the
    # machine's core count, and on a shared host idle worker threads spinning for work cost several times the run.
    torch.set_num_threads(1)
    try:
        runs = run_all(setup, seed)
    finally:
        torch.set_num_threads(threads)
    return Result(setup, seed, quick, tuple(runs))


def report(result: Result) -> str:
    """The setup, each repetition and rate done, and the table of measures over exact SGD's."""
    setup, seed = result.setup, result.seed
    lines = [f"{setup.model}, {setup.frames} frames of {setup.size} x {setup.size}, drift {DRIFT} rad/frame, scene cut "
             f"at frame {setup.cut}; PARTIME with {', '.join(map(str, setup.stages))} stages against exact online SGD; "
             f"SGD lr {', '.join(map(str, setup.lrs))}; seeds {seed}..{seed + setup.repeats - 1}"
             f"{'; --quick' if result.quick else ''}"]
    lines += [f"  seed {seed + r}, lr {lr}: done" for r in range(setup.repeats) for lr in setup.lrs]
    return "\n".join([*lines, *_table(setup, summarise(setup, list(result.runs)))])


def write(result: Result, out: Path) -> list[Path]:
    """``partime_drift.csv`` (every frame of every run) and ``partime_drift.png`` in ``out``."""
    runs = list(result.runs)
    return write_csv_png(out, "partime_drift", _csv(runs, result.seed), _plot(result.setup, runs))
