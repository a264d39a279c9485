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

import argparse
import random

from sim.core.errors import fail
from sim.csp.problem import CspProblem
from sim.csp.simulate import simulate_csp

__all__ = ["main", "random_problem"]


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


def main(argv: list[str]) -> int:
    """``python -m experiments.run csp_prefetch [--problems N] [--seed S]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m experiments.run csp_prefetch", description=__doc__.split("\n")[0])
    parser.error = lambda message: fail(message)  # type: ignore[method-assign]
    parser.add_argument("--problems", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.problems < 1:
        fail(f"--problems must be >= 1, got {args.problems}")
    rng = random.Random(args.seed)
    counts = {"one stage": [0, 0, 0], "several stages": [0, 0, 0]}  # faster, equal, slower
    worst = 0.0
    for _ in range(args.problems):
        problem = random_problem(rng)
        predicted = simulate_csp(problem, prefetch="predict").makespan
        demand = simulate_csp(problem, prefetch="on_demand").makespan
        row = counts["one stage" if problem.num_stages == 1 else "several stages"]
        row[0 if predicted < demand else 1 if predicted == demand else 2] += 1
        worst = max(worst, predicted / demand - 1)
    print("| problems | predict faster | equal | slower |")
    print("|---|---:|---:|---:|")
    for name, (faster, equal, slower) in counts.items():
        print(f"| {name} | {faster} | {equal} | {slower} |")
    print(f"\nworst slowdown: {worst:.1%} (seed {args.seed}, {args.problems} problems)")
    return 0
