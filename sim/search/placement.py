"""Which devices serve which pipeline stage: the placements a search tries on a mixed cluster.

A layout (TP × DP × PP in a rank order) gives each pipeline rank a block of ``tp · dp`` devices. On a cluster of one
device model every assignment of blocks to stages is the same plan up to symmetry, but on a mixed one it is not: a
heavy stage belongs on the fast GPUs, and a cut between stages belongs where the link is slow and the activations
small. A placement here moves whole blocks (the ``devices`` order of :class:`sim.ir.parallel.Parallelism`): block
``σ(p)`` serves pipeline rank ``p``. Blocks holding the same device models are interchangeable, so the distinct
placements are the distinct sequences of block kinds (multiset permutations); each is realised by giving blocks of
one kind to stages in ascending order, which keeps every tensor- and data-parallel group's devices ascending, as the
executor needs.

Their number grows fast (16 stages over two kinds of 8 blocks: 12,870), so at most :data:`MAX_PLACEMENTS` are
listed: the layout's own order, the fastest blocks first, the fastest last, then the rest in lexicographic order of
kinds. The partition is balanced for each placement by the oracle (``--partition balanced``), so a heavy stage on
fast devices takes more layers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism

__all__ = ["stage_placements", "swapped_placements", "realise", "MAX_PLACEMENTS"]

#: Placements listed per layout at most (see the module docstring).
MAX_PLACEMENTS = 24


def _distinct_sequences(kinds: list[tuple], limit: int) -> list[tuple]:
    """Distinct orderings of ``kinds`` (a multiset) in lexicographic order, at most ``limit`` (generated in order,
    so that a huge multiset costs only what is listed)."""
    pool = sorted(kinds)
    found: list[tuple] = []

    def extend(prefix: list, remaining: list) -> None:
        if len(found) >= limit:
            return
        if not remaining:
            found.append(tuple(prefix))
            return
        for i, kind in enumerate(remaining):
            if i and remaining[i - 1] == kind:
                continue  # the same kind again gives the same sequences
            extend([*prefix, kind], remaining[:i] + remaining[i + 1:])

    extend([], pool)
    return found


def _blocks(layout: Parallelism, topology: Topology) -> tuple[list[list[int]], list[tuple]]:
    """The devices of each pipeline rank's block in the layout's own order (ascending), and each block's kind (the
    sorted device models it holds)."""
    base = replace(layout, devices=())
    blocks = [sorted(base.device(p, d, t) for d in range(base.data_ranks) for t in range(base.tp))
              for p in range(base.pp)]
    return blocks, [tuple(sorted(topology.devices[device].name for device in block)) for block in blocks]


def stage_placements(layout: Parallelism, topology: Topology, limit: int = MAX_PLACEMENTS) -> list[tuple[int, ...]]:
    """Device orders (``Parallelism.devices``) that put the pipeline ranks' blocks on different devices; ``()``, the
    layout's own order, first. Only ``[()]`` when every block holds the same device models."""
    base = replace(layout, devices=())
    blocks, kinds = _blocks(layout, topology)
    if len(set(kinds)) == 1:
        return [()]
    speed = {kind: sum(topology.devices[b].peak_flops for b in block) for kind, block in zip(kinds, blocks)}
    fastest_first = tuple(sorted(kinds, key=lambda kind: (-speed[kind], kind)))
    wanted = [tuple(kinds), fastest_first, tuple(reversed(fastest_first))]
    wanted += _distinct_sequences(kinds, limit)
    orders: list[tuple[int, ...]] = []
    seen: set[tuple] = set()
    for sequence in wanted:
        if sequence in seen or len(orders) >= limit:
            continue
        seen.add(sequence)
        orders.append(realise(sequence, kinds, blocks, base.world_size))
    return [() if order == tuple(range(base.world_size)) else order for order in orders]


def swapped_placements(layout: Parallelism, topology: Topology) -> list[tuple[int, ...]]:
    """The device orders that exchange the kinds of two neighbouring pipeline ranks' blocks in ``layout`` (with its
    own ``devices``), one per neighbouring pair of different kinds, in pipeline order; ``()`` stands for the layout's
    own order. The moves of a local search over placements (:mod:`sim.search.refine`)."""
    blocks, kinds = _blocks(layout, topology)
    # The kind serving each pipeline rank under the layout's device order.
    by_device = {block[0]: kind for block, kind in zip(blocks, kinds)}
    serving = [by_device[min(layout.device(p, d, t) for d in range(layout.data_ranks) for t in range(layout.tp))]
               for p in range(layout.pp)]
    world = layout.world_size
    found = []
    for p in range(layout.pp - 1):
        if serving[p] == serving[p + 1]:
            continue
        sequence = [*serving]
        sequence[p], sequence[p + 1] = sequence[p + 1], sequence[p]
        order = realise(sequence, kinds, blocks, world)
        found.append(() if order == tuple(range(world)) else order)
    return found


def realise(sequence: Sequence[Hashable], kinds: Sequence[Hashable], blocks: Sequence[Sequence[int]],
            world: int) -> tuple[int, ...]:
    """The device order giving pipeline rank p a block of kind ``sequence[p]`` (``kinds[p]``: the kind of block p,
    ``blocks[p]`` its devices, ascending): blocks of one kind handed out in ascending order; position ``i`` of block
    p's devices maps to position ``i`` of the chosen block's, so every group's devices stay ascending."""
    free = {kind: [b for b, k in zip(blocks, kinds) if k == kind] for kind in set(kinds)}
    order = [0] * world
    for p, kind in enumerate(sequence):
        chosen = free[kind].pop(0)
        for position, device in zip(blocks[p], chosen):
            order[position] = device
    return tuple(order)
