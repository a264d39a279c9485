"""A long run with failures: seeded fail-stop failures over many iterations, the checkpoints that bound what each
one loses, and the restarts; its effective training time ratio and goodput.

The run trains ``iterations`` iterations of ``iteration_s`` each (the simulated iteration of its plan). After every
``checkpoint_every`` of them, and after the last, it checkpoints (:class:`sim.faults.checkpoint.CheckpointCost`):
training stalls ``blocking_s``, and the checkpoint is durable ``persist_s`` later (0 when synchronous; an
asynchronous snapshot waits for the previous persist to end). Failures arrive as a Poisson process of mean interval
``mtbf_s`` (the job's: :func:`sim.faults.failure_mix.job_mtbf_s`), at any moment, computing, checkpointing or
restarting; each is of a cause drawn from the mix by its share. A failure throws away every iteration since the last
durable checkpoint and the job restarts: ``restart_s`` (detection, rescheduling, initialisation), the cause's
``repair_s`` and the checkpoint's ``load_s``; a failure during a restart starts the restart over (as in Daly's model,
FGCS 2006, so with a synchronous checkpoint and no repair times the expected wall time is Daly's closed form,
:func:`sim.faults.interval.expected_wall_time`, which the tests hold the simulation to).

The time is accounted in four parts that add up to the wall time: ``productive_s`` (the iterations that count,
``iterations · iteration_s``), ``lost_work_s`` (computation a failure threw away), ``checkpoint_s`` (stalls for
checkpoints, including waits for a previous persist) and ``restart_s`` (per cause). The effective training time ratio
(ETTR, Kokolis et al., HPCA 2025) is productive over wall time.

Everything is drawn from a ``numpy.random.Generator`` the caller seeds (``[seed, trial]``): the same inputs give the
same run. Work is bounded: a run whose failures come too often for it to finish is refused before it is simulated
(:func:`check_finishes`).
Times in s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.core.errors import SpecError
from sim.faults.checkpoint import CheckpointCost
from sim.faults.failure_mix import FailureMix
from sim.faults.interval import expected_wall_time

__all__ = ["LongRun", "Failure", "LongRunResult", "ScriptedFailures", "check_finishes", "simulate_long_run",
           "expected_long_run", "MAX_EVENTS", "MAX_STRETCH"]

#: Most failures and segments one simulated run may take: a backstop behind :func:`check_finishes`.
MAX_EVENTS = 1_000_000
#: Most times its failure-free length a run's expected wall time may be (:func:`check_finishes`).
MAX_STRETCH = 100.0


@dataclass(frozen=True)
class LongRun:
    """A long run (module docstring).

    Attributes:
        iteration_s: one iteration (s).
        iterations: iterations to train.
        checkpoint_every: iterations between checkpoints (0: never; then a failure restarts from the beginning).
        checkpoint: what a checkpoint costs.
        mtbf_s: the job's mean time between failures (s).
        restart_s: detection, rescheduling and initialisation of each restart (s).
        mix: the failure causes.
    """

    iteration_s: float
    iterations: int
    checkpoint_every: int
    checkpoint: CheckpointCost
    mtbf_s: float
    restart_s: float
    mix: FailureMix

    def __post_init__(self) -> None:
        for name in ("iteration_s", "mtbf_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise ValueError(f"restart_s must be a finite number >= 0, got {self.restart_s!r}")
        if self.iterations < 1 or self.checkpoint_every < 0:
            raise ValueError(f"need iterations >= 1 and checkpoint_every >= 0, got {self.iterations}, "
                             f"{self.checkpoint_every}")


@dataclass(frozen=True)
class Failure:
    """One failure of a simulated run.

    Attributes:
        time_s: when it struck (s from the start).
        cause: its index in the mix.
        lost_s: computation it threw away (s).
        down_s: the restart time charged to it: until training resumed, or until another failure struck the
            restart and started it over (s).
        during_restart: whether it struck a restart.
    """

    time_s: float
    cause: int
    lost_s: float
    down_s: float
    during_restart: bool = False


@dataclass(frozen=True)
class LongRunResult:
    """What one simulated run (or the mean of several) took (module docstring).

    Attributes:
        wall_s: start to the last checkpoint durable (s).
        productive_s, lost_work_s, checkpoint_s: parts of it (s).
        restart_s_by_cause: restart time charged to each cause of the mix, in its order (s).
        failures: the failures (for one run; empty for a mean).
        failure_count: how many (a mean: the mean count).
        checkpoints: checkpoints that became durable.
        degraded_s: what the iterations run on fewer devices after a failure took beyond their usual time (s; a
            recovery that continues without restarting, ``sim.faults.recovery``; 0 otherwise).
    """

    wall_s: float
    productive_s: float
    lost_work_s: float
    checkpoint_s: float
    restart_s_by_cause: tuple[float, ...]
    failures: tuple[Failure, ...]
    failure_count: float
    checkpoints: float
    degraded_s: float = 0.0

    @property
    def restart_s(self) -> float:
        """All restart time (s)."""
        return math.fsum(self.restart_s_by_cause)

    @property
    def effective_training_time_ratio(self) -> float:
        """Productive over wall time."""
        return self.productive_s / self.wall_s


class _Clock:
    """The run's time, and where it went."""

    def __init__(self, causes: int) -> None:
        self.now = 0.0
        self.compute = self.checkpoint = 0.0
        self.restart = [0.0] * causes
        self.events = 0

    def tick(self) -> None:
        self.events += 1
        if self.events > MAX_EVENTS:
            raise SpecError(f"the run took more than {MAX_EVENTS:,} segments and failures without finishing: failures "
                            f"come too often for it to finish (raise --mtbf, checkpoint more often with "
                            f"--checkpoint-every, or shorten the restart)")


