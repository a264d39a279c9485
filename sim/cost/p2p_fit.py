"""The α-β fit of point-to-point message times: ``time = latency + bytes / bandwidth`` (Hockney 1994).

Measured sweeps come from ``profiles.p2p`` (a profiler's ping-pong between two processes) and from an executor run's
own process group (``executor.run --calibrate-out``); both are fitted here, so a profile's ``p2p`` figures mean the
same thing whoever wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sim.core.errors import SpecError

__all__ = ["fit_latency_bandwidth"]


def fit_latency_bandwidth(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Fit ``time = latency + bytes / bandwidth`` to measured points by least squares on relative residuals.

    Each residual is divided by its measured time. Plain least squares would let the largest messages (ms each)
    decide the intercept, whose true value (µs) is then lost in their noise; relative residuals weigh a 1 KiB and a
    16 MiB message alike, which is also how their noise behaves (roughly proportional to the time). Exact data is
    fitted exactly by either. The latency is constrained to be >= 0: if the unconstrained intercept comes out
    negative (noise on a link whose latency is near zero), the constrained optimum lies on latency = 0, i.e. the
    best line through the origin, which is what is returned.

    Args:
        sizes_bytes: message sizes in bytes, >= 0, at least two distinct.
        times_s: the measured one-way time of each size in s, > 0.

    Returns:
        ``(latency_s, bandwidth_bytes_per_s)``: α in s (>= 0) and β in bytes/s (> 0).

    Raises:
        SpecError (a ValueError): lengths differ, a value is not finite, a size is negative or a time not
            positive, fewer than two distinct sizes, or a fitted slope that is not positive (time does not grow
            with size, so there is no bandwidth to report).
    """
    x = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if x.ndim != 1 or x.shape != t.shape:
        raise SpecError(f"need one time per size, got {x.size} sizes and {t.size} times")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise SpecError("sizes and times must be finite numbers")
    if np.any(x < 0) or np.any(t <= 0):
        raise SpecError(f"sizes must be >= 0 bytes and times > 0 s, got sizes {x.tolist()} and times {t.tolist()}")
    if np.unique(x).size < 2:
        raise SpecError(f"need at least two distinct message sizes to fit latency and bandwidth, got {x.tolist()}")
    w = 1.0 / t  # relative residuals: (alpha + x * slope - t) / t
    design = np.column_stack([w, x * w])
    (alpha, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:
        # Weighted fit through the origin: minimise sum ((x * slope - t) / t)^2 over slope alone.
        alpha = 0.0
        slope = float(np.sum(x * w) / np.sum((x * w) ** 2))
    # Exactly flat data can fit a slope of +1e-22 by rounding alone: a rise over the whole size range below 1e-9 of
    # the largest time counts as no rise at all.
    if not slope * (x.max() - x.min()) > 1e-9 * t.max():
        raise SpecError(f"fitted time per byte is {slope:.3g} s, not positive: the times do not grow with the "
                        f"message size, so no bandwidth can be fitted (sizes {x.tolist()}, times {t.tolist()})")
    return float(alpha), float(1.0 / slope)
