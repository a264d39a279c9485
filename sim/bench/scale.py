"""The search at cluster scale, timed (``python -m sim.bench --screen``): the screen strategy on the spaces issue #27
sets targets for.

* **GPT 175B-class on 512 A100s** (96 layers, hidden 12288, seq 2048, global batch 1536; the default space: 18,507
  plans): every plan screened in ≤ 20 s on one core.
* **Llama 3.1 70B on 512 H100s** (seq 8192, global batch 1024; context parallelism 1, 2, 4, ZeRO 0, 1, 3, BF16 and
  FP8, microbatches of 1 or 2: 34,668 plans): the same target.
* **Llama 3.1 405B on 16,384 H100s**, Llama 3's dimensions (seq 8192, global batch 2048 sequences = 16M tokens,
  Llama 3 report §3.3; CP 1 or 2, ZeRO 1 or 3, BF16, microbatch 1, no or full recomputation: 7,118 plans): the whole
  search in ≤ 5 min.

For each: the screen in this process alone (one core), then the whole search (screen and proof) with two workers,
with the plans simulated, the proven gap and the pick. The baseline, measured in the same run: the proof's mean
engine time per simulated plan times the plans that build, what costing every plan with the engine would take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sim.hw.topology import Topology
from sim.search.screen import Screener, screen_all
from sim.search.search import SearchResult, run_search
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates

__all__ = ["SCALE_PROBLEMS", "ScaleReport", "measure_scale"]

#: name → (problem, the target in words).
SCALE_PROBLEMS: dict[str, tuple[SearchProblem, str]] = {
    "GPT 175B-class, 512 A100": (
        SearchProblem("gpt:layers=96,hidden=12288,heads=96,seq=2048", "64x8xA100", 1536),
        "every plan screened in <= 20 s on one core; the whole search <= 60 s on 2 cores"),
    "Llama 3.1 70B, 512 H100, CP/ZeRO/FP8": (
        SearchProblem("llama3.1-70b,seq=8192", "64x8xH100", 1024,
                      space=SearchSpace(cp=(1, 2, 4), zero=(0, 1, 3), precisions=("bf16", "fp8"),
                                        microbatch_sizes=(1, 2))),
        "every plan screened in <= 20 s on one core; the whole search <= 60 s on 2 cores"),
    "Llama 3.1 405B, 16,384 H100": (
        SearchProblem("llama3.1-405b,seq=8192", "2048x8xH100", 2048,
                      space=SearchSpace(cp=(1, 2), zero=(1, 3), precisions=("bf16",), microbatch_sizes=(1,),
                                        recompute=("none", "full"))),
        "the whole search <= 5 min"),
}


@dataclass(frozen=True)
class ScaleReport:
    """One problem's figures.

    Attributes:
        space_size: plans in the space.
        screen_one_core_s: the screen alone, in this process, s.
        result: the whole search with two workers.
        engine_per_plan_s: the proof's wall-clock time per simulated plan (two workers), s.
        buildable: plans that do not break a rule of the model, schedule or batch.
    """

    space_size: int
    screen_one_core_s: float
    result: SearchResult
    engine_per_plan_s: float
    buildable: int


def measure_scale(problem: SearchProblem, workers: int = 2) -> ScaleReport:
    """Time the screen alone and the whole screened search on ``problem`` (module docstring)."""
    topology = Topology.parse(problem.topology)
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    start = time.perf_counter()
    bounds = screen_all(Screener(problem, topology), candidates)
    screen_s = time.perf_counter() - start
    result = run_search(problem, strategy="screen", workers=workers)
    summary = result.screen
    assert summary is not None
    proof_s = max(result.elapsed_s - summary.screen_s, 0.0)
    buildable = sum(1 for b in bounds if b is not None and not b.breaks_rule)
    return ScaleReport(len(candidates), screen_s, result, proof_s / max(summary.simulated, 1), buildable)
