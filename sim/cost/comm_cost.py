"""What one communication op of a plan costs in a cost view (:class:`CommCost`), and the cost of collectives run
one after another (:func:`sequential_cost`): the numbers :class:`sim.cost.cost_view.CostView` hands the engine and
the search, apart from the view that asks the oracle for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from sim.cost.collectives import CollectiveCost
from sim.cost.flows import LinkKey

__all__ = ["CommCost", "sequential_cost"]


@dataclass(frozen=True)
class CommCost:
    """What one communication op of a plan costs in a cost view: a message (SEND/RECV) or a collective.

    The view costs the op with every symmetric instance that runs at the same moment (the tensor shards of a stage,
    the concurrent replicas), so ``seconds`` includes their sharing of links; the engine simulates one instance, which
    holds only its own links.

    Attributes:
        nbytes: bytes of the simulated instance's buffer (a collective's: its buffers summed over the collectives it
            runs one after another), bytes.
        seconds: uncontended duration, s.
        held_links: sorted ``(src, dst)`` keys of the links the engine holds while the op runs (the simulated
            instance's own path or group).
        carried: what the links carry, as ``(((src, dst), bytes) per link, times)`` of the collectives or message
            run one after another; :attr:`bytes_per_link` merges them when first asked (a search's screen reads
            ``seconds`` only).
    """

    nbytes: int
    seconds: float
    held_links: tuple[LinkKey, ...]
    carried: tuple[tuple[tuple[tuple[LinkKey, int], ...], int], ...] = field(repr=False)

    @cached_property
    def bytes_per_link(self) -> tuple[tuple[LinkKey, int], ...]:
        """``((src, dst), bytes)`` per link, sorted, all instances together: what the links carry, bytes (the name and
        meaning of :attr:`sim.cost.collectives.CollectiveCost.bytes_per_link`)."""
        if len(self.carried) == 1:  # one collective or message, its links already in order
            links, times = self.carried[0]
            return links if times == 1 else tuple((key, carried * times) for key, carried in links)
        merged: dict[LinkKey, int] = {}
        for links, times in self.carried:
            for key, carried in links:
                merged[key] = merged.get(key, 0) + carried * times
        return tuple(sorted(merged.items()))


def sequential_cost(parts: list[tuple[CollectiveCost, int, int]], held: tuple[LinkKey, ...]) -> CommCost:
    """The cost of collectives run one after another, holding ``held``: ``parts`` is ``(CollectiveCost, times,
    buffer bytes)``."""
    nbytes, seconds = 0, 0.0
    for cost, times, buffer in parts:
        seconds += cost.seconds * times
        nbytes += buffer * times
    return CommCost(nbytes, seconds, held, tuple((cost.bytes_per_link, times) for cost, times, _ in parts))
