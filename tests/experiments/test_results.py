"""``experiments.run results``: the page holds each chosen experiment's report unchanged, its figures copied beside the
page, a link to its own page; a failure leaves none of its files, is on the page and makes the command exit 1; bad
input is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import results, zero_bubble
from experiments.results import Outcome, render, run_experiment
from experiments.run import EXPERIMENTS
from sim.core.errors import SpecError

REGISTRY = {name: (entry.description, entry.out is not None) for name, entry in EXPERIMENTS.items()}


def test_the_page_gathers_two_quick_experiments(tmp_path):
    page = tmp_path / "site" / "results.md"
    runs = tmp_path / "runs"
    assert results.main(["--only", "zero_bubble,memory", "--quick", "--out", str(runs), "--page", str(page)],
                        REGISTRY) == 0
    text = page.read_text()
    # Registry order, each with its command and exactly its report and the files it wrote.
    assert text.index("## memory") < text.index("## zero_bubble")
    assert "python -m experiments.run zero_bubble --quick" in text
    assert zero_bubble.report(zero_bubble.run(quick=True)) in text
    assert f"wrote {runs / 'zero_bubble'}/{{zero_bubble.csv, zero_bubble.png}}" in text
    figure = page.parent / "results" / "zero_bubble" / "zero_bubble.png"
    assert figure.read_bytes() == (runs / "zero_bubble" / "zero_bubble.png").read_bytes()
    assert "(results/zero_bubble/zero_bubble.png)" in text


def test_an_experiment_that_writes_no_files_runs_without_out(tmp_path, monkeypatch):
    # csp_prefetch prints its table and writes nothing: it takes no --out (its problem count cut for the test)
    from experiments import csp_prefetch

    real = csp_prefetch.run
    monkeypatch.setattr(csp_prefetch, "run", lambda **kw: real(**{**kw, "problems": 50}))
    outcome = run_experiment("csp_prefetch", "predictor vs copy-on-demand", False, tmp_path / "runs",
                             tmp_path / "results", tmp_path, quick=True)
    assert outcome.status == 0, outcome.stderr_tail
    assert outcome.command == "python -m experiments.run csp_prefetch" and outcome.figures == ()
    assert outcome.stdout == csp_prefetch.report(real(problems=50)) + "\n" and not (tmp_path / "runs").exists()


def test_an_always_quick_experiment_runs_quick_on_the_full_page(tmp_path, monkeypatch):
    from experiments import second_opinion

    calls = []

    def stop(*, quick: bool = False, **options):  # the search itself is second_opinion's own test
        calls.append(quick)
        raise SpecError("stopped here")

    monkeypatch.setattr(second_opinion, "run", stop)
    outcome = results.run_experiment("second_opinion", "a second opinion", True, tmp_path / "runs",
                                     tmp_path / "results", tmp_path, quick=False)
    assert outcome.command == "python -m experiments.run second_opinion --quick"
    assert calls == [True]
    assert (outcome.status, outcome.stderr_tail) == (2, "error: stopped here")


def test_a_failed_experiment_leaves_none_of_its_files(tmp_path, monkeypatch):
    def failing(result, out: Path):
        zero_bubble_write(result, out)
        raise RuntimeError("the disk went away")

    zero_bubble_write = zero_bubble.write
    monkeypatch.setattr(zero_bubble, "write", failing)
    outcome = run_experiment("zero_bubble", "zb", True, tmp_path / "runs", tmp_path / "results", tmp_path, quick=True)
    assert outcome.status == 1 and "RuntimeError: the disk went away" in outcome.stderr_tail
    assert not (tmp_path / "runs" / "zero_bubble").exists() and outcome.figures == ()


def test_a_failed_experiment_is_on_the_page_as_failed(tmp_path):
    ok = Outcome("memory", "peak memory", "python -m experiments.run memory", "table\n", ("results/m.png",), 0, "")
    bad = Outcome("naspipe", "csp", "python -m experiments.run naspipe", "", (), 2, "error: something")
    text = render([ok, bad], tmp_path, tmp_path / "pages")
    assert "**Failed in this run: naspipe**" in text and "- [naspipe](#naspipe) (failed)" in text
    assert "**Failed** (exit status 2)" in text and "error: something" in text
    assert "![memory](results/m.png)" in text and "table" in text


@pytest.mark.parametrize("args, needle", [(["--only", "nope"], "--only: unknown 'nope'"),
                                          (["--page", "x.txt"], "--page must name a .md file")])
def test_bad_input_is_refused(tmp_path, args, needle):
    with pytest.raises(SpecError, match=needle):
        results.main(["--out", str(tmp_path / "o"), *args], REGISTRY)
