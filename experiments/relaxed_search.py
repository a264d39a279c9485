"""The differentiable relaxation against the exact dynamic program, annealing and brute force.

On a seeded suite of problems (:func:`suite`: half on one device model, half on two; 4 to 16 devices; 8 to 48 model
layers, embedding and head included; a GPT of hidden size 1024 or 2048) each problem fixes a layout (TP, DP, PP,
microbatch size, schedule among gpipe, 1f1b and zb1p), and each method picks the layer count of every stage and, on
two device models, which device block serves each stage. Every plan is costed by the one prediction path
(:func:`sim.search.evaluate.evaluate`, the simulator) on simulated iteration time; memory is reported, not used:

* **relaxed**: :func:`sim.search.relaxed.relaxation.relax` with its default config (counts rounded by largest
  remainder);
* **relaxed+cuts**: the same descent, stage boundaries rounded by the surrogate (``rounding="cuts"``);
* **DP**: ``--partition balanced``, the exact dynamic program for the slowest stage (PipeDream's objective) in the
  layout's own device order;
* **DP, placements**: the DP in each placement :func:`sim.search.placement.stage_placements` lists (at most 24), the
  fastest (the DP alone on a cluster of one device model);
* **anneal**: :func:`sim.search.search.run_search` ``strategy="anneal"`` over the search's own space for the layout
  (partition balanced or uniform, every listed placement: at most 48 plans, so its default budget of 50 evaluations
  costs all of it and it is the best of those plans);
* **brute force**: every composition of the layers into the stages, in every distinct placement of the device kinds,
  when there are at most ``--brute-limit`` of them, costed by the search's fast evaluator
  (:class:`sim.bench.fast.FastEvaluator`; exact, or a lower bound that the engine re-costs whenever it could win),
  the best re-costed by ``evaluate``.

Prints a table (time per method, relative to the best any method found) and a summary of how often the relaxation
matches or beats each other method and by how much it loses; writes ``relaxed_search.csv`` (a row per problem and
method, with its wall time and simulations) and ``relaxed_search.png``, all or none. ``--quick``: two small problems
(CI), the relaxation with two restarts.
"""

from __future__ import annotations

import csv
import io
import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

from experiments.harness import write_csv_png
from sim.bench.fast import EXACT, FastEvaluator
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.plan.layout import plan_layout
from sim.report.png import figure_png
from sim.search.evaluate import Evaluation, evaluate
from sim.search.placement import stage_placements
from sim.search.relaxed.relaxation import RelaxedConfig, relax
from sim.search.relaxed.surrogate import layout_blocks
from sim.search.search import run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace

__all__ = ["Problem", "Outcome", "Result", "suite", "run_problem", "brute_force", "METHODS", "parser", "run", "report",
           "write"]

METHODS = ("relaxed", "relaxed+cuts", "DP", "DP, placements", "anneal", "brute force")
HOMOGENEOUS = ("4xA100", "8xA100", "8xV100", "2x8xA100")
MIXED = ("2xV100+2xA100", "4xV100+4xA100", "4xA100+4xH100", "2x4xV100+2x4xA100")
QUICK_TOPOLOGIES = ("4xV100", "2xV100+2xA100")
#: Brute force enumerates a problem only up to this many plans by default (at 5-10 ms each, two minutes at most).
BRUTE_LIMIT = 15_000
#: Two results count as equal when they differ by less than this fraction (float noise of different sums).
SAME = 1e-9


@dataclass(frozen=True)
class Problem:
    """One problem of the suite: a model on a cluster, and the layout every method keeps."""

    name: str
    topology: str
    model: str
    layers: int
    global_batch: int
    layout: Candidate

    def search_problem(self) -> SearchProblem:
        return SearchProblem(model=self.model, topology=self.topology, global_batch=self.global_batch)


