"""How often NASPipe's predictor helps, over random CSP problems: predict against copy-on-demand.

One would like prediction never to make a run slower than copying on demand. That cannot be promised on more than one
stage (:mod:`sim.csp.simulate`, "Predict versus on_demand": CSP's greedy dispatch is not monotone in op durations), so
this experiment measures instead how often it helps, ties or hurts, and by how much at worst.

Each problem draws, from ``random.Random(seed)``: 1–4 stages, 1–10 subnets over a pool of 1–5 layer keys per stage
(0–2 keys per subnet and stage), forward and backward times of 1–4 s, updates of 0–2 s, a transfer of 0–2 s, a
lookahead of 1–8, key sizes of 1–3 bytes, a budget from the largest subnet's keys up to that plus every key, and a
copy time of 0.25–2 s per byte (write-back half of that). Single-stage problems are counted apart: there the
predictor is never slower (``tests/sim/csp/test_prefetch.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.csp.problem import CspProblem
from sim.csp.simulate import simulate_csp

__all__ = ["Result", "parser", "run", "report", "random_problem"]


def random_problem(rng: random.Random) -> CspProblem:
    """One random budgeted CSP problem (module docstring)."""
    p, n, pool = rng.randint(1, 4), rng.randint(1, 10), rng.randint(1, 5)
    uses = [[frozenset(rng.sample(range(pool), rng.randint(0, min(2, pool)))) for _ in range(p)] for _ in range(n)]

    def table(lo: int, hi: int) -> list[list[float]]:
        return [[float(rng.randint(lo, hi)) for _ in range(p)] for _ in range(n)]

    fwd, bwd, upd = table(1, 4), table(1, 4), table(0, 2)
    transfer, lookahead = float(rng.randint(0, 2)), rng.randint(1, 8)
    key_bytes = {k: rng.randint(1, 3) for k in range(pool)}
    largest = max([sum(key_bytes[k] for k in keys) for row in uses for keys in row] + [0])
    budget = largest + rng.randint(0, sum(key_bytes.values()))
    per_byte = rng.choice([0.25, 0.5, 1.0, 2.0])
    return CspProblem(p, uses, fwd, bwd, upd, transfer, lookahead, key_bytes, budget,
                      lambda s, b: per_byte * b, lambda s, b: per_byte * b / 2)


@dataclass(frozen=True)
class Result:
    """``problems`` random problems from ``seed``: how often prediction was faster, equal and slower than copying on
    demand, on one stage and on several; and the worst slowdown (predicted ÷ on-demand makespan − 1)."""

    problems: int
    seed: int
    one_stage: tuple[int, int, int]
    several_stages: tuple[int, int, int]
    worst_slowdown: float


def parser() -> CliParser:
    """``python -m experiments.run csp_prefetch [--problems N] [--seed S]``."""
    parser = CliParser(prog="python -m experiments.run csp_prefetch", description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=3000, help="random CSP problems to compare on (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems' generator (default 0)")
    return parser


def run(*, problems: int = 3000, seed: int = 0) -> Result:
    """Both prefetch policies on ``problems`` problems drawn from ``random.Random(seed)``.

    Raises:
        SpecError: ``problems`` < 1 (named ``--problems``).
    """
    if problems < 1:
        raise SpecError(f"--problems must be >= 1, got {problems}")
    rng = random.Random(seed)
    counts = {1: [0, 0, 0], 2: [0, 0, 0]}  # one stage, several: faster, equal, slower
    worst = 0.0
    for _ in range(problems):
        problem = random_problem(rng)
        predicted = simulate_csp(problem, prefetch="predict").makespan
        demand = simulate_csp(problem, prefetch="on_demand").makespan
        row = counts[min(problem.num_stages, 2)]
        row[0 if predicted < demand else 1 if predicted == demand else 2] += 1
        worst = max(worst, predicted / demand - 1)
    one, several = counts[1], counts[2]
    return Result(problems, seed, (one[0], one[1], one[2]), (several[0], several[1], several[2]), worst)


def report(result: Result) -> str:
    """The counts' table and the worst slowdown."""
    rows = (("one stage", result.one_stage), ("several stages", result.several_stages))
    return "\n".join(["| problems | predict faster | equal | slower |", "|---|---:|---:|---:|",
                      *(f"| {name} | {faster} | {equal} | {slower} |" for name, (faster, equal, slower) in rows),
                      f"\nworst slowdown: {result.worst_slowdown:.1%} (seed {result.seed}, {result.problems} "
                      f"problems)"])
