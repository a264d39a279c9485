"""A matplotlib figure as PNG bytes that are the same for the same figure: every chart the project writes goes
through :func:`figure_png` (the search's Pareto chart, the experiments' plots)."""

from __future__ import annotations

import io
import threading
from typing import Any

__all__ = ["figure_png", "load_matplotlib_in_background"]


def load_matplotlib_in_background() -> threading.Thread:
    """Start importing matplotlib (with the Agg backend every chart here uses) in a daemon thread and return it.

    For a command that draws its chart only at the end of long work (``sim.search``): importing matplotlib takes
    0.3-1.5 s, which would otherwise stand between a Ctrl-C (or a spent time budget) and the answer. Python's import
    lock makes a later import in the main thread wait for this one instead of starting again. It stays lazy: nothing
    is loaded until a command asks.
    """
    def load() -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401 - the slow part: loaded now, used by figure_png later

    thread = threading.Thread(target=load, name="load-matplotlib", daemon=True)
    thread.start()
    return thread


def figure_png(fig: Any, dpi: float | None = None) -> bytes:
    """Render ``fig`` (a pyplot figure) to PNG and close it. matplotlib writes its version into a PNG's "Software"
    text chunk; it is left out, so the bytes depend on the figure alone."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None}, **({} if dpi is None else {"dpi": dpi}))
    plt.close(fig)
    return buffer.getvalue()
