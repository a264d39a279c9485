"""The search's strategies measured against each other: brute force, the planner's screen, the joint dynamic program,
annealing from it, the Alpa assumption, the bound's screen (its best layouts refined by a descent on the bound) and
the same with the differentiable relaxation's refinement, on a seeded suite of problems.

Each problem (:func:`suite`) is a GPT on a cluster of one to four device models (4 to 16 devices) at a global batch
of 32, searched over :data:`SPACE` (schedules 1f1b, zb1p and interleaved with 2 chunks, no recomputation, no
sequence parallelism, no ZeRO: a space brute force covers in seconds). Every strategy runs through
:func:`sim.search.search.run_search` with its own default budget, and every time reported is the simulator's
(the one prediction path). The listed space (``exhaustive``) holds at most 24 placements per layout with the
balanced partition for each; ``dp`` and ``anneal`` also cost the program's plans (explicit layer counts on any
placement), and ``screen`` and ``relaxed`` the plans their refinement adds, so they may find a plan faster than brute
force over the list.

Prints per problem and strategy: the best iteration time relative to brute force's, the plans costed and the wall
time; then per strategy how often it equals, beats or trails brute force, and by how much at worst. Writes
``search_strategies.csv``, all or none. ``--quick`` runs two small problems (CI).
"""

from __future__ import annotations

import csv
import io
import random
import time
from dataclasses import dataclass
from pathlib import Path

from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.search.search import run_search
from sim.search.space import SearchProblem, SearchSpace

__all__ = ["SPACE", "STRATEGIES", "Row", "Result", "suite", "run_problem", "parser", "run", "report", "write"]

SPACE = SearchSpace(schedules=("1f1b", "zb1p", "interleaved"), chunks=(2,), recompute=("none",), zero=(0,),
                    sequence_parallel=(False,))
#: Strategies compared, brute force first (the others are reported relative to it).
STRATEGIES = ("exhaustive", "planner", "dp", "anneal", "alpa", "screen", "relaxed")
CLUSTERS = ("4xV100+4xA100", "2xT4+2xV100+2xA100+2xH100", "8xV100+8xA100", "2x4xA100", "2xV100+2xA100",
            "1xT4+3xA100", "4xA100+4xH100")
QUICK_CLUSTERS = ("2xV100+2xA100", "1xT4+3xA100")


@dataclass(frozen=True)
class Row:
    """One strategy on one problem: its best simulated iteration time (s; ``None`` when nothing fits), plans
    costed, the listed space's size and the wall time (s)."""

    problem: SearchProblem
    strategy: str
    best_s: float | None
    costed: int
    space: int
    wall_s: float


def suite(count: int, seed: int, quick: bool = False) -> list[SearchProblem]:
    """``count`` seeded problems; the clusters in order, the model's depth and width drawn."""
    rng = random.Random(seed)
    clusters = QUICK_CLUSTERS if quick else CLUSTERS
    problems = []
    for index in range(count):
        layers = rng.choice([6, 8]) if quick else rng.choice([12, 16, 24])
        hidden = 512 if quick else rng.choice([512, 1024])
        problems.append(SearchProblem(f"gpt:layers={layers},hidden={hidden},heads=8,seq=512,vocab=8000",
                                      clusters[index % len(clusters)], 32, space=SPACE))
    return problems


def run_problem(problem: SearchProblem, workers: int, seed: int) -> list[Row]:
    """Every strategy of :data:`STRATEGIES` on ``problem``."""
    rows = []
    for strategy in STRATEGIES:
        start = time.monotonic()
        result = run_search(problem, strategy=strategy, workers=workers, seed=seed)
        best = result.best
        rows.append(Row(problem, strategy, None if best is None else best.iteration_time_s, len(result.evaluations),
                        result.space_size, time.monotonic() - start))
    return rows


def _relative(row: Row, brute: Row) -> float | None:
    if row.best_s is None or brute.best_s is None:
        return None
    return row.best_s / brute.best_s - 1.0


