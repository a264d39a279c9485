"""The dynamic program ``sim.plan.partition.balanced_counts`` was, kept as ``python -m sim.bench --partition``'s
baseline and the partition tests' oracle: O(p·n²) steps of Python over every cut, each stage costed by the oracle
with its compute and boundary transfers added in the old order."""

from __future__ import annotations

import math
from collections.abc import Callable

from sim.cost.oracle import CostOracle

__all__ = ["reference_stage_cost", "reference_dp", "reference_balanced_counts"]


def reference_stage_cost(oracle: CostOracle, ranks: tuple[int, ...], stage: int, start: int, end: int) -> float:
    """The stage cost the old dynamic program used, s: compute of layers [start, end) on the stage's rank, plus its
    output to the next stage's rank and its input gradient to the previous one, added in that order."""
    n, p = len(oracle.graph), len(ranks)
    time = oracle.stage_compute_s(ranks[stage], start, end)
    if end < n and stage + 1 < p:
        time += oracle.transfer_time(oracle.boundary_bytes(end), ranks[stage], ranks[stage + 1])
    if start > 0 and stage > 0:
        time += oracle.transfer_time(oracle.boundary_bytes(start), ranks[stage], ranks[stage - 1])
    return time


def reference_dp(oracle: CostOracle, num_stages: int, vstage_to_rank: tuple[int, ...] | None = None
                 ) -> tuple[tuple[int, ...], list[list[float]], Callable[[int, int, int], float]]:
    """The O(p·n²) dynamic program ``balanced_counts`` was, kept as the benchmark's baseline and the tests' oracle.

    Returns:
        ``(counts, best, cost)``: the partition, ``best[s][j]`` the smallest slowest-stage time (s) of stages 0..s
        over layers [0, j), and the stage cost ``cost(s, i, j)`` (:func:`reference_stage_cost`) it used.
    """
    n = len(oracle.graph)
    ranks = tuple(range(num_stages)) if vstage_to_rank is None else vstage_to_rank

    def cost(s: int, i: int, j: int) -> float:
        return reference_stage_cost(oracle, ranks, s, i, j)

    best = [[math.inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n - (num_stages - s - 1) + 1):
            for i in range(s, j):
                candidate = max(best[s - 1][i], cost(s, i, j))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    counts, end = [], n
    for s in range(num_stages - 1, 0, -1):
        counts.append(end - cut[s][end])
        end = cut[s][end]
    counts.append(end)
    return tuple(reversed(counts)), best, cost


def reference_balanced_counts(oracle: CostOracle, num_stages: int) -> tuple[int, ...]:
    """The old dynamic program's partition, stage s on rank s (:func:`reference_dp`)."""
    return reference_dp(oracle, num_stages)[0]
