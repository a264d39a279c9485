"""``python -m experiments.run results``: every experiment run again, its printed tables and its figures gathered into
one page, ``docs/results.md``, so that every claim and its figure can be read and regenerated in one place.

Each registered experiment (the registry ``experiments.run`` passes in, this one aside) runs as the command runs
it, ``python -m experiments.run NAME --out RUNS/NAME``, through the same functions (:func:`experiments.harness.execute`:
its ``run``, ``report`` and ``write``), in this process, one after the other (they share the 2 cores, and the real
runs among them measure time). The page gets, per experiment in the registry's order: its one-line description, the
command, its report and ``wrote`` line (what the command prints: its tables, its verdicts beside the published
numbers) and its PNGs, copied next to the page under ``<page dir>/results/``; and a link to its hand-written page
under ``docs/experiments/`` where one exists. An experiment that fails leaves none of its files and is on the page as
failed, with its error, and the command exits with status 1 after writing the page, so a page with a failure is never
taken for a complete one.

``--only a,b`` runs some; ``--quick`` runs those that have it quick (the others in full), for a fast look or a
test. The experiments of :data:`ALWAYS_QUICK` run in their ``--quick`` form here either way: their full
run takes the better part of an hour, and its table is on their own page. The page holds no time or date: what it
shows is the experiments' output, and two runs differ only where an experiment measures real time.
"""

from __future__ import annotations

import inspect
import os
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from experiments import harness
from sim.core.cli import CliParser
from sim.core.errors import OutputError, SpecError
from sim.core.fileio import prepare_output_dir, write_bytes_atomic, write_text_atomic
from sim.core.output_set import all_or_none

__all__ = ["Outcome", "run_experiment", "render", "main", "ALWAYS_QUICK"]

NAME = "results"
#: Experiments run with ``--quick`` on the page even without ``--quick`` (their full table: their own page).
ALWAYS_QUICK = frozenset({"second_opinion"})
#: Lines of a failed experiment's traceback kept on the page.
STDERR_TAIL = 12


@dataclass(frozen=True)
class Outcome:
    """One experiment's run: its name, description, the command, what the command prints (its report and ``wrote``
    line), its PNGs (paths relative to the page) and, when it failed, the exit status the command would have (2 for
    bad input or an unwritable file, 1 otherwise) and its error (the end of the traceback of an unexpected one)."""

    name: str
    description: str
    command: str
    stdout: str
    figures: tuple[str, ...]
    status: int
    stderr_tail: str


def _has_quick(module: ModuleType) -> bool:
    """Whether the experiment's ``run`` takes ``quick`` (its command has ``--quick``)."""
    return "quick" in inspect.signature(module.run).parameters


def run_experiment(name: str, description: str, writes_files: bool, runs: Path, figures_dir: Path, page_dir: Path,
                   quick: bool) -> Outcome:
    """Run ``name`` (into ``runs/name`` when it ``writes_files``; quick when ``quick`` or in :data:`ALWAYS_QUICK`)
    by :func:`experiments.harness.execute` and copy its PNGs to ``figures_dir/name``; a failure leaves none of its
    files."""
    module = harness.load(name)
    quick = quick or name in ALWAYS_QUICK
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    args = [*(["--out", str(out)] if writes_files else []), *(["--quick"] if quick and _has_quick(module) else [])]
    printed: list[str] = []
    status, tail = 0, ""
    try:
        with all_or_none():
            if writes_files:  # as experiments.run does: checked, made, and removed again if the experiment fails
                prepare_output_dir(out, "--out")
            harness.execute(module, args, printed.append)
    except (SpecError, OutputError) as exc:  # what the command prints as one error line, status 2
        status, tail = 2, f"error: {exc}"
    except Exception:  # noqa: BLE001 - the page says how it failed, the next experiment runs
        status, tail = 1, "\n".join(traceback.format_exc().strip().splitlines()[-STDERR_TAIL:])
    figures = []
    if status == 0:
        target = figures_dir / name
        shutil.rmtree(target, ignore_errors=True)
        for png in sorted(out.rglob("*.png")) if writes_files else ():
            copy = target / png.relative_to(out)
            copy.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(copy, png.read_bytes())
            figures.append(copy.relative_to(page_dir).as_posix())
    command = "python -m experiments.run " + " ".join([name, *(a for a in args if a not in ("--out", str(out)))])
    stdout = "".join(f"{block}\n" for block in printed)
    return Outcome(name, description, command, stdout, tuple(figures), status, tail)


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
            lines += [f"**Failed** (exit status {o.status}); its error:", "", f"```\n{o.stderr_tail}\n```"]
            continue
        lines += ["```", o.stdout.rstrip(), "```"]
        lines += [f"\n![{o.name}]({figure})" for figure in o.figures]
    return "\n".join(lines) + "\n"


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path, start)


def parser() -> CliParser:
    """The command line of ``experiments.run results``."""
    found = CliParser(prog="python -m experiments.run results", description=__doc__.split("\n\n")[0])
    found.add_argument("--out", default="runs/results", help="where the experiments write (default runs/results)")
    found.add_argument("--page", default="docs/results.md", help="the page to write (default docs/results.md)")
    found.add_argument("--only", help="comma-separated experiment names (default: all)")
    found.add_argument("--quick", action="store_true", help="pass --quick to the experiments that take it")
    return found


def main(argv: list[str], registry: dict[str, tuple[str, bool]]) -> int:
    """The command; ``registry``: every experiment's name, description and whether it writes files (takes ``--out``),
    in the registry's order (``experiments.run`` passes its own, so this module does not import the command)."""
    args = parser().parse_args(argv)
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
