"""How many candidates per second the search's evaluators cost at 64 GPUs (``python -m sim.bench --search``).

The workload: ``gpt:layers=96,hidden=4096,heads=32,seq=2048`` on ``8x8xA100``, TP 2 × DP 4 × PP 8, global batch 256
in microbatches of 1 (64 per replica), 1F1B with full recomputation; the candidates are that layout with seeded
random partitions (each stage's layer count moved by up to 3 from the uniform split), the moves a refinement makes.
Three figures, all timed in this process on one core:

* **engine**: :func:`sim.search.evaluate.evaluate` per candidate (build the plan, simulate it with SimPy);
* **fast, per candidate**: :class:`sim.bench.fast.FastEvaluator` (the structure compiled once, each candidate's
  oracle, partition, cost vector, longest path, contention check and peak memory);
* **fast, batched**: the compiled structure's longest path over many cost vectors at once
  (:meth:`sim.bench.critical_path.CompiledPlan.makespan` on a (slots × K) array), the part that grows with the
  candidates once their cost vectors are known. Target: at least 1,000 candidates per second.

Every fast result is checked against the engine's on the candidates both cost (exact where uncontended, a lower
bound otherwise); a disagreement makes the command fail.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from sim.bench.critical_path import compile_plan
from sim.bench.fast import EXACT, FastEvaluator
from sim.plan.build import build_plan
from sim.search.evaluate import evaluate
from sim.search.space import Candidate, SearchProblem, SearchSpace

__all__ = ["RateReport", "measure_rates", "RATE_PROBLEM", "RATE_LAYOUT"]

RATE_PROBLEM = SearchProblem("gpt:layers=96,hidden=4096,heads=32,seq=2048", "8x8xA100", 256,
                             space=SearchSpace(schedules=("1f1b",), recompute=("full",)))
RATE_LAYOUT = Candidate(tp=2, dp=4, pp=8, microbatch_size=1, schedule="1f1b", recompute="full", partition="uniform")


@dataclass(frozen=True)
class RateReport:
    """Candidates per second of each evaluator, and whether the fast ones agreed with the engine."""

    engine_per_s: float
    fast_per_s: float
    batched_per_s: float
    engine_candidates: int
    fast_candidates: int
    batched_candidates: int
    agreed: bool
    ops: int


def _partitions(layers: int, stages: int, count: int, seed: int) -> list[str]:
    """``count`` distinct seeded partitions near the uniform one, as ``--partition`` layer counts."""
    rng = random.Random(seed)
    base = [layers // stages + (1 if s >= stages - layers % stages else 0) for s in range(stages)]
    found: dict[str, None] = {}
    while len(found) < count:
        counts = list(base)
        for _ in range(stages):
            give, take = rng.randrange(stages), rng.randrange(stages)
            step = rng.randint(1, 3)
            if give != take and counts[give] - step >= 1:
                counts[give] -= step
                counts[take] += step
        found[",".join(map(str, counts))] = None
    return list(found)


def measure_rates(engine_candidates: int = 4, fast_candidates: int = 40, batch: int = 1000,
                  seed: int = 0) -> RateReport:
    """Time the three evaluators (module docstring) on the 64-GPU workload."""
    problem, layout = RATE_PROBLEM, RATE_LAYOUT
    built = build_plan(layout.plan_inputs(problem))
    layers = len(built.graph)
    partitions = _partitions(layers, layout.pp, fast_candidates, seed)
    candidates = [Candidate(**{**layout.__dict__, "partition": p}) for p in partitions]
    start = time.perf_counter()
    slow = [evaluate(problem, c) for c in candidates[:engine_candidates]]
    engine_s = time.perf_counter() - start
    fast = FastEvaluator(problem)
    fast.evaluate(candidates[0])  # compiles the structure, once per search; not what a candidate costs
    start = time.perf_counter()
    quick = [fast.evaluate(c) for c in candidates]
    fast_s = time.perf_counter() - start
    agreed = all(q.peak_memory_bytes == s.peak_memory_bytes and (
        q.iteration_time_s == s.iteration_time_s if q.method == EXACT else q.iteration_time_s <= s.iteration_time_s)
        for q, s in zip(quick, slow))
    views = built.views()
    compiled = compile_plan(built.plan, len(views))
    base = compiled.slot_values(views)
    vectors = base[:, None] * np.random.default_rng(seed).uniform(0.8, 1.25, size=(len(base), batch))
    start = time.perf_counter()
    compiled.makespan(vectors)
    batched_s = time.perf_counter() - start
    ops = sum(len(program) for program in built.plan.programs)
    return RateReport(engine_candidates / engine_s, len(candidates) / fast_s, batch / batched_s, engine_candidates,
                      len(candidates), batch, agreed, ops)
