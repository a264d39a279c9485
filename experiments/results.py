"""``python -m experiments.run results``: every experiment run again, its printed tables and its figures gathered into
one page, ``docs/results.md``, so that every claim and its figure can be read and regenerated in one place.

Each registered experiment (the registry ``experiments.run`` passes in, this one aside) runs as a user runs it,
``python -m experiments.run NAME --out RUNS/NAME`` in a fresh process, one after the other (they share the 2 cores,
and the real runs among them measure time). The page gets, per experiment in the registry's order: its one-line
description, the command, everything it printed (its tables, its verdicts beside the published numbers) and its
PNGs, copied next to the page under ``<page dir>/results/``; and a link to its hand-written page under
``docs/experiments/`` where one exists. An experiment that fails is on the page as failed, with the last lines it
wrote to stderr, and the command exits with status 1 after writing the page, so a page with a failure is never
taken for a complete one.

``--only a,b`` runs some; ``--quick`` passes ``--quick`` to those that have it (the others run in full), for a fast
look or a test. The experiments of :data:`ALWAYS_QUICK` run in their ``--quick`` form here either way: their full
run takes the better part of an hour, and its table is on their own page. The page holds no time or date: what it
shows is the experiments' output, and two runs differ only where an experiment measures real time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_bytes_atomic, write_text_atomic

__all__ = ["Outcome", "run_experiment", "render", "main", "ALWAYS_QUICK"]

NAME = "results"
#: Experiments run with ``--quick`` on the page even without ``--quick`` (their full table: their own page).
ALWAYS_QUICK = frozenset({"second_opinion"})
#: Lines of a failed experiment's stderr kept on the page.
STDERR_TAIL = 12


@dataclass(frozen=True)
class Outcome:
    """One experiment's run: its name, description, the command, what it printed, its PNGs (paths relative to the
    page) and, when it failed, its exit status and the tail of its stderr."""

    name: str
    description: str
    command: str
    stdout: str
    figures: tuple[str, ...]
    status: int
    stderr_tail: str


def _has_quick(name: str) -> bool:
    """Whether experiment ``name`` takes ``--quick`` (its ``--help`` says so)."""
    helped = subprocess.run([sys.executable, "-m", "experiments.run", name, "--help"], capture_output=True, text=True)
    return "--quick" in helped.stdout


def run_experiment(name: str, description: str, writes_files: bool, runs: Path, figures_dir: Path, page_dir: Path,
                   quick: bool) -> Outcome:
    """Run ``name`` (into ``runs/name`` when it ``writes_files``; with ``--quick`` when ``quick`` or in
    :data:`ALWAYS_QUICK`) and copy its PNGs to ``figures_dir/name``."""
    quick = quick or name in ALWAYS_QUICK
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    args = [name, *(["--out", str(out)] if writes_files else []), *(["--quick"] if quick and _has_quick(name) else [])]
    result = subprocess.run([sys.executable, "-m", "experiments.run", *args], capture_output=True, text=True)
    figures = []
    if result.returncode == 0:
        target = figures_dir / name
        shutil.rmtree(target, ignore_errors=True)
        for png in sorted(out.rglob("*.png")) if writes_files else ():
            copy = target / png.relative_to(out)
            copy.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(copy, png.read_bytes())
            figures.append(copy.relative_to(page_dir).as_posix())
    tail = "\n".join(result.stderr.strip().splitlines()[-STDERR_TAIL:]) if result.returncode else ""
    command = "python -m experiments.run " + " ".join(a for a in args if a not in ("--out", str(out)))
    return Outcome(name, description, command, result.stdout, tuple(figures), result.returncode, tail)


def render(outcomes: list[Outcome], page_dir: Path, pages: Path) -> str:
    """The Markdown page: a table of contents, then one section per experiment."""
    lines = ["# Results: every experiment, regenerated", "",
             "Written by `python -m experiments.run results` (`experiments/results.py`): each experiment below was "
             "run again as shown and its printed output and figures copied here unchanged. The published numbers "
             "each is compared with, and the reasons for differences, are in its output and on its own page.", ""]
    failed = [o.name for o in outcomes if o.status]
    if failed:
        lines += [f"**Failed in this run: {', '.join(failed)}** (their sections say how).", ""]
    lines += [f"- [{o.name}](#{o.name}){' (failed)' if o.status else ''}: {o.description}" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.name}", "", o.description, "", f"```\n{o.command}\n```", ""]
        own = pages / f"{o.name}.md"
        if own.exists():
            lines += [f"Its page: [{own.name}]({Path(_relative(own, page_dir)).as_posix()}).", ""]
        if o.status:
            lines += [f"**Failed** (exit status {o.status}); the end of its stderr:", "", f"```\n{o.stderr_tail}\n```"]
            continue
        lines += ["```", o.stdout.rstrip(), "```"]
        lines += [f"\n![{o.name}]({figure})" for figure in o.figures]
    return "\n".join(lines) + "\n"


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path, start)


def main(argv: list[str], registry: dict[str, tuple[str, bool]]) -> int:
    """The command; ``registry``: every experiment's name, description and whether it writes files (takes ``--out``),
    in the registry's order (``experiments.run`` passes its own, so this module does not import the command)."""
    parser = CliParser(prog="python -m experiments.run results", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/results", help="where the experiments write (default runs/results)")
    parser.add_argument("--page", default="docs/results.md", help="the page to write (default docs/results.md)")
    parser.add_argument("--only", help="comma-separated experiment names (default: all)")
    parser.add_argument("--quick", action="store_true", help="pass --quick to the experiments that take it")
    args = parser.parse_args(argv)
    names = [n for n in registry if n != NAME]
    if args.only is not None:
        wanted = [n for n in args.only.split(",") if n]
        unknown = [n for n in wanted if n not in names]
        if unknown or not wanted:
            raise SpecError(f"--only: unknown {', '.join(map(repr, unknown)) or 'empty list'} (known: "
                            f"{', '.join(names)})")
        names = [n for n in names if n in wanted]
    page = Path(args.page)
    if page.suffix != ".md":
        raise SpecError(f"--page must name a .md file, got {args.page!r}")
    page_dir = page.parent
    outcomes = []
    for name in names:
        print(f"running {name} ...", flush=True)
        outcome = run_experiment(name, *registry[name], Path(args.out), page_dir / "results", page_dir,
                                 args.quick)
        outcomes.append(outcome)
        print(f"  {'ok' if outcome.status == 0 else f'FAILED (status {outcome.status})'}", flush=True)
    page_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(render(outcomes, page_dir, Path("docs/experiments")), page)
    failed = [o.name for o in outcomes if o.status]
    note = "; failed: " + ", ".join(failed) if failed else ""
    print(f"wrote {page} ({len(outcomes)} experiments{note})")
    return 1 if failed else 0
