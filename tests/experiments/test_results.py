"""``experiments.run results``: the page holds each chosen experiment's printed output unchanged, its figures copied
beside the page, a link to its own page; a failure is on the page and makes the command exit 1; bad input is one
error line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.results import Outcome, render
from tests.experiments.refusal import refused

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_gathers_two_quick_experiments(tmp_path):
    page = tmp_path / "site" / "results.md"
    result = subprocess.run([sys.executable, "-m", "experiments.run", "results", "--only", "zero_bubble,memory",
                             "--quick", "--out", str(tmp_path / "runs"), "--page", str(page)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    # Registry order, each with its command and exactly what it prints on its own.
    assert text.index("## memory") < text.index("## zero_bubble")
    assert "python -m experiments.run zero_bubble --quick" in text
    alone = subprocess.run([sys.executable, "-m", "experiments.run", "zero_bubble", "--quick", "--out",
                            str(tmp_path / "alone")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    printed = alone.stdout.rstrip().replace(str(tmp_path / "alone"), str(tmp_path / "runs" / "zero_bubble"))
    assert printed in text
    figure = page.parent / "results" / "zero_bubble" / "zero_bubble.png"
    assert figure.read_bytes() == (tmp_path / "runs" / "zero_bubble" / "zero_bubble.png").read_bytes()
    assert "(results/zero_bubble/zero_bubble.png)" in text


def test_an_experiment_that_writes_no_files_runs_without_out(tmp_path):
    # csp_prefetch prints its table and writes nothing: it takes no --out (about 10 s).
    from experiments.results import run_experiment

    outcome = run_experiment("csp_prefetch", "predictor vs copy-on-demand", False, tmp_path / "runs",
                             tmp_path / "results", tmp_path, quick=True)
    assert outcome.status == 0, outcome.stderr_tail
    assert outcome.command == "python -m experiments.run csp_prefetch" and outcome.figures == ()
    assert outcome.stdout.strip() and not (tmp_path / "runs").exists()


def test_an_always_quick_experiment_runs_quick_on_the_full_page(tmp_path, monkeypatch):
    from experiments import results

    calls = []

    def fake(argv, **kwargs):
        calls.append(argv[3:])
        helped = "usage: ... [--quick]" if "--help" in argv else ""
        return subprocess.CompletedProcess(argv, 0, stdout=helped, stderr="")

    monkeypatch.setattr(results.subprocess, "run", fake)
    outcome = results.run_experiment("second_opinion", "a second opinion", True, tmp_path / "runs",
                                     tmp_path / "results", tmp_path, quick=False)
    assert outcome.command == "python -m experiments.run second_opinion --quick"
    assert calls[-1] == ["second_opinion", "--out", str(tmp_path / "runs" / "second_opinion"), "--quick"]


def test_a_failed_experiment_is_on_the_page_as_failed(tmp_path):
    ok = Outcome("memory", "peak memory", "python -m experiments.run memory", "table\n", ("results/m.png",), 0, "")
    bad = Outcome("naspipe", "csp", "python -m experiments.run naspipe", "", (), 2, "error: something")
    text = render([ok, bad], tmp_path, tmp_path / "pages")
    assert "**Failed in this run: naspipe**" in text and "- [naspipe](#naspipe) (failed)" in text
    assert "**Failed** (exit status 2)" in text and "error: something" in text
    assert "![memory](results/m.png)" in text and "table" in text


@pytest.mark.parametrize("args, needle", [(["--only", "nope"], "--only: unknown 'nope'"),
                                          (["--page", "x.txt"], "--page must name a .md file")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["results", "--out", str(tmp_path / "o"), *args])