class ScriptedFailures:
    """What :func:`simulate_long_run` draws from, with the failures given instead of drawn: ``gaps`` are the times to
    each next failure, in the order the run asks for them (at its start, and afresh after each restart and during
    it); then none. Every failure is of cause 0. For a prediction of a run whose failure is known (an injected crash,
    ``experiments.faults_real``) and for exact small tests."""

    def __init__(self, gaps: list[float]) -> None:
        self.gaps = list(gaps)

    def exponential(self, scale: float) -> float:
        return self.gaps.pop(0) if self.gaps else math.inf

    def choice(self, n: int, p: object = None) -> int:
        return 0


def check_finishes(run: LongRun) -> None:
    """Refuse, before simulating, a run whose failures come so often that its expected wall time (Daly's closed form
    with the longest restart, :func:`sim.faults.interval.expected_wall_time`) is more than :data:`MAX_STRETCH` times
    its failure-free length.

    Raises:
        SpecError: naming the MTBF, the checkpoint interval and the restart, and what would help.
    """
    every = run.checkpoint_every or run.iterations
    interval = every * run.iteration_s
    cost = run.checkpoint
    checkpoint = cost.blocking_s + max(0.0, cost.persist_s - interval)
    restart = run.restart_s + max(cause.repair_s for cause in run.mix.causes) + cost.load_s
    work = run.iterations * run.iteration_s
    try:
        stretch = expected_wall_time(work, interval, checkpoint, restart, run.mtbf_s) / (work + checkpoint)
    except OverflowError:
        stretch = math.inf
    if stretch > MAX_STRETCH:
        raise SpecError(f"failures come too often for this run to finish: a failure every {run.mtbf_s / 3600:.3g} h "
                        f"of the job against {interval / 3600:.3g} h of training between checkpoints and "
                        f"{restart / 60:.3g} min to restart (expected {stretch:.3g} times its length); raise --mtbf, "
                        f"checkpoint more often (--checkpoint-every) or shorten the restart")


