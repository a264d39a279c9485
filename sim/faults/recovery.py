"""Recovery policies compared: what a failure costs a long run when the job restarts from its checkpoint, and when
it goes on without the failed devices until they are replaced.

* ``restart`` (the baseline): every device stops, the job restarts from its last durable checkpoint
  (:func:`sim.faults.long_run.simulate_long_run`).
* ``drop-replica``: the data-parallel replica that holds the failed device is dropped and the others go on with the
  global batch rebalanced over them (TorchFT's per-step fault tolerance, Varuna's job morphing), each iteration
  D/(D − k) times as long with k replicas out; the replica rejoins when its device is replaced.
* ``recycle`` (ReCycle, SOSP'24): the failed pipeline stage's microbatches are rerouted to the same stage of its
  data-parallel peers, which each take 1/(D − 1) more of that stage's work; the slowdown of one failure is the plan
  simulated with those peers as stragglers of factor D/(D − 1) (:mod:`sim.engine.perturbation`), an upper bound,
  since ReCycle also fills pipeline bubbles with the extra work; k failures compound it.
* ``oobleck`` (Oobleck, SOSP'23): the job is re-planned onto the surviving devices from precomputed pipeline
  templates; with k servers of g devices out of N devices, each iteration N/(N − k·g) times as long (the templates'
  ideal: throughput in proportion to the devices).

A continuing policy loses only the iteration a failure interrupts, then pauses ``reconfigure_s`` (a continuing
policy's reconfiguration) and runs degraded until the failed capacity returns ``repair_s`` later (the spare's
start-up, the run's restart time by default). It still checkpoints, for the failures it cannot absorb: with more
failures outstanding than it tolerates (:attr:`Recovery.slowdowns`), the job restarts from its checkpoint as the
baseline does. Approximations, stated: a failure that strikes during a reconfiguration or a checkpoint's stall takes
effect when it ends, and a device's return takes effect at the start of the iteration in flight.

Times in s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.core.errors import SpecError
from sim.faults.long_run import MAX_EVENTS, Failure, LongRun, LongRunResult, simulate_long_run

__all__ = ["POLICIES", "Recovery", "RESTART", "drop_replica", "oobleck", "recycle", "simulate_recovery"]

#: The policies, in the order they are reported.
POLICIES = ("restart", "drop-replica", "recycle", "oobleck")


@dataclass(frozen=True)
class Recovery:
    """How a job recovers from a failure (module docstring).

    Attributes:
        name: one of :data:`POLICIES`.
        slowdowns: the iteration time's factor with k = 1, 2, … failures outstanding; a failure beyond them restarts
            the job from its checkpoint (empty: ``restart``, every failure does).
        reconfigure_s: the pause before a continuing policy goes on (s).
        repair_s: until a failed device's capacity returns (s; ``None``: the run's restart time).
    """

    name: str
    slowdowns: tuple[float, ...] = ()
    reconfigure_s: float = 0.0
    repair_s: float | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise SpecError(f"recovery policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if any(not math.isfinite(s) or s < 1 for s in self.slowdowns):
            raise ValueError(f"slowdowns must be finite numbers >= 1, got {self.slowdowns}")


#: Restart every device from the last checkpoint.
RESTART = Recovery("restart")


def drop_replica(replicas: int, *, reconfigure_s: float, repair_s: float | None = None) -> Recovery:
    """``drop-replica`` for a job of ``replicas`` data-parallel replicas: D/(D − k) with k out, up to D − 1."""
    return Recovery("drop-replica", tuple(replicas / (replicas - k) for k in range(1, replicas)), reconfigure_s,
                    repair_s)


def recycle(slowdown: float, replicas: int, *, reconfigure_s: float, repair_s: float | None = None,
            most: int = 8) -> Recovery:
    """``recycle`` with one failure's simulated ``slowdown``, compounding, for up to ``min(most, D − 1)`` failures."""
    return Recovery("recycle", tuple(slowdown ** k for k in range(1, min(most, replicas - 1) + 1)), reconfigure_s,
                    repair_s)


def oobleck(devices: int, per_server: int, *, reconfigure_s: float, repair_s: float | None = None) -> Recovery:
    """``oobleck`` for ``devices`` devices in servers of ``per_server``: N/(N − k·g) while at least half remain."""
    most = max(0, devices // (2 * per_server))
    return Recovery("oobleck", tuple(devices / (devices - k * per_server) for k in range(1, most + 1)),
                    reconfigure_s, repair_s)


def simulate_recovery(run: LongRun, recovery: Recovery, rng: np.random.Generator) -> LongRunResult:
    """One seeded long run under ``recovery`` (module docstring): the baseline's own simulation for ``restart``."""
    if not recovery.slowdowns:
        return simulate_long_run(run, rng)
    shares = np.asarray(run.mix.shares())
    repair = run.restart_s if recovery.repair_s is None else recovery.repair_s
    every = run.checkpoint_every or run.iterations
    cost = run.checkpoint
    now = compute = degraded = checkpoint_s = lost = 0.0
    restart_by_cause = [0.0] * len(shares)
    done = committed = checkpoints = 0
    returns: list[float] = []  # when each outstanding failure's capacity comes back, in order
    failures: list[Failure] = []
    strike = now + float(rng.exponential(run.mtbf_s))
    events = 0
    while done < run.iterations:
        events += 1
        if events > MAX_EVENTS:
            raise SpecError(f"the run took more than {MAX_EVENTS:,} events under {recovery.name}: failures come too "
                            f"often for it to finish")
        while returns and returns[0] <= now:
            returns.pop(0)
        factor = recovery.slowdowns[len(returns) - 1] if returns else 1.0
        step = run.iteration_s * factor
        boundary = min(every - done % every, run.iterations - done)  # iterations to the next checkpoint
        until = min(strike, returns[0]) if returns else strike
        batch = boundary if math.isinf(until) else min(boundary, int((until - now) // step))  # inf: none to come
        if batch > 0:
            now += batch * step
            compute += batch * run.iteration_s
            degraded += batch * (step - run.iteration_s)
            done += batch
            if done % every == 0 or done == run.iterations:  # checkpoint (its stall taken whole; docstring)
                now += cost.blocking_s + cost.persist_s  # continuing policies write synchronously
                checkpoint_s += cost.blocking_s + cost.persist_s
                committed, checkpoints = done, checkpoints + 1
                strike = max(strike, now)
            continue
        if returns and returns[0] < strike:  # capacity returns during this iteration: it takes effect now
            returns.pop(0)
            continue
        # A failure strikes before the next iteration ends: the iteration in flight is lost.
        partial = strike - now
        lost += partial
        now = strike
        cause = int(rng.choice(len(shares), p=shares))
        if len(returns) < len(recovery.slowdowns):  # absorbed: reconfigure and go on degraded
            down = recovery.reconfigure_s
            returns.append(now + down + repair + run.mix.causes[cause].repair_s)
            failures.append(Failure(now, cause, partial, down))
        else:  # more failures than it tolerates: restart from the checkpoint, every device back
            rolled = (done - committed) * run.iteration_s
            lost += rolled
            compute -= rolled
            done, returns = committed, []
            down = run.restart_s + run.mix.causes[cause].repair_s + cost.load_s
            failures.append(Failure(now, cause, rolled + partial, down))
        now += down
        restart_by_cause[cause] += down
        strike = now + float(rng.exponential(run.mtbf_s))
    productive = run.iterations * run.iteration_s
    return LongRunResult(now, productive, lost + (compute - productive), checkpoint_s, tuple(restart_by_cause),
                         tuple(failures), float(len(failures)), float(checkpoints), degraded)
