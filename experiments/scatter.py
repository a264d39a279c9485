"""What the accuracy experiments share: the figure of predictions against measured (or published) values on log
axes, the line y = x and a ±10 % band, one colour per group of points (matplotlib imported when a figure is drawn),
and the statistics of their errors printed beside it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from sim.report.png import figure_png

__all__ = ["Series", "accuracy_scatter_png", "error_stats", "target_line"]

#: One group of points: ``(xs, ys, colour, legend label)``.
Series = tuple[Sequence[float], Sequence[float], str, str]


def accuracy_scatter_png(series: Sequence[Series], *, low: float, high: float, xlabel: str, ylabel: str, title: str,
                         size: float, alpha: float | None = None) -> bytes:
    """PNG bytes of ``series`` on log axes from ``low`` to ``high`` on both, with y = x and its ±10 % band; points of
    ``size`` (matplotlib's s) and ``alpha``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=120)
    line = [low, high]
    ax.fill_between(line, [v * 0.9 for v in line], [v * 1.1 for v in line], color="#dddddd", label="±10 %")
    ax.plot(line, line, color="#444444", linewidth=1, label="y = x")
    for xs, ys, color, label in series:
        ax.scatter(xs, ys, s=size, color=color, label=label, alpha=alpha)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return figure_png(fig)


def error_stats(errors: Sequence[float]) -> dict[str, float]:
    """``rows``, ``median_abs_error`` and ``max_abs_error`` of ``errors`` (absolute relative errors); NaN for none."""
    if not errors:
        return {"rows": 0, "median_abs_error": float("nan"), "max_abs_error": float("nan")}
    return {"rows": len(errors), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}


def target_line(label: str, stats: dict[str, float], median_target: float, max_target: float) -> str:
    """One line: ``label``'s median and max |error| (:func:`error_stats`) beside their targets (fractions), each
    ``met`` or ``missed by`` its distance in percentage points, so a report never prints a target without where it
    stands."""
    def verdict(value: float, target: float) -> str:
        return "met" if value <= target else f"missed by {100 * (value - target):.1f} points"

    median, worst = stats["median_abs_error"], stats["max_abs_error"]
    return (f"target {label}: median |error| <= {median_target:.0%} ({median:.1%}: "
            f"{verdict(median, median_target)}), max <= {max_target:.0%} ({worst:.1%}: {verdict(worst, max_target)})")