def _table(done: list[list[Row]]) -> list[str]:
    lines = [f"{'cluster':<28} {'model':<28} " + "  ".join(f"{name:>22}" for name in STRATEGIES)]
    for rows in done:
        brute = rows[0]
        cells = []
        for row in rows:
            relative = _relative(row, brute)
            shown = ("none fits" if row.best_s is None else f"{row.best_s:.4f} s" if row is brute
                     else f"{relative:+.2%}" if relative is not None else "-")
            cells.append(f"{shown} {row.costed}/{row.space} {row.wall_s:.0f}s")
        model = brute.problem.model.split(",heads")[0]
        lines.append(f"{brute.problem.topology:<28} {model:<28} " + "  ".join(f"{c:>22}" for c in cells))
    return lines


def _summary(done: list[list[Row]]) -> list[str]:
    lines = []
    for index, strategy in enumerate(STRATEGIES[1:], start=1):
        relatives = [_relative(rows[index], rows[0]) for rows in done]
        known = [r for r in relatives if r is not None]
        faster = sum(r < -1e-12 for r in known)
        equal = sum(abs(r) <= 1e-12 for r in known)
        slower = [r for r in known if r > 1e-12]
        share = sum(rows[index].costed for rows in done) / max(sum(rows[0].costed for rows in done), 1)
        worst = f", worst {max(slower):+.2%}" if slower else ""
        lines.append(f"{strategy:<10} faster than brute force on {faster}, equal on {equal}, slower on "
                     f"{len(slower)}{worst}; {share:.0%} of brute force's plans costed")
    return lines


def _csv(done: list[list[Row]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["topology", "model", "strategy", "best_s", "relative_to_exhaustive", "costed", "space",
                     "wall_s"])
    for rows in done:
        for row in rows:
            relative = _relative(row, rows[0])
            writer.writerow([row.problem.topology, row.problem.model, row.strategy,
                             "" if row.best_s is None else repr(row.best_s),
                             "" if relative is None else f"{relative:.6f}", row.costed, row.space, f"{row.wall_s:.2f}"])
    return buffer.getvalue()


@dataclass(frozen=True)
class Result:
    """Per problem of the suite (``seed``, ``quick``), one row per strategy in :data:`STRATEGIES`' order."""

    seed: int
    quick: bool
    problems: tuple[tuple[Row, ...], ...]


def parser() -> CliParser:
    """``python -m experiments.run search_strategies [--quick] [--problems N] [--seed S] [--workers N] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run search_strategies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/search_strategies",
                        help="output directory (default runs/search_strategies)")
    parser.add_argument("--quick", action="store_true", help="two small problems (CI)")
    parser.add_argument("--problems", type=int, default=7, metavar="N", help="problems in the suite (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the suite and of every strategy")
    parser.add_argument("--workers", type=int, default=2, help="evaluation processes (default 2)")
    return parser


def run(*, quick: bool = False, problems: int = 7, seed: int = 0, workers: int = 2) -> Result:
    """Every strategy on ``problems`` seeded problems (``quick``: two small ones) with ``workers`` processes.

    Raises:
        SpecError: a count, seed or worker count out of range (named by its flag).
    """
    count = 2 if quick else problems
    if not 1 <= count <= 50:
        raise SpecError(f"--problems must be from 1 to 50, got {problems}")
    if seed < 0:
        raise SpecError(f"--seed must be >= 0, got {seed}")
    if not 1 <= workers <= 64:
        raise SpecError(f"--workers must be from 1 to 64, got {workers}")
    return Result(seed, quick, tuple(tuple(run_problem(problem, workers, seed))
                                     for problem in suite(count, seed, quick)))


def report(result: Result) -> str:
    """The table of problems by strategy, then each strategy against brute force."""
    done = [list(rows) for rows in result.problems]
    return "\n".join([f"{len(done)} problems (seed {result.seed}{', --quick' if result.quick else ''}); best simulated "
                      f"iteration time relative to brute force over the listed space, plans costed / listed, wall "
                      f"time", *_table(done), "", *_summary(done)])


def write(result: Result, out: Path) -> list[Path]:
    """``search_strategies.csv`` (one row per problem and strategy) in ``out``."""
    write_text_atomic(_csv([list(rows) for rows in result.problems]), out / "search_strategies.csv")
    return [out / "search_strategies.csv"]
