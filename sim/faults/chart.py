"""The chart of a long run with failures (``long_run.png``): the iterations trained over wall time, each failure
throwing work away and the restart after it, beside the same run without failures.

The seeded run's progress (``sim.faults.long_run.simulate_long_run``'s trail) is a rising line that drops at each
failure to its last durable checkpoint and stays flat while the job restarts; the failure-free run (iterations at the
simulated iteration time, checkpoint stalls included) is the dashed line it would have followed. Each failure is
marked and coloured by the category of its cause. Below, how far behind the failure-free run the seeded one is, in
hours: the time failures have cost so far. matplotlib is imported when the chart is drawn.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from sim.faults.failure_mix import FailureMix
from sim.faults.long_run import Failure, LongRun
from sim.report.png import figure_png
from sim.report.titles import wrap_title

__all__ = ["long_run_png"]

#: One colour per cause category, in the order categories first appear in the mix.
_PALETTE = ("#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

_TITLE_PT = 9.0  # the title's font size, points
_TITLE_LINES = 4  # at most this many title lines (the last ends in "…" if more were needed)
# The share of the figure's width a title line may take: the title is centred on the axes, which the y label shifts
# right of the figure's centre by a few per cent.
_TITLE_ROOM = 0.9


def long_run_png(run: LongRun, trail: Sequence[tuple[float, float]], failures: Sequence[Failure], mix: FailureMix,
                 *, title: str, failure_free_s: float) -> bytes:
    """The chart as PNG bytes (the same bytes for the same inputs).

    Args:
        run: the long run.
        trail: ``(time in s, iterations computed)`` points of the seeded run.
        failures: its failures.
        mix: the causes the failures index.
        title: the chart's title.
        failure_free_s: the run's wall time without failures (s): its iterations and checkpoint stalls.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties

    categories = list(dict.fromkeys(cause.category for cause in mix.causes))
    colour = {category: _PALETTE[i % len(_PALETTE)] for i, category in enumerate(categories)}
    fig, (ax, behind) = plt.subplots(2, 1, figsize=(9.0, 6.0), dpi=110, sharex=True,
                                     gridspec_kw={"height_ratios": (2, 1)})
    hours = [t / 3600 for t, _ in trail]
    ax.plot([0.0, failure_free_s / 3600], [0.0, run.iterations], linestyle="--", color="#999999", linewidth=1.0,
            label="without failures")
    ax.plot(hours, [done for _, done in trail], color="#1f77b4", linewidth=1.2, label="this run (seeded)")
    shown: set[str] = set()
    highest: dict[float, float] = {}  # at a failure's time: the work computed when it struck
    for t, done in trail:
        highest[t] = max(highest.get(t, 0.0), done)
    times = [t for t, _ in trail]
    for failure in failures:
        category = mix.causes[failure.cause].category
        # A failure during a restart has no point of its own: the work then is the level before it.
        at = highest.get(failure.time_s)
        if at is None:
            at = trail[max(0, bisect.bisect_right(times, failure.time_s) - 1)][1]
        ax.plot([failure.time_s / 3600], [at], marker="v", color=colour[category], markersize=6, linestyle="none",
                label=None if category in shown else f"failure: {category}")
        shown.add(category)
    # How far behind the failure-free run it is: the wall time so far less the time that run needed for the same
    # work (failure-free time being proportional to the work).
    pace = failure_free_s / run.iterations
    behind.plot(hours, [(t - done * pace) / 3600 for t, done in trail], color="#d62728", linewidth=1.0)
    behind.set_ylabel("time lost (h)")
    behind.set_xlabel("wall time (h)")
    behind.set_ylim(bottom=0.0)
    behind.grid(True, linewidth=0.3, alpha=0.5)
    ax.set_ylabel("iterations trained")
    ax.set_xlim(left=0.0)
    ax.set_ylim(bottom=0.0)
    # Wrapped as the Gantt chart's title is (matplotlib's own wrap=True wraps to the figure before tight_layout has
    # placed the axes, and left the title clipped); plain text, so a '$' in a model's name is no formula.
    renderer = fig.canvas.get_renderer()
    font = FontProperties(size=_TITLE_PT)
    room = _TITLE_ROOM * fig.get_figwidth() * fig.dpi
    lines = wrap_title(title, lambda text: renderer.get_text_width_height_descent(text, font, ismath=False)[0] <= room,
                       _TITLE_LINES)
    ax.set_title("\n".join(lines), fontsize=_TITLE_PT, parse_math=False)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    return figure_png(fig)
