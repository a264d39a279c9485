"""The Python API guide is a notebook in Markdown: its Python cells run here, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "python-api.md"


def python_cells(text: str) -> list[str]:
    """The page's ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_page_runs_as_a_notebook_and_its_results_agree(tmp_path, monkeypatch, capsys):
    cells = python_cells(PAGE.read_text())
    assert len(cells) >= 3, "the page lost its cells"
    monkeypatch.chdir(tmp_path)  # the page writes runs/notebook
    namespace: dict = {}
    for number, cell in enumerate(cells, 1):
        exec(compile(cell, f"{PAGE.name}, cell {number}", "exec"), namespace)
    printed = capsys.readouterr().out
    run, found, best = namespace["run"], namespace["found"], namespace["best"]
    # What the page prints is what the objects hold, and the files are the ones it names.
    assert f"{run.iteration_time_s * 1e3:.1f} ms per iteration" in printed
    assert sorted(p.name for p in (tmp_path / "runs" / "notebook").iterdir()) == sorted(namespace["files"])
    # The pick simulated again is the search's own figure (one prediction path).
    assert best.iteration_time_s == found.rows()[0]["iteration_time_s"]
    assert namespace["figure"].axes[0].title.get_text().startswith("1F1B")
