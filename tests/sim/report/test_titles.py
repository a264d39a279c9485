"""``sim.report.titles.wrap_title``, the one wrapper of chart titles (the Gantt chart's and ``long_run.png``'s): a
title that fits stays one line, a longer one breaks at its separators, each line fits and no character is lost."""

import re

import pytest

from sim.report.titles import wrap_title


@pytest.mark.parametrize("length", [40, 400])
def test_every_line_fits_and_no_character_is_lost(length):
    title = ("1f1b · llama:layers=80,hidden=8192,heads=64 · 128x8xH100 · TP8×DP32×PP4 · m=16 · " * 10)[:length]
    lines = wrap_title(title, lambda text: len(text) <= 100, 10)
    assert all(len(line) <= 100 for line in lines) and (len(lines) == 1) == (length <= 100)
    assert re.sub(r"\s", "", "".join(lines)) == re.sub(r"\s", "", title)
