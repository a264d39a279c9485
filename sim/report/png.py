"""A matplotlib figure as PNG bytes that are the same for the same figure: every chart the project writes goes
through :func:`figure_png` (the search's Pareto chart, the experiments' plots)."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["figure_png"]


def figure_png(fig: Any, dpi: float | None = None) -> bytes:
    """Render ``fig`` (a pyplot figure) to PNG and close it. matplotlib writes its version into a PNG's "Software"
    text chunk; it is left out, so the bytes depend on the figure alone."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None}, **({} if dpi is None else {"dpi": dpi}))
    plt.close(fig)
    return buffer.getvalue()
