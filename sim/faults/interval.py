"""The checkpoint interval in closed form: Young's first-order optimum, Daly's higher-order one, and Daly's expected
wall time of a run that checkpoints every τ under exponentially distributed failures.

A run does ``work`` seconds of useful computation, writes a checkpoint of δ seconds after every τ seconds of it, and
fails at the events of a Poisson process of mean interval M (the job's mean time between failures; failures can
strike while it computes, checkpoints or restarts). A failure throws away the segment it struck (the work since the
last checkpoint) and costs R seconds of restart before the segment is tried again. Daly (J. T. Daly, "A higher order
estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, eq. 7) gives the expected wall
time of such a run exactly,

    T(τ) = M · e^{R/M} · (e^{(τ+δ)/M} − 1) · work / τ,

whose minimum over τ solves e^{(τ+δ)/M} · (1 − τ/M) = 1 (:func:`optimal_interval`). Young (J. W. Young, "A first
order approximation to the optimum checkpoint interval", CACM 17(9), 1974) approximates it by √(2δM); Daly's
higher-order estimate (FGCS 2006, eq. 37) by √(2δM)·[1 + ⅓·√(δ/(2M)) + ⅑·δ/(2M)] − δ for δ < 2M, else M. On
Daly's published cases (δ = 5 min, R = 10 min) the exact optimum is 116.7, 56.7 and 9.17 min for M = 24 h, 6 h and
15 min, Daly's estimate 116.7, 56.7 and 9.1, Young's 120.0, 60.0 and 12.2.

All times in seconds.
"""

from __future__ import annotations

import math

__all__ = ["young_interval", "daly_interval", "expected_wall_time", "optimal_interval"]


def _check(name: str, value: float, *, positive: bool = True) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints, √(2·δ·M) (s)."""
    _check("checkpoint_s", checkpoint_s)
    _check("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (s; module docstring)."""
    _check("checkpoint_s", checkpoint_s)
    _check("mtbf_s", mtbf_s)
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - checkpoint_s


def expected_wall_time(work_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                       mtbf_s: float) -> float:
    """Daly's expected wall time (s) of ``work_s`` seconds of computation checkpointed every ``interval_s``
    (module docstring)."""
    _check("work_s", work_s, positive=False)
    _check("interval_s", interval_s)
    _check("checkpoint_s", checkpoint_s, positive=False)
    _check("restart_s", restart_s, positive=False)
    _check("mtbf_s", mtbf_s)
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s) * work_s \
        / interval_s


def optimal_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The τ that minimises :func:`expected_wall_time` (s): the root in (0, M) of e^{(τ+δ)/M}·(1 − τ/M) = 1, found
    by bisection to a relative 1e-12 (the left side falls monotonically from e^{δ/M} ≥ 1 to 0 over (0, M))."""
    _check("checkpoint_s", checkpoint_s, positive=False)
    _check("mtbf_s", mtbf_s)
    low, high = 0.0, mtbf_s
    while high - low > 1e-12 * mtbf_s:
        middle = 0.5 * (low + high)
        if math.exp((middle + checkpoint_s) / mtbf_s) * (1.0 - middle / mtbf_s) > 1.0:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)
