"""A chart's title in lines that fit its figure, so that a long one (a 3D plan's model, topology and layout, a long
model spec) is never clipped: the Gantt chart's and the long run's (``sim.faults.chart``) wrap alike."""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["wrap_title"]


def wrap_title(title: str, fits: Callable[[str], bool], most_lines: int) -> list[str]:
    """``title`` in lines that each ``fits``, broken after its " · " separators, commas or spaces where possible, else
    inside a word; at most ``most_lines`` (the last then ends in "…"). Greedy: each line takes as much as fits."""
    pieces = re.findall(r".+?(?: · |,|\s|$)", title)  # each piece ends at a place to break
    lines: list[str] = []
    line = ""
    for piece in pieces:
        if len(lines) > most_lines:
            break  # enough to know it is cut short: measuring the rest would be wasted
        if fits((line + piece).rstrip()):
            line += piece
            continue
        if line:
            lines.append(line.rstrip())
        line = ""
        for char in piece:  # a piece too long for a line alone is broken inside it
            if line and not fits((line + char).rstrip()):
                lines.append(line.rstrip())
                line = ""
            line += char
    if line.strip() or not lines:
        lines.append(line.rstrip())
    if len(lines) > most_lines:
        last = lines[most_lines - 1]
        while last and not fits(last + "…"):
            last = last[:-1]
        lines = [*lines[:most_lines - 1], last + "…"]
    return lines
