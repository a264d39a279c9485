"""Partitioning a layer chain into contiguous pipeline stages (``--partition uniform|balanced|blocks|<counts>``, or a
Megatron-Core layout: :mod:`sim.plan.megatron_layout`).

``blocks`` is Megatron-DeepSpeed's ``partition_method="type:transformer"``: the transformer blocks split as evenly as
:func:`uniform_counts` splits layers, the embedding joins the first stage and the head the last (a GPT model).

``balanced`` is an exact dynamic program: it minimises the time of the slowest stage, where a stage's time per
microbatch is its forward plus backward compute on the device that runs it plus the transfers it makes (its
activation to the next stage, its input gradient to the previous one). The slowest stage bounds a pipeline's steady
state throughput (PipeDream, Narayanan et al. SOSP'19 §3.1 uses the same objective), and with heterogeneous devices
the same layer costs differ per stage, which the DP handles by costing stage s on rank s's device.

With several virtual stages per rank (interleaved placements) the same DP runs over the vstages in pipeline order,
each costed on the device of the rank that runs it, with the transfer to its neighbour's rank (free between vstages
on one rank). That balances the ranks only when every rank has the same device — then equal vstages make equal
ranks — so ``balanced`` refuses such placements on mixed devices rather than return a partition that looks optimal
and is not.

The DP is defined as O(p · n²) steps (``best[s][j]``, ``cut[s][j]``; the reference implementation lives in
``tests/sim/plan/test_partition.py``); :mod:`sim.plan.bottleneck` returns exactly its partition with numpy
threshold tests and the same DP on the narrow band of stage ends that can matter. ``python -m sim.bench
--partition`` times it: 10,000 layers on 64 stages in about 0.2 s (``uniform:layers=10000`` on ``64xideal``,
``gpt:layers=10000`` on ``8x8xA100``), where the reference DP would need about 9 hours; hundreds of times faster
already at 400 layers on 8 stages (the figures are in :mod:`sim.bench.cli`).
"""

from __future__ import annotations

from itertools import accumulate

from sim.core.errors import SpecError, did_you_mean
from sim.cost.oracle import CostOracle
from sim.hw.topology import Topology
from sim.plan.bottleneck import StageCosts, min_max_counts
from sim.plan.megatron_layout import is_megatron_layout, layout_counts

__all__ = ["parse_partition", "uniform_counts", "balanced_counts", "block_counts", "stage_time", "counts_to_ranges",
           "PARTITION_RULES"]

#: The named partition rules (``--partition`` also takes layer counts).
PARTITION_RULES = ("uniform", "balanced", "blocks")


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
    """Time per microbatch of a candidate stage [i, j) as vstage s, on rank ``vstage_to_rank[s]``, in s: its compute
    plus the transfers it makes, all asked of the cost oracle (so a profile's p2p fit counts where it applies)."""

    def __init__(self, oracle: CostOracle, vstage_to_rank: tuple[int, ...] | None = None) -> None:
        self.oracle, self.to_rank, self.num_layers = oracle, vstage_to_rank, len(oracle.graph)

    def rank(self, stage: int) -> int:
        return stage if self.to_rank is None else self.to_rank[stage]

    def __call__(self, stage: int, num_stages: int, start: int, end: int) -> float:
        oracle, rank = self.oracle, self.rank(stage)
        time = oracle.stage_compute_s(rank, start, end)
        if end < self.num_layers and stage + 1 < num_stages:
            time += oracle.transfer_time(oracle.boundary_bytes(end), rank, self.rank(stage + 1))
        if start > 0 and stage > 0:
            time += oracle.transfer_time(oracle.boundary_bytes(start), rank, self.rank(stage - 1))
        return time


def stage_time(oracle: CostOracle, counts: tuple[int, ...],
               vstage_to_rank: tuple[int, ...] | None = None) -> tuple[float, ...]:
    """Per-stage time per microbatch (compute + transfers) of a given partition, in s.

    Stage s runs on rank ``vstage_to_rank[s]``, or on rank s when no placement is given.
    """
    coster = _StageCoster(oracle, vstage_to_rank)
    return tuple(coster(s, len(counts), start, end) for s, (start, end) in enumerate(counts_to_ranges(counts)))