def simulate_long_run(run: LongRun, rng: np.random.Generator,
                      trail: list[tuple[float, float]] | None = None) -> LongRunResult:
    """One seeded run (module docstring); with ``trail``, appends ``(time in s, iterations computed)`` at the start,
    at every segment's end, at each failure (the work computed when it struck, then what is left after it) and at the
    end of each restart: the run's progress, for a chart (``sim.faults.chart``).

    Segments of ``checkpoint_every`` iterations and their checkpoint that end before the next failure are taken in
    bulk, the time left to that failure carried over (drawing it afresh would lose that it falls within the next
    segment); after a restart the time to the next failure is drawn afresh, as exponential times are memoryless.
    """
    check_finishes(run)
    if trail is not None:
        trail.append((0.0, 0.0))
    shares = np.asarray(run.mix.shares())
    clock = _Clock(len(shares))
    failures: list[Failure] = []
    committed = progress = 0  # iterations durable; iterations computed since the start of this lineage
    pending: tuple[int, float] | None = None  # an asynchronous checkpoint not yet durable: (iterations, durable at)
    checkpoints = 0
    every = run.checkpoint_every or run.iterations
    cost = run.checkpoint
    strike: float | None = None  # time from now to the next failure, once drawn
    while committed < run.iterations:
        clock.tick()
        if pending is not None and pending[1] <= clock.now:
            committed, pending, checkpoints = pending[0], None, checkpoints + 1
            continue
        batch, checkpointing = 0, False
        if progress == run.iterations:  # everything computed: wait for the last persist
            assert pending is not None
            compute_s, stall_s, snapshot = 0.0, pending[1] - clock.now, 0.0
        else:
            batch = min(every, run.iterations - progress)
            compute_s = batch * run.iteration_s
            checkpointing = run.checkpoint_every > 0 or progress + batch == run.iterations
            # An asynchronous snapshot waits for the previous persist: it must be durable before it is replaced.
            stall_s = max(0.0, pending[1] - clock.now - compute_s) if pending is not None and checkpointing else 0.0
            snapshot = cost.blocking_s if checkpointing else 0.0
        segment = compute_s + stall_s + snapshot
        if strike is None:
            strike = float(rng.exponential(run.mtbf_s))
        if strike >= segment:
            if compute_s == 0.0:  # the wait for the last persist ended
                clock.now += segment
                clock.checkpoint += segment
                strike -= segment
                continue
            # Alike segments that also end before the strike: whole checkpointed batches with no persist to wait for.
            # With an asynchronous persist longer than a batch, every snapshot after the first waits for the previous
            # persist as long (the steady stall); the segments are alike once this one's stall is that one.
            steady = max(0.0, cost.persist_s - compute_s)
            alike = 1
            if checkpointing and batch == every and (stall_s == steady == 0.0 or (
                    pending is not None and math.isclose(stall_s, steady, rel_tol=1e-12, abs_tol=1e-9))):
                fits = int(strike // segment) if math.isfinite(strike) else run.iterations  # no failure to come
                alike = max(1, min(fits, (run.iterations - progress) // every))
            clock.now += alike * segment
            strike -= alike * segment
            if trail is not None:
                trail.append((clock.now, float(progress + alike * batch)))
            clock.compute += alike * compute_s
            clock.checkpoint += alike * (stall_s + snapshot)
            progress += alike * batch
            if not checkpointing:
                continue
            if cost.persist_s > 0:  # every earlier one is durable: each snapshot waited for the persist before it
                durable = (pending is not None) + alike - 1
                committed, checkpoints = progress - batch if durable else committed, checkpoints + durable
                pending = (progress, clock.now + cost.persist_s)
            else:
                committed, checkpoints = progress, checkpoints + alike
            continue
        # A failure strikes inside this segment.
        clock.now += strike
        computed = min(strike, compute_s)
        clock.compute += computed
        clock.checkpoint += strike - computed
        if pending is not None and pending[1] <= clock.now:
            committed, checkpoints = pending[0], checkpoints + 1
        lost = (progress - committed) * run.iteration_s + computed
        if trail is not None:
            trail += [(clock.now, progress + computed / run.iteration_s), (clock.now, float(committed))]
        progress, pending, strike = committed, None, None
        failures.extend(_restart(run, rng, shares, clock, lost))
        if trail is not None:
            trail.append((clock.now, float(committed)))
    productive = run.iterations * run.iteration_s
    return LongRunResult(clock.now, productive, clock.compute - productive, clock.checkpoint, tuple(clock.restart),
                         tuple(failures), float(len(failures)), float(checkpoints))


def _restart(run: LongRun, rng: np.random.Generator, shares: np.ndarray, clock: _Clock, lost: float
             ) -> list[Failure]:
    """The restart after a failure at ``clock.now`` that threw away ``lost`` seconds of work, started over by every
    failure that strikes it; the failures, the first one first."""
    failures: list[Failure] = []
    during = False
    while True:
        clock.tick()
        cause = int(rng.choice(len(shares), p=shares))
        down = run.restart_s + run.mix.causes[cause].repair_s + run.checkpoint.load_s
        strike = rng.exponential(run.mtbf_s)
        start = clock.now
        if strike >= down:
            clock.now += down
            clock.restart[cause] += down
            failures.append(Failure(start, cause, lost if not during else 0.0, down, during))
            return failures
        clock.now += strike
        clock.restart[cause] += strike
        failures.append(Failure(start, cause, lost if not during else 0.0, strike, during))
        during = True


def expected_long_run(run: LongRun, *, trials: int, seed: int,
                      simulate: Callable[[LongRun, np.random.Generator], LongRunResult] | None = None
                      ) -> LongRunResult:
    """The mean of ``trials`` runs, trial t drawn from ``numpy.random.default_rng([seed, t])`` (the same streams for
    every ``run``, so runs that differ only in their checkpoint interval are compared on the same failures' luck), each
    simulated by ``simulate`` (:func:`simulate_long_run`, or a recovery's, ``sim.faults.recovery``)."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    simulate = simulate or simulate_long_run
    results = [simulate(run, np.random.default_rng([seed, t])) for t in range(trials)]

    def mean(values) -> float:
        return math.fsum(values) / trials

    return LongRunResult(mean(r.wall_s for r in results), results[0].productive_s,
                         mean(r.lost_work_s for r in results), mean(r.checkpoint_s for r in results),
                         tuple(mean(r.restart_s_by_cause[c] for r in results)
                               for c in range(len(run.mix.causes))),
                         (), mean(r.failure_count for r in results), mean(r.checkpoints for r in results),
                         mean(r.degraded_s for r in results))
