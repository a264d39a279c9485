"""The ``sim.run`` options that ask for a long run with failures, and what they predict from a plan's simulated
iteration: the checkpoint interval swept, the seeded and expected runs, and the ``faults`` object of ``metrics.json``
(:class:`FaultPrediction`; drawn by :mod:`sim.faults.chart`).

``sim.run --train-hours H`` (or ``--iterations N``) predicts a run of that much failure-free training (H hours of
iterations, or N iterations) on the plan's devices, failing as ``--mtbf`` and ``--failure-mix`` say, checkpointing
every ``--checkpoint-every`` iterations, synchronously or not (:mod:`sim.faults.checkpoint`,
:mod:`sim.faults.long_run`). Reported:

* the seeded run (``--seed``): its failures, wall time, effective training time ratio (ETTR) and goodput (tokens of
  the iterations that count, per second of wall time), and the time lost by cause;
* the expectation over ``--fault-trials`` seeded runs, at the chosen interval and at each interval of a sweep, the
  same trials for every interval, with the best one found; beside it Young's and Daly's closed-form intervals
  (:mod:`sim.faults.interval`), which assume a synchronous checkpoint;
* without ``--checkpoint-every``, the run checkpoints at the best interval of the sweep.

Times in s (hours where the flag says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sim.core.errors import SpecError
from sim.faults.checkpoint import checkpoint_cost
from sim.faults.failure_mix import BUILTIN_MIX, FailureMix, builtin_mix, job_mtbf_s, load_failure_mix
from sim.faults.interval import daly_interval, young_interval
from sim.faults.long_run import LongRun, LongRunResult, check_finishes, expected_long_run, simulate_long_run
from sim.hw.topology import Topology
from sim.models.graph import LayerGraph

__all__ = ["FaultOptions", "FaultPrediction", "predict_faults", "SWEEP_POINTS", "DEFAULT_RESTART_MINUTES",
           "MAX_ITERATIONS"]

#: Intervals the sweep tries, log-spaced from 1/16 to 16 times Young's.
SWEEP_POINTS = 33
#: Detection, rescheduling and initialisation of a restart when none is given (min) [assumed]: PyTorch's default
#: NCCL watchdog timeout is 10 minutes, and a large job's restart takes minutes more; Llama 3 reports only the
#: result (> 90 % effective training time at 16,384 GPUs).
DEFAULT_RESTART_MINUTES = 10.0
#: Most iterations a long run may train (a bound on the work asked for before anything is simulated).
MAX_ITERATIONS = 10**9


@dataclass(frozen=True)
class FaultOptions:
    """What ``sim.run``'s fault flags ask for (module docstring).

    Attributes:
        train_hours: failure-free training time to run (h), or ``None`` when ``iterations`` is given.
        iterations: iterations to run, or ``None`` when ``train_hours`` is given.
        mtbf_hours: mean time between failures (h): of one device (``mtbf_scope`` ``device``) or of the whole job
            (``cluster``); ``None``: the mix's own per-device figure.
        mtbf_scope: ``device`` or ``cluster``.
        failure_mix: a mix file, or ``None`` for the built-in one.
        checkpoint_every: iterations between checkpoints; ``None``: the sweep's best.
        asynchronous: checkpoints persist behind training.
        storage_bandwidth: aggregate storage write bandwidth (bytes/s); ``None``: Llama 3's per device
            (:data:`sim.faults.checkpoint.STORAGE_BANDWIDTH_PER_DEVICE`) times the devices.
        restart_minutes: detection, rescheduling and initialisation of a restart (min).
        seed: the runs' seed.
        trials: seeded runs the expectation averages.
    """

    train_hours: float | None = None
    iterations: int | None = None
    mtbf_hours: float | None = None
    mtbf_scope: str = "device"
    failure_mix: str | None = None
    checkpoint_every: int | None = None
    asynchronous: bool = False
    storage_bandwidth: float | None = None
    restart_minutes: float = DEFAULT_RESTART_MINUTES
    seed: int = 0
    trials: int = 16

    @property
    def requested(self) -> bool:
        """Whether a long run is asked for."""
        return self.train_hours is not None or self.iterations is not None

    def check(self) -> FailureMix:
        """Check the flags that need no simulation, and read the failure mix (before anything is simulated).

        Raises:
            SpecError: naming the flag, its value and what would be valid.
        """
        _check(self)
        if (self.train_hours is None) == (self.iterations is None):
            raise SpecError(f"give --train-hours or --iterations (the run's length), not both; got "
                            f"{self.train_hours} and {self.iterations}")
        if self.mtbf_scope == "cluster" and self.mtbf_hours is None:
            raise SpecError("--mtbf-scope cluster needs --mtbf HOURS (the whole job's mean time between failures)")
        mix = load_failure_mix(self.failure_mix) if self.failure_mix else builtin_mix()
        if self.mtbf_scope == "device" and self.mtbf_hours is None and mix.device_mtbf_s() is None:
            raise SpecError(f"failure mix {self.failure_mix} gives no devices and hours to imply an MTBF; give "
                            f"--mtbf HOURS")
        return mix


@dataclass(frozen=True)
class FaultPrediction:
    """A long run's prediction.

    Attributes:
        run: the long run simulated (its interval chosen).
        seeded: the seeded run.
        expected: the expectation at the chosen interval.
        sweep: ``(checkpoint_every, expected wall time in s)`` per interval tried.
        best_every: the interval of the sweep with the least expected wall time.
        mix: the failure causes.
        device_mtbf_s: the per-device MTBF used (s; ``None`` when a cluster MTBF was given).
        tokens_per_iteration: tokens one iteration trains.
        metrics: the ``metrics.json`` object.
        trail: the seeded run's progress, ``(time in s, iterations computed)`` points.
        failure_free_s: the run's wall time without failures (s).
    """

    run: LongRun
    seeded: LongRunResult
    expected: LongRunResult
    sweep: tuple[tuple[int, float], ...]
    best_every: int
    mix: FailureMix
    device_mtbf_s: float | None
    tokens_per_iteration: int
    metrics: dict[str, Any]
    trail: tuple[tuple[float, float], ...] = ()
    failure_free_s: float = 0.0

    def chart_png(self, title: str) -> bytes:
        """``long_run.png`` (:mod:`sim.faults.chart`)."""
        from sim.faults.chart import long_run_png

        return long_run_png(self.run, self.trail, self.seeded.failures, self.mix, title=title,
                            failure_free_s=self.failure_free_s)

    def summary(self) -> str:
        """Lines for the ``sim.run`` summary."""
        run, seeded, expected = self.run, self.seeded, self.expected
        hours = seeded.wall_s / 3600
        lines = [
            f"long run          {run.iterations:,} iterations ({run.iterations * run.iteration_s / 3600:,.1f} h of "
            f"training), job MTBF {run.mtbf_s / 3600:,.2f} h, restart {run.restart_s / 60:g} min + "
            f"{run.checkpoint.load_s:,.1f} s load",
            f"checkpoint        every {run.checkpoint_every:,} iterations "
            f"({run.checkpoint_every * run.iteration_s:,.0f} s), {run.checkpoint.nbytes / 1e9:,.1f} GB, stalls "
            f"{run.checkpoint.blocking_s:,.2f} s"
            + (f", durable {run.checkpoint.persist_s:,.2f} s later" if run.checkpoint.persist_s else "")
            + f"; best of the sweep every {self.best_every:,}",
            f"seeded run        {len(seeded.failures)} failures, {hours:,.1f} h wall, effective training time "
            f"{seeded.effective_training_time_ratio * 100:.1f} %, goodput "
            f"{self.tokens_per_iteration * run.iterations / seeded.wall_s:,.0f} tokens/s",
            f"expected          effective training time {expected.effective_training_time_ratio * 100:.1f} % "
            f"(mean of {len(self.metrics['expected']['trials_seeds'])} seeded runs), lost: work "
            f"{expected.lost_work_s / 3600:,.2f} h, checkpoints {expected.checkpoint_s / 3600:,.2f} h, restarts "
            f"{expected.restart_s / 3600:,.2f} h",
        ]
        return "\n".join(lines)


def _iterations(options: FaultOptions, iteration_s: float) -> int:
    if options.iterations is not None:
        return options.iterations
    hours = options.train_hours
    assert hours is not None  # check()
    count = max(1, round(hours * 3600 / iteration_s))
    if count > MAX_ITERATIONS:
        raise SpecError(f"--train-hours {hours:g} is {count:,} iterations of {iteration_s:.3g} s; at most "
                        f"{MAX_ITERATIONS:,}")
    return count


def _check(options: FaultOptions) -> None:
    if options.iterations is not None and not 1 <= options.iterations <= MAX_ITERATIONS:
        raise SpecError(f"--iterations must be in 1..{MAX_ITERATIONS:,}, got {options.iterations}")
    if options.train_hours is not None and (not math.isfinite(options.train_hours) or options.train_hours <= 0):
        raise SpecError(f"--train-hours must be a number of hours > 0, got {options.train_hours:g}")
    if options.mtbf_scope not in ("device", "cluster"):
        raise SpecError(f"--mtbf-scope must be device or cluster, got {options.mtbf_scope!r}")
    for flag, value, zero in (("--mtbf", options.mtbf_hours, False), ("--restart-minutes", options.restart_minutes,
                               True), ("--storage-bandwidth", options.storage_bandwidth, False)):
        if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and not zero)):
            raise SpecError(f"{flag} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}")
    if options.checkpoint_every is not None and options.checkpoint_every < 1:
        raise SpecError(f"--checkpoint-every must be a number of iterations >= 1, got {options.checkpoint_every}")
    if not 1 <= options.trials <= 1000:
        raise SpecError(f"--fault-trials must be in 1..1000, got {options.trials}")


def predict_faults(options: FaultOptions, *, iteration_s: float, tokens_per_iteration: int, model: LayerGraph,
                   topology: Topology) -> FaultPrediction:
    """Predict the long run ``options`` asks for, of iterations of ``iteration_s`` seconds training
    ``tokens_per_iteration`` tokens each, of the whole (unsharded) ``model`` on every device of ``topology``.

    Raises:
        SpecError: a flag out of range (named, with its value and what is valid), or a run whose failures come too
            often for it to finish.
    """
    mix = options.check()
    iterations = _iterations(options, iteration_s)
    device_mtbf_s: float | None
    if options.mtbf_scope == "cluster":
        assert options.mtbf_hours is not None  # check()
        device_mtbf_s, mtbf_s = None, options.mtbf_hours * 3600
    else:
        device_mtbf_s = options.mtbf_hours * 3600 if options.mtbf_hours is not None else mix.device_mtbf_s()
        assert device_mtbf_s is not None  # check()
        mtbf_s = job_mtbf_s(device_mtbf_s, topology.num_ranks)
    cost = checkpoint_cost(model, topology, storage_bandwidth=options.storage_bandwidth,
                           asynchronous=options.asynchronous)
    base = LongRun(iteration_s, iterations, 1, cost, mtbf_s, options.restart_minutes * 60, mix)
    young = young_interval(max(cost.blocking_s, 1e-9), mtbf_s)
    sweep = _sweep(base, young, options)
    best_every = min(sweep, key=lambda point: (point[1], point[0]))[0]
    every = options.checkpoint_every if options.checkpoint_every is not None else best_every
    run = replace(base, checkpoint_every=min(every, iterations))
    expected = expected_long_run(run, trials=options.trials, seed=options.seed)
    trail: list[tuple[float, float]] = []
    seeded = simulate_long_run(run, np.random.default_rng([options.seed, 0]), trail)
    failure_free = simulate_long_run(replace(run, mtbf_s=1e300),
                                     np.random.default_rng([options.seed, 0])).wall_s
    metrics = _metrics(run, seeded, expected, sweep, best_every, mix, device_mtbf_s, tokens_per_iteration, options,
                       young)
    metrics["failure_free_wall_time_s"] = failure_free
    return FaultPrediction(run, seeded, expected, tuple(sweep), best_every, mix, device_mtbf_s, tokens_per_iteration,
                       metrics, tuple(trail), failure_free)


def _sweep(base: LongRun, young_s: float, options: FaultOptions) -> list[tuple[int, float]]:
    """The expected wall time at each interval of a log-spaced grid around Young's (and at the one asked for), but
    intervals too long for the run to finish."""
    centre = young_s / base.iteration_s
    grid = {max(1, min(base.iterations, round(centre * 16 ** (k / ((SWEEP_POINTS - 1) / 2) - 1))))
            for k in range(SWEEP_POINTS)}
    if options.checkpoint_every is not None:
        grid.add(min(options.checkpoint_every, base.iterations))
    points = []
    for every in sorted(grid):
        try:
            wall = expected_long_run(replace(base, checkpoint_every=every), trials=options.trials,
                                     seed=options.seed).wall_s
        except SpecError:  # an interval so long that the run would not finish: not a candidate
            continue
        points.append((every, wall))
    if not points:
        check_finishes(replace(base, checkpoint_every=max(1, round(centre))))  # says why
    return points


def _metrics(run: LongRun, seeded: LongRunResult, expected: LongRunResult, sweep: list[tuple[int, float]],
             best_every: int, mix: FailureMix, device_mtbf_s: float | None, tokens: int, options: FaultOptions,
             young_s: float) -> dict[str, Any]:
    """The ``faults`` object of ``metrics.json``."""

    def lost(result: LongRunResult) -> dict[str, Any]:
        return {"lost_work_s": result.lost_work_s, "checkpoint_s": result.checkpoint_s,
                "restart_s": result.restart_s,
                "restart_s_by_cause": {cause.name: seconds for cause, seconds in
                                       zip(mix.causes, result.restart_s_by_cause, strict=True) if seconds}}

    goodput = tokens * run.iterations
    return {
        "iterations": run.iterations, "iteration_time_s": run.iteration_s,
        "training_time_s": run.iterations * run.iteration_s,
        "job_mtbf_s": run.mtbf_s, "device_mtbf_s": device_mtbf_s,
        "failure_mix": options.failure_mix or f"profiles/faults/{BUILTIN_MIX}.yaml", "failure_mix_source": mix.source,
        "restart_s": run.restart_s,
        "checkpoint": {"every_iterations": run.checkpoint_every, "interval_s": run.checkpoint_every * run.iteration_s,
                       "bytes": run.checkpoint.nbytes, "blocking_s": run.checkpoint.blocking_s,
                       "persist_s": run.checkpoint.persist_s, "load_s": run.checkpoint.load_s,
                       "asynchronous": options.asynchronous,
                       "storage_bandwidth_bytes_per_s": run.checkpoint.storage_bandwidth},
        "seeded_run": {"seed": options.seed, "wall_time_s": seeded.wall_s, "failures": len(seeded.failures),
                       "failure_times_s": [failure.time_s for failure in seeded.failures],
                       "effective_training_time_ratio": seeded.effective_training_time_ratio,
                       "goodput_tokens_per_s": goodput / seeded.wall_s, **lost(seeded)},
        "expected": {"trials_seeds": [[options.seed, t] for t in range(options.trials)],
                     "wall_time_s": expected.wall_s, "failures": expected.failure_count,
                     "effective_training_time_ratio": expected.effective_training_time_ratio,
                     "goodput_tokens_per_s": goodput / expected.wall_s, **lost(expected)},
        "effective_training_time_ratio": seeded.effective_training_time_ratio,
        "goodput_tokens_per_s": goodput / seeded.wall_s,
        "interval_sweep": [{"every_iterations": every, "expected_wall_time_s": wall} for every, wall in sweep],
        "best_checkpoint_every": best_every, "best_interval_s": best_every * run.iteration_s,
        "young_interval_s": young_s,
        "daly_interval_s": daly_interval(max(run.checkpoint.blocking_s, 1e-9), run.mtbf_s),
    }