@dataclass(frozen=True)
class Outcome:
    """What one method gave on one problem: its plan's evaluation (``None``: not run), wall time (s), simulations."""

    method: str
    evaluation: Evaluation | None
    wall_s: float
    simulations: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suite(count: int, seed: int, quick: bool = False) -> tuple[Problem, ...]:
    """``count`` problems drawn with ``seed``, alternately on one device model and on two."""
    rng = random.Random(seed)
    found = []
    for i in range(count):
        topologies = QUICK_TOPOLOGIES[i % 2:i % 2 + 1] if quick else (HOMOGENEOUS, MIXED)[i % 2]
        topology = rng.choice(topologies)
        devices = Topology.parse(topology).num_ranks
        layers = rng.randint(8, 10) if quick else rng.randint(8, 48)
        hidden = rng.choice((1024, 2048))
        model = f"gpt:layers={layers - 2},hidden={hidden},heads=16,seq={rng.choice((1024, 2048))}"
        pp = rng.choice([p for p in _divisors(devices) if 2 <= p <= min(layers, 16) and (not quick or p <= 4)])
        tp = rng.choice([t for t in (1, 2) if (devices // pp) % t == 0])
        dp = devices // (pp * tp)
        b = rng.choice((1, 2))
        m = rng.choice((1, 2, 4)) * pp
        layout = Candidate(tp=tp, dp=dp, pp=pp, microbatch_size=b, schedule=rng.choice(("gpipe", "1f1b", "zb1p")))
        found.append(Problem(f"p{i:02d}", topology, model, layers, b * dp * m, layout))
    return tuple(found)


def _compositions(n: int, stages: int) -> list[str]:
    return [",".join(str(e - s) for s, e in zip((0,) + cuts, cuts + (n,)))
            for cuts in combinations(range(1, n), stages - 1)]


def _multiset_orders(items: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The distinct orderings of ``items``, in lexicographic order (generated, not filtered from all n!)."""
    if not items:
        return [()]
    found = []
    for value in sorted(set(items)):
        rest = list(items)
        rest.remove(value)
        found += [(value, *tail) for tail in _multiset_orders(tuple(rest))]
    return found


def brute_force(problem: Problem, limit: int) -> Outcome:
    """The fastest plan over every partition and kind placement (module docstring); ``evaluation`` ``None`` when there
    are more than ``limit`` (counted before anything is listed)."""
    start = time.monotonic()
    topology = Topology.parse(problem.topology)
    blocks = layout_blocks(plan_layout(problem.layout.plan_inputs(problem.search_problem()), topology), topology)
    placements = math.factorial(len(blocks.own)) // math.prod(math.factorial(c) for c in blocks.counts)
    size = math.comb(problem.layers - 1, problem.layout.pp - 1) * placements
    if size > limit:
        return Outcome("brute force", None, 0.0, size)
    orders = [blocks.realise(order) for order in _multiset_orders(blocks.own)]
    fast = FastEvaluator(problem.search_problem())
    found = [fast.evaluate(replace(problem.layout, partition=p, devices=d))
             for d in orders for p in _compositions(problem.layers, problem.layout.pp)]
    costed = sorted((e for e in found if e.iteration_time_s is not None),
                    key=lambda e: (e.iteration_time_s, e.candidate))
    best: Evaluation | None = None
    for e in costed:
        if best is not None and e.iteration_time_s >= best.iteration_time_s:  # type: ignore[operator]
            break  # sorted by time, each a lower bound of the engine's: nothing further can win
        if e.method != EXACT:
            e = evaluate(problem.search_problem(), e.candidate)
        if best is None or e.iteration_time_s < best.iteration_time_s:  # type: ignore[operator]
            best = e
    if best is not None:
        best = evaluate(problem.search_problem(), best.candidate)
    return Outcome("brute force", best, time.monotonic() - start, size)


def _timed(method: str, work) -> Outcome:
    start = time.monotonic()
    evaluation, simulations = work()
    return Outcome(method, evaluation, time.monotonic() - start, simulations)


def run_problem(problem: Problem, brute_limit: int, config: RelaxedConfig, seed: int) -> tuple[Outcome, ...]:
    """Every method of :data:`METHODS` on ``problem``."""
    sp, layout = problem.search_problem(), problem.layout
    topology = Topology.parse(problem.topology)

    def relaxed(rounding: str):
        def work():
            return evaluate(sp, relax(sp, layout, replace(config, rounding=rounding)).candidate), 1
        return work

    def placements():
        orders = stage_placements(plan_layout(layout.plan_inputs(sp), topology), topology)
        done = [evaluate(sp, replace(layout, devices=d)) for d in orders]
        return min(done, key=lambda e: (e.iteration_time_s, e.candidate)), len(done)

    def anneal():
        space = SearchSpace(schedules=(layout.schedule,), recompute=("none",), sequence_parallel=(False,), zero=(0,),
                            partitions=("balanced", "uniform"),
                            settings=((layout.tp, layout.dp, layout.pp, layout.microbatch_size),))
        result = run_search(replace(sp, space=space), strategy="anneal", seed=seed)
        # the fastest plan it costed, fitting or not: no other method here looks at memory either
        timed = [e for e in result.evaluations if e.iteration_time_s is not None]
        best = min(timed, key=lambda e: (e.iteration_time_s, e.candidate)) if timed else None
        return best, len(result.evaluations)

    return (_timed("relaxed", relaxed("largest-remainder")), _timed("relaxed+cuts", relaxed("cuts")),
            _timed("DP", lambda: (evaluate(sp, layout), 1)), _timed("DP, placements", placements),
            _timed("anneal", anneal), brute_force(problem, brute_limit))


def _time(outcome: Outcome) -> float | None:
    e = outcome.evaluation
    return None if e is None or e.iteration_time_s is None else e.iteration_time_s


def _reference(outcomes: tuple[Outcome, ...]) -> float:
    """The best time any method found, s."""
    return min(t for t in map(_time, outcomes) if t is not None)


def _versus(done: list[tuple[Problem, tuple[Outcome, ...]]], mine: str, other: str) -> str:
    """How ``mine`` fares against ``other`` over the problems where both ran."""
    ratios = []
    for _, outcomes in done:
        by = {o.method: _time(o) for o in outcomes}
        if by[mine] is not None and by[other] is not None:
            ratios.append(by[mine] / by[other] - 1)
    if not ratios:
        return f"{mine} vs {other}: no problem where both ran"
    wins = sum(r < -SAME for r in ratios)
    ties = sum(abs(r) <= SAME for r in ratios)
    losses = [r for r in ratios if r > SAME]
    text = (f"{mine} vs {other} ({len(ratios)} problems): faster on {wins}, equal on {ties}, slower on "
            f"{len(losses)}")
    if losses:
        text += f" (median {statistics.median(losses):+.2%}, worst {max(losses):+.2%})"
    if wins:
        text += f"; best win {min(ratios):+.2%}"
    return text


def _plan(e: Evaluation | None) -> str:
    if e is None:
        return "-"
    devices = ",".join(map(str, e.candidate.devices))
    return ",".join(map(str, e.layer_counts)) + (f" @{devices}" if devices else "")


def _table(done: list[tuple[Problem, tuple[Outcome, ...]]]) -> list[str]:
    lines = [f"{'problem':<8} {'cluster':<18} {'n':>3} {'layout':<26} " + " ".join(f"{m:>15}" for m in METHODS),
             "(s, and over the best of the row; ! the plan does not fit the devices' memory; - not run: too many "
             "plans to enumerate)"]
    for problem, outcomes in done:
        best = _reference(outcomes)
        k = problem.layout
        layout = f"tp{k.tp} dp{k.dp} pp{k.pp} b{k.microbatch_size} {k.schedule}"
        cells = []
        for o in outcomes:
            t = _time(o)
            mark = " " if o.evaluation is None or o.evaluation.feasible else "!"
            cells.append(f"{'-':>15}" if t is None else f"{t:>8.4f}{mark}{t / best - 1:>+6.1%}")
        lines.append(f"{problem.name:<8} {problem.topology:<18} {problem.layers:>3} {layout:<26} " + " ".join(cells))
        lines.append(f"{'':<8} plans: " + "; ".join(f"{o.method} {_plan(o.evaluation)}" for o in outcomes))
    return lines


def _summary(done: list[tuple[Problem, tuple[Outcome, ...]]]) -> list[str]:
    lines = [_versus(done, mine, other) for mine in METHODS[:2] for other in METHODS[2:]]
    walls = []
    for m, method in enumerate(METHODS):
        costs = [outcomes[m].wall_s for _, outcomes in done if outcomes[m].evaluation is not None]
        sims = [outcomes[m].simulations for _, outcomes in done if outcomes[m].evaluation is not None]
        if costs:
            walls.append(f"{method} {statistics.median(costs):.2f} s ({statistics.median(sims):g} plans)")
    lines.append("median wall time per problem (plans simulated): " + ", ".join(walls))
    skipped = [f"{p.name} ({outcomes[-1].simulations:,})" for p, outcomes in done if outcomes[-1].evaluation is None]
    if skipped:
        lines.append(f"brute force left out where partitions x placements exceed --brute-limit: {', '.join(skipped)}")
    return lines


def _csv(done: list[tuple[Problem, tuple[Outcome, ...]]]) -> str:
    fields = ["problem", "topology", "model", "layers", "global_batch", "tp", "dp", "pp", "microbatch_size",
              "schedule", "method", "layer_counts", "devices", "feasible", "iteration_time_s", "relative_to_best",
              "wall_s", "plans_simulated"]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(fields)
    for problem, outcomes in done:
        best, k = _reference(outcomes), problem.layout
        head = [problem.name, problem.topology, problem.model, problem.layers, problem.global_batch, k.tp, k.dp, k.pp,
                k.microbatch_size, k.schedule]
        for o in outcomes:
            e, t = o.evaluation, _time(o)
            writer.writerow(head + [o.method, "" if e is None else ",".join(map(str, e.layer_counts)),
                                    "" if e is None else ",".join(map(str, e.candidate.devices)),
                                    "" if e is None else e.feasible, "" if t is None else repr(t),
                                    "" if t is None else repr(t / best), f"{o.wall_s:.3f}", o.simulations])
    return text.getvalue()


def _plot(done: list[tuple[Problem, tuple[Outcome, ...]]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(done) + 2), 4.2), dpi=120)
    styles = ("o", "s", "^", "v", "D", "x")
    for m, (method, marker) in enumerate(zip(METHODS, styles)):
        xs, ys = [], []
        for x, (_, outcomes) in enumerate(done):
            t = _time(outcomes[m])
            if t is not None:
                xs.append(x + (m - 2.5) * 0.08)
                ys.append(t / _reference(outcomes))
        ax.scatter(xs, ys, marker=marker, label=method, s=22)
    ax.axhline(1.0, color="#444444", linewidth=0.8)
    ax.set_xticks(range(len(done)), [p.name + ("*" if "+" in p.topology else "") for p, _ in done], fontsize=8)
    ax.set_ylabel("iteration time / best found")
    ax.set_xlabel("problem (* two device models)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("simulated iteration time: the relaxation vs DP, annealing and brute force", fontsize=10)
    fig.tight_layout()
    return figure_png(fig)


@dataclass(frozen=True)
class Result:
    """The suite (``seed``, ``quick``) and, per problem, every method's outcome in :data:`METHODS`' order."""

    seed: int
    quick: bool
    done: tuple[tuple[Problem, tuple[Outcome, ...]], ...]


def parser() -> CliParser:
    """``python -m experiments.run relaxed_search [--quick] [--problems N] [--seed S] [--brute-limit N]
    [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run relaxed_search", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/relaxed_search", help="output directory (default runs/relaxed_search)")
    parser.add_argument("--quick", action="store_true", help="two small problems on 4 devices (CI)")
    parser.add_argument("--problems", type=int, default=16, metavar="N", help="problems in the suite (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the suite, the relaxation and the annealing")
    parser.add_argument("--brute-limit", type=int, default=BRUTE_LIMIT, metavar="N",
                        help=f"enumerate a problem's partitions x placements only up to N plans (default "
                             f"{BRUTE_LIMIT}; about 5-10 ms each)")
    return parser


def run(*, quick: bool = False, problems: int = 16, seed: int = 0, brute_limit: int = BRUTE_LIMIT) -> Result:
    """Every method on ``problems`` seeded problems (``quick``: two small ones, two restarts of the relaxation),
    brute force up to ``brute_limit`` plans a problem.

    Raises:
        SpecError: a count, seed or limit out of range (named by its flag).
    """
    count = 2 if quick else problems
    if not 1 <= count <= 100:
        raise SpecError(f"--problems must be from 1 to 100, got {problems}")
    if seed < 0:
        raise SpecError(f"--seed must be >= 0, got {seed}")
    if brute_limit < 0:
        raise SpecError(f"--brute-limit must be >= 0, got {brute_limit}")
    # --quick: two restarts instead of four, to keep CI short
    config = RelaxedConfig(seed=seed, restarts=2) if quick else RelaxedConfig(seed=seed)
    return Result(seed, quick, tuple((problem, run_problem(problem, brute_limit, config, seed))
                                     for problem in suite(count, seed, quick)))


def report(result: Result) -> str:
    """The table of problems by method, then the methods against each other."""
    done = list(result.done)
    return "\n".join([f"{len(done)} problems (seed {result.seed}{', --quick' if result.quick else ''}); each method's "
                      f"plan simulated by sim.search.evaluate; iteration time in s and relative to the best any "
                      f"method found", *_table(done), "", *_summary(done)])


def write(result: Result, out: Path) -> list[Path]:
    """``relaxed_search.csv`` (one row per problem and method) and ``relaxed_search.png`` in ``out``."""
    done = list(result.done)
    return write_csv_png(out, "relaxed_search", _csv(done), _plot(done))