def balanced_counts(oracle: CostOracle, num_stages: int,
                    vstage_to_rank: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The contiguous partition into ``num_stages`` stages whose slowest stage is fastest.

    Stage s runs on rank ``vstage_to_rank[s]`` (rank s when not given). Among optimal partitions the one found first
    is returned: stages end as early as possible, scanning the last stage's start from the left. The result is
    deterministic.

    Raises:
        SpecError: more stages than layers or devices, several stages per rank on devices that differ, or a
            problem too large to tabulate (:data:`sim.plan.bottleneck.MAX_CELLS`).
    """
    n, topology = len(oracle.graph), oracle.topology
    _check_sizes(n, num_stages)
    if vstage_to_rank is None:
        if num_stages > topology.num_ranks:
            raise SpecError(f"{num_stages} stages need {num_stages} devices, topology {topology} has "
                            f"{topology.num_ranks}")
    else:
        _check_placement(topology, num_stages, vstage_to_rank)
    ranks = tuple(range(num_stages)) if vstage_to_rank is None else vstage_to_rank
    costs = StageCosts(oracle, ranks)
    # The partition is a function of the table's numbers alone: a search meets the same table for many candidates
    # (other schedules, ZeRO stages, data-parallel degrees), kept in the topology's memo.
    key = ("balanced partition", costs.signature())
    counts = topology.cost_memo.get(key)
    if counts is None:
        counts, bottleneck = min_max_counts(costs, uniform_counts(n, num_stages))
        # The fast path computes every stage cost with numpy from the oracle's numbers; the stage costs asked of the
        # oracle one by one must give the same bottleneck, bit for bit.
        assert max(stage_time(oracle, counts, vstage_to_rank)) == bottleneck, (counts, bottleneck)
        topology.cost_memo[key] = counts
    return counts


def block_counts(oracle: CostOracle, num_stages: int) -> tuple[int, ...]:
    """Megatron-DeepSpeed's ``type:transformer`` partition: blocks split evenly, embedding first, head last.

    Raises:
        SpecError: the model is not a chain of an embedding, transformer blocks and a head, or has fewer blocks than
            stages.
    """
    layers = oracle.graph.layers
    parts = [layer.transformer.part if layer.transformer is not None else None for layer in layers]
    blocks = len(parts) - 2
    if len(parts) < 3 or parts[0] != "embedding" or parts[-1] != "head" or set(parts[1:-1]) != {"block"}:
        raise SpecError(f"{{partition}} blocks splits a transformer's blocks (embedding, blocks, head: a gpt model); "
                        f"{oracle.graph.spec} is not one", "partition")
    if blocks < num_stages:
        raise SpecError(f"{{partition}} blocks gives every stage a block: {num_stages} stages, {blocks} blocks in "
                        f"{oracle.graph.spec}", "partition")
    counts = list(uniform_counts(blocks, num_stages))
    counts[0] += 1
    counts[-1] += 1
    return tuple(counts)


def _check_placement(topology: Topology, num_stages: int, vstage_to_rank: tuple[int, ...]) -> None:
    """The DP over vstages balances ranks only when one vstage per rank, or all used devices are the same."""
    if len(vstage_to_rank) != num_stages:
        raise SpecError(f"placement has {len(vstage_to_rank)} stages, the partition {num_stages}")
    if max(vstage_to_rank) >= topology.num_ranks:
        raise SpecError(f"placement uses rank {max(vstage_to_rank)}, topology {topology} has {topology.num_ranks} "
                        f"devices")
    if len(set(vstage_to_rank)) == len(vstage_to_rank):
        return
    devices = sorted({topology.devices[r].name for r in vstage_to_rank})
    if len(devices) > 1:
        raise SpecError(f"{{partition}} balanced with several stages per rank needs identical devices, topology "
                        f"{topology} mixes {', '.join(devices)}; give {{partition}} uniform or layer counts",
                        "partition")


def parse_partition(text: str, oracle: CostOracle, num_stages: int,
                    vstage_to_rank: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Resolve ``--partition``: ``uniform``, ``balanced``, ``blocks``, comma-separated layer counts such as
    ``4,6,6,8``, or a Megatron-Core layout such as ``Et*4|(t*4|)*14tmL`` (:mod:`sim.plan.megatron_layout`).

    ``vstage_to_rank`` (default: stage s on rank s) tells ``balanced`` which device runs each stage.

    Raises:
        SpecError: unknown method, counts that are not positive integers, or do not add up to the layer count or
            match the number of stages.
    """
    n = len(oracle.graph)
    _check_sizes(n, num_stages)
    if text == "uniform":
        return uniform_counts(n, num_stages)
    if text == "balanced":
        return balanced_counts(oracle, num_stages, vstage_to_rank)
    if text == "blocks":
        return block_counts(oracle, num_stages)
    if is_megatron_layout(text):
        return layout_counts(text, oracle.graph, num_stages)
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(f"{{partition}} must be uniform, balanced, blocks, layer counts like 4,4,8 or a Megatron "
                        f"layout like Et*2|t*2L; got {text!r}"
                        f"{did_you_mean(text, ('uniform', 'balanced', 'blocks'))}",
                        "partition") from None
    if any(c < 1 for c in counts):
        raise SpecError(f"every stage needs at least one layer, got {{partition}} {text!r}", "partition")
    if len(counts) != num_stages:
        raise SpecError(f"{{partition}} {text!r} has {len(counts)} stages, the plan has {num_stages}", "partition")
    if sum(counts) != n:
        raise SpecError(f"{{partition}} {text!r} covers {sum(counts)} layers, the model has {n}", "partition")
    return counts
