"""Concurrent point-to-point transfers on a topology's routes: the flow model that collectives are costed with.

A **phase** is a set of transfers that run together, each repeated ``steps`` times back to back; each transfer
follows :meth:`sim.hw.topology.Topology.path` and belongs to one group (one instance of a collective). Within a
phase every link l carries ``load_l`` bytes per step, the sum over all transfers (of all groups) that cross it. A
transfer's bandwidth term is ``max over its links of load_l / bandwidth_l`` (s): with c equal flows on a link that is
each flow getting bandwidth / c, and with unequal flows it is when the last of them finishes under fair sharing (the
link is busy until all its bytes are through). Its latency is the sum of its links' latencies (s). Transfers that
form a pipelined route (a chain or a tree streamed through in small chunks, each transfer naming the one before it)
cost ``Σ latency + max bandwidth term`` along the route; independent ones cost their own. A group's time for a
phase is ``steps x`` its worst route; its total is the sum over phases; the result is the slowest group. (A group
that finishes a phase early does not free its links for the others: conservative.)

Speed: a 512-GPU plan has up to 512 ranks in concurrent groups of up to 64 and the engine asks about each distinct
collective once, so transfers are evaluated as numpy arrays (a row of link indices per route, loads by
``bincount``, pipelined routes by pointer jumping), and each topology's routes are kept between calls
(:func:`route_table`). The work is O(links crossed) per phase.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np

from sim.hw.topology import Topology

__all__ = ["LinkKey", "Transfers", "Phase", "Carried", "RouteTable", "route_table", "evaluate", "link_bytes"]

LinkKey = tuple[str, str]


@dataclass(frozen=True)
class Transfers:
    """Transfers that run together, ``steps`` times back to back, each moving ``nbytes`` bytes per step.

    Attributes:
        edges: (E, 3) ints: source rank, destination rank, index in ``edges`` of the transfer before it on its
            pipelined route or -1.
        group: (E,) ints: the group each transfer belongs to.
        nbytes: bytes each transfer moves per step.
        steps: how many times the transfers repeat.
        pipelined: True when some transfer names a predecessor.
    """

    edges: np.ndarray
    group: np.ndarray
    nbytes: float
    steps: int
    pipelined: bool = False


#: One phase: transfer sets that run at the same time.
Phase = list[Transfers]

#: What the links carry: (link indices of each transfer's route (E, width), its bytes over all steps (E,)) pairs.
Carried = list[tuple[np.ndarray, np.ndarray]]


class RouteTable:
    """One topology's routes as arrays: row r of ``links`` holds the link indices of one (source, destination)
    route, padded with 0, a placeholder link of infinite bandwidth; ``latency[r]`` is its Σ latency (s). Link i has
    ``bandwidth()[i]`` (bytes/s) and key ``keys[i]``. Filled on demand from :meth:`Topology.path`."""

    def __init__(self, topology: Topology) -> None:
        self.topology = weakref.ref(topology)  # not the topology itself: the cache must not keep it alive
        self.num_ranks = topology.num_ranks
        self.row_of: dict[int, int] = {}  # source * num_ranks + destination → row
        self.links = np.zeros((64, 4), dtype=np.int64)
        self.latency = np.zeros(64)
        self.index_of: dict[int, int] = {}  # id(link) → index; paths share the graph's Link objects
        self.keys: list[LinkKey] = [("", "")]
        self._bandwidths: list[float] = [math.inf]
        self._bandwidth_array = np.array(self._bandwidths)
        self._key_order = np.zeros(1, dtype=np.int64)

    def rows(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The route row of each transfer ``src[i]`` → ``dst[i]``."""
        codes = (src * self.num_ranks + dst).tolist()
        rows = list(map(self.row_of.get, codes))
        if None in rows:
            for code in dict.fromkeys(c for c, r in zip(codes, rows, strict=True) if r is None):
                self._add(code)
            rows = list(map(self.row_of.__getitem__, codes))
        return np.array(rows, dtype=np.int64)

    def _add(self, code: int) -> None:
        topology = self.topology()
        assert topology is not None  # route_table hands out only the routes of a live topology
        path = topology.path(*divmod(code, self.num_ranks))
        row = len(self.row_of)
        more_rows = len(self.latency) if row == len(self.latency) else 0  # doubling: amortised O(1) per route
        more_columns = max(0, len(path) - self.links.shape[1])
        if more_rows or more_columns:
            self.links = np.pad(self.links, ((0, more_rows), (0, more_columns)))
            self.latency = np.pad(self.latency, (0, more_rows))
        for column, link in enumerate(path):
            if id(link) not in self.index_of:
                self.index_of[id(link)] = len(self.keys)
                self.keys.append((link.src, link.dst))
                self._bandwidths.append(link.spec.bandwidth)
            self.links[row, column] = self.index_of[id(link)]
        self.latency[row] = sum(link.spec.latency for link in path)
        self.row_of[code] = row

    def key_order(self) -> np.ndarray:
        """Each link index's rank when the known links are sorted by key."""
        if len(self._key_order) != len(self.keys):
            self._key_order = np.empty(len(self.keys), dtype=np.int64)
            self._key_order[sorted(range(len(self.keys)), key=self.keys.__getitem__)] = np.arange(len(self.keys))
        return self._key_order

    def bandwidth(self) -> np.ndarray:
        """Bandwidth of each link index (bytes/s); index 0 is the placeholder (infinite)."""
        if len(self._bandwidth_array) != len(self._bandwidths):
            self._bandwidth_array = np.array(self._bandwidths)
        return self._bandwidth_array


