"""Partitioning a layer chain into contiguous pipeline stages (``--partition uniform|balanced|<counts>``).

``balanced`` is an exact dynamic program: it minimises the time of the slowest stage, where a stage's time per
microbatch is its forward plus backward compute on the device that runs it plus the transfers it makes (its
activation to the next stage, its input gradient to the previous one). The slowest stage bounds a pipeline's steady
state throughput (PipeDream, Narayanan et al. SOSP'19 §3.1 uses the same objective), and with heterogeneous devices
the same layer costs differ per stage, which the DP handles by costing stage s on rank s's device.

Complexity O(p · n²) for n layers and p stages, with prefix sums so each stage cost is O(1).
"""

from __future__ import annotations

import math
from itertools import accumulate

from sim.costs import layer_costs
from sim.errors import SpecError
from sim.graph import LayerGraph
from sim.profile import MeasuredProfile
from sim.topology import Topology

__all__ = ["parse_partition", "uniform_counts", "balanced_counts", "stage_time", "counts_to_ranges"]


def counts_to_ranges(counts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Layer counts per stage → half-open ``(start, end)`` layer ranges."""
    ends = tuple(accumulate(counts))
    return tuple(zip((0,) + ends[:-1], ends))


def uniform_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """As equal as possible; the last ``num_layers mod num_stages`` stages take one layer more.

    Later stages get the extra layer because the first stage of a 1F1B pipeline holds the most activations.
    """
    _check_sizes(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s >= num_stages - extra else 0) for s in range(num_stages))


def _check_sizes(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise SpecError(f"need at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise SpecError(f"more stages ({num_stages}) than layers ({num_layers}): every stage needs a layer")


class _StageCoster:
    """Time per microbatch of a candidate stage [i, j) on rank s, in s."""

    def __init__(self, graph: LayerGraph, topology: Topology, microbatch_size: int,
                 profile: MeasuredProfile | None) -> None:
        self.graph, self.topology, self.microbatch_size = graph, topology, microbatch_size
        self.prefix: dict[str, list[float]] = {}
        for device in topology.devices:
            if device.name not in self.prefix:
                costs = layer_costs(graph, device, microbatch_size, profile)
                self.prefix[device.name] = [0.0, *accumulate(f + b for f, b in zip(costs.fwd, costs.bwd))]

    def __call__(self, stage: int, num_stages: int, start: int, end: int) -> float:
        prefix = self.prefix[self.topology.devices[stage].name]
        time = prefix[end] - prefix[start]
        if end < len(self.graph) and stage + 1 < num_stages:
            activation = self.microbatch_size * self.graph.boundary_bytes(end)
            time += self.topology.transfer_time(activation, stage, stage + 1)
        if start > 0 and stage > 0:
            gradient = self.microbatch_size * self.graph.boundary_bytes(start)
            time += self.topology.transfer_time(gradient, stage, stage - 1)
        return time


def stage_time(graph: LayerGraph, topology: Topology, counts: tuple[int, ...], microbatch_size: int = 1,
               profile: MeasuredProfile | None = None) -> tuple[float, ...]:
    """Per-stage time per microbatch (compute + transfers) of a given partition, in s; stage s runs on rank s."""
    coster = _StageCoster(graph, topology, microbatch_size, profile)
    return tuple(coster(s, len(counts), start, end) for s, (start, end) in enumerate(counts_to_ranges(counts)))


def balanced_counts(graph: LayerGraph, topology: Topology, num_stages: int, microbatch_size: int = 1,
                    profile: MeasuredProfile | None = None) -> tuple[int, ...]:
    """The contiguous partition into ``num_stages`` stages whose slowest stage is fastest.

    Among optimal partitions the one found first is returned: stages end as early as possible, scanning the last
    stage's start from the left. The result is deterministic.
    """
    n = len(graph)
    _check_sizes(n, num_stages)
    if num_stages > topology.num_ranks:
        raise SpecError(f"{num_stages} stages need {num_stages} devices, topology {topology} has {topology.num_ranks}")
    coster = _StageCoster(graph, topology, microbatch_size, profile)
    # best[s][j]: the smallest possible slowest-stage time when stages 0..s cover layers [0, j).
    best = [[math.inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        best[0][j] = coster(0, num_stages, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n - (num_stages - s - 1) + 1):
            for i in range(s, j):
                candidate = max(best[s - 1][i], coster(s, num_stages, i, j))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    counts, end = [], n
    for s in range(num_stages - 1, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))


def parse_partition(text: str, graph: LayerGraph, topology: Topology, num_stages: int, microbatch_size: int = 1,
                    profile: MeasuredProfile | None = None) -> tuple[int, ...]:
    """Resolve ``--partition``: ``uniform``, ``balanced`` or comma-separated layer counts such as ``4,6,6,8``.

    Raises:
        SpecError: unknown method, counts that are not positive integers, or do not add up to the layer count or
            match the number of stages.
    """
    n = len(graph)
    _check_sizes(n, num_stages)
    if text == "uniform":
        return uniform_counts(n, num_stages)
    if text == "balanced":
        return balanced_counts(graph, topology, num_stages, microbatch_size, profile)
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"--partition must be uniform, balanced or layer counts like 4,4,8; got {text!r}") from None
    if any(c < 1 for c in counts):
        raise SpecError(f"every stage needs at least one layer, got --partition {text!r}")
    if len(counts) != num_stages:
        raise SpecError(f"--partition {text!r} has {len(counts)} stages, the plan has {num_stages}")
    if sum(counts) != n:
        raise SpecError(f"--partition {text!r} covers {sum(counts)} layers, the model has {n}")
    return counts