# id(topology) → (weak reference to it, its routes); an entry leaves when its topology is collected, so an id that
# Python reuses for a new topology never finds the old routes
_TABLES: dict[int, tuple[weakref.ref[Topology], RouteTable]] = {}


def route_table(topology: Topology) -> RouteTable:
    """The :class:`RouteTable` of ``topology``, kept while the topology lives."""
    entry = _TABLES.get(id(topology))
    if entry is not None and entry[0]() is topology:
        return entry[1]
    key = id(topology)
    table = RouteTable(topology)
    _TABLES[key] = (weakref.ref(topology, lambda _: _TABLES.pop(key, None)), table)
    return table


def link_bytes(table: RouteTable, carried: Carried) -> tuple[list[LinkKey], list[int]]:
    """The keys of every link some transfer of ``carried`` crosses, sorted, and the bytes each carries in total
    (rounded to whole bytes)."""
    size = len(table.keys)
    crossings = np.zeros(size)
    total = np.zeros(size)
    for links, weights in carried:
        crossings += np.bincount(links.ravel(), minlength=size)
        total += np.bincount(links.ravel(), weights=np.repeat(weights, links.shape[1]), minlength=size)
    crossed = np.flatnonzero(crossings[1:]) + 1  # index 0 is the placeholder
    crossed = crossed[np.argsort(table.key_order()[crossed])]
    return [table.keys[i] for i in crossed.tolist()], np.rint(total[crossed]).astype(np.int64).tolist()


def evaluate(routes: RouteTable, plans: list[Phase], groups: int, bound: float = math.inf
              ) -> tuple[float, Carried]:
    """(slowest group's time in s, [(link indices of each transfer, its bytes over all steps)]) of ``plans`` for
    ``groups`` groups; stops early, with a time >= ``bound``, once some group reaches ``bound`` (a plan as fast
    exists)."""
    carried: Carried = []
    group_time = np.zeros(groups)
    # the same phase again (ring all_reduce's two halves, hierarchical's intra and inter levels) costs the same
    seen: dict[tuple[int, ...], tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]] = {}
    for phase in plans:
        signature = tuple(map(id, phase))
        if signature not in seen:
            seen[signature] = _evaluate_phase(routes, phase, groups)
        times, phase_carried = seen[signature]
        group_time += times
        carried.append(phase_carried)
        if group_time.max(initial=0.0) >= bound:
            break
    return float(group_time.max(initial=0.0)), carried


def _evaluate_phase(routes: RouteTable, phase: Phase, groups: int
                    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """(each group's time for the phase, all steps, in s; (link indices of each transfer, its bytes over all
    steps))."""
    times = np.zeros(groups)
    parts = [part for part in phase if part.steps]
    if not parts:
        return times, (np.zeros((0, 1), dtype=np.int64), np.zeros(0))
    sizes = [len(part.edges) for part in parts]
    offsets = np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
    edges = np.concatenate([part.edges for part in parts])
    rows = routes.rows(edges[:, 0], edges[:, 1])
    links, latency = routes.links[rows], routes.latency[rows]  # copies: fancy indexing
    nbytes = np.repeat([part.nbytes for part in parts], sizes)
    steps = np.repeat([part.steps for part in parts], sizes)
    load = np.bincount(links.ravel(), weights=np.repeat(nbytes, links.shape[1]), minlength=len(routes.keys))
    transfer = (load / routes.bandwidth())[links].max(axis=1)  # s per step: the route's most loaded link
    if any(part.pipelined for part in parts):
        # a pipelined route costs Σ latency + its worst transfer from its start to each edge: pointer jumping
        # (each round adds the predecessor's partial route and jumps to the predecessor's predecessor)
        prev = np.where(edges[:, 2] >= 0, edges[:, 2] + offsets, -1)
        while (has := prev >= 0).any():
            before = prev[has]  # every right-hand side below is read before its array is written
            latency[has] += latency[before]
            transfer[has] = np.maximum(transfer[has], transfer[before])
            prev[has] = prev[before]
    np.maximum.at(times, np.concatenate([part.group for part in parts]), (latency + transfer) * steps)
    return times, (links, nbytes * steps)
