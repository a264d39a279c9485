"""Cluster topology: which device each rank is, and the links data crosses between ranks and host memory.

``Topology.parse(spec)`` reads a compact spec (``8xV100``, ``2x8xA100``, ``4xV100+4xA100``, ``dgx-h100``,
``4xideal``, or a YAML file; grammar and file schema in :mod:`sim.hw.grammar`) into a frozen object whose
``str()`` is ``spec`` again, in three steps that each go one way: the text is read into a description
(:mod:`sim.hw.grammar`, :class:`~sim.hw.description.ClusterDescription`), the description into its servers
(:mod:`sim.hw.servers`), and the servers into their link graph (:mod:`sim.hw.link_graph`): a
``networkx.DiGraph`` of GPUs, host memories, NVSwitches, NICs and the network fabric, with one directed
:class:`Link` per edge (attribute ``"link"``).

Routing. A message from rank a to rank b follows the cheapest path by the reference cost
``Σ (latency + 1 MiB / bandwidth)`` over its hops (s), ties broken by fewer hops, then by the lexicographically
smaller sequence of node names. A GPU is an endpoint only, never an intermediate hop, and so is any graph node with
attribute ``transit=False`` (the Grace host memory of a GH200 server, :mod:`sim.hw.link_graph`). Paths are computed once
per source (Dijkstra) and cached, so :meth:`Topology.path` is a dictionary lookup after the first call.

Transfer model. A message is cut-through: it occupies every link of its path for its whole duration, and that
duration, without contention, is::

    transfer_time(nbytes) = Σ_hops latency + nbytes / min_hops bandwidth        (s; bytes; bytes/s)

It is 0 between a rank and itself and on an ideal topology (zero latency, infinite bandwidth). The engine models
contention by holding each link of the path as a resource; uncontended, it reproduces this closed form exactly
(:func:`message_time`).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import networkx as nx

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec
from sim.hw.grammar import format_topology_list, parse_description
from sim.hw.link_graph import Link, build_graph
from sim.hw.node_shapes import DGX1_NVLINK_PAIRS, NodeShape, mesh_link
from sim.hw.servers import server_shapes

__all__ = ["Link", "Topology", "format_topology_list", "message_time", "REFERENCE_BYTES"]

#: Message size used to rank candidate paths by time (bytes).
REFERENCE_BYTES = 2**20


def message_time(links: tuple[Link, ...], nbytes: float) -> float:
    """Uncontended cut-through time of ``nbytes`` bytes over ``links``: Σ latency + nbytes / min bandwidth (s)."""
    if not links:
        return 0.0
    latency = sum(link.spec.latency for link in links)
    return latency + nbytes / min(link.spec.bandwidth for link in links)


def _hop_cost(link: Link) -> float:
    return link.spec.latency + REFERENCE_BYTES / link.spec.bandwidth


#: The graph node where servers meet (:mod:`sim.hw.link_graph`).
_FABRIC = "fabric"


class _Reach(NamedTuple):
    """A node as a path search reached it: the path's label (cost, hops, names joined by NUL) and its links."""

    cost: float
    hops: int
    names: str
    links: tuple[Link, ...]

    @property
    def label(self) -> tuple[float, int, str]:
        return self.cost, self.hops, self.names


@dataclass(frozen=True)
class Topology:
    """A parsed cluster: the device of each rank, the server of each rank, and the link graph.

    Attributes:
        spec: the exact string it was parsed from; ``str(topology)`` returns it.
        devices: the device of each rank; rank r is graph node ``"gpu{r}"``.
        node_of_rank: the server index of each rank.
        graph: directed link graph; every edge has attribute ``"link"``, a :class:`Link`.
        nodes: the servers, in order (wiring, device, NIC ports).
    """

    spec: str
    devices: tuple[DeviceSpec, ...]
    node_of_rank: tuple[int, ...]
    graph: nx.DiGraph = field(compare=False, repr=False)
    nodes: tuple[NodeShape, ...] = field(default=(), compare=False, repr=False)
    _adjacency: dict[str, list[tuple[str, Link, float]]] = field(init=False, compare=False, repr=False)
    _endpoints: frozenset[str] = field(init=False, compare=False, repr=False)
    _trees: dict[tuple[str, str | None], dict[str, _Reach]] = field(default_factory=dict, init=False, compare=False,
                                                                    repr=False)
    _paths: dict[tuple[int, int], tuple[Link, ...]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _link_keys: dict[tuple[int, int], tuple[tuple[str, str], ...]] = field(default_factory=dict, init=False,
                                                                           compare=False, repr=False)
    #: Results of pure functions of this topology (:mod:`sim.cost.collectives`' collective and transfer costs), kept
    #: for every plan costed on it: a search asks the same few thousand of them for every candidate.
    cost_memo: dict[tuple, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        adjacency: dict[str, list[tuple[str, Link, float]]] = {node: [] for node in self.graph.nodes}
        for src, dst, link in self.graph.edges(data="link"):
            adjacency[src].append((dst, link, _hop_cost(link)))
        for edges in adjacency.values():
            edges.sort(key=lambda edge: edge[0])
        object.__setattr__(self, "_adjacency", adjacency)
        endpoints = {node for node in self.graph.nodes if node.startswith("gpu")}
        endpoints |= {node for node, transit in self.graph.nodes(data="transit", default=True) if not transit}
        object.__setattr__(self, "_endpoints", frozenset(endpoints))

    @classmethod
    def parse(cls, spec: str) -> Topology:
        """Parse a topology spec (grammar in :mod:`sim.hw.grammar`).

        Raises:
            SpecError: a malformed spec, unknown device or preset, impossible server, or bad YAML file; the message
                contains the offending text.
        """
        shapes = server_shapes(parse_description(spec))
        graph, devices, node_of_rank = build_graph(shapes)
        return cls(spec=spec, devices=devices, node_of_rank=node_of_rank, graph=graph, nodes=tuple(shapes))

    def __str__(self) -> str:
        return self.spec

    @property
    def num_ranks(self) -> int:
        """Number of ranks (GPUs)."""
        return len(self.devices)

    @property
    def is_ideal(self) -> bool:
        """True when every link has zero latency and infinite bandwidth (all transfers take 0 s)."""
        return all(link.spec.latency == 0 and math.isinf(link.spec.bandwidth) for link in self.links())

    def _rank(self, rank: int) -> int:
        try:
            index = operator.index(rank)
        except TypeError:
            raise SpecError(f"rank must be an integer, got {rank!r}") from None
        if not 0 <= index < len(self.devices):
            raise SpecError(f"rank {rank!r} out of range for {self.spec!r} ({len(self.devices)} ranks)")
        return index

    def _tree(self, source: str, barrier: str | None = None) -> dict[str, _Reach]:
        """Cheapest path from ``source`` to every graph node (Dijkstra; ties: fewer hops, then node names), each with
        its label; ``barrier``: a node reached but not expanded (the fabric, see :meth:`_route`).

        A label is ``(cost, hops, names)`` with ``names`` the path's node names joined by NUL: NUL sorts before every
        character of a name, so comparing joined strings orders paths as comparing their name tuples would, for a
        fraction of the cost. Each node keeps the link it was reached by; its path is its predecessor's plus that link.
        """
        key = (source, barrier)
        tree = self._trees.get(key)
        if tree is not None:
            return tree
        tree = {}
        endpoints, adjacency = self._endpoints, self._adjacency
        heap: list[tuple[float, int, str, str, str, Link | None]] = [(0.0, 0, source, source, "", None)]
        best: dict[str, tuple[float, int, str]] = {source: (0.0, 0, source)}  # best label pushed per node
        # Endpoints never forward, so they need no place in the heap: each keeps its best offer (label, predecessor,
        # link) while routers are settled, and is settled after them. Most nodes are GPUs, so this skips most pushes.
        leaves: dict[str, tuple[tuple[float, int, str], str, Link]] = {}
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            cost, hops, names, node, previous, link = pop(heap)
            if node in tree:
                continue
            tree[node] = _Reach(cost, hops, names, tree[previous].links + (link,) if link is not None else ())
            if node == barrier:
                continue
            hops += 1
            for neighbour, next_link, hop_cost in adjacency[node]:
                if neighbour in tree:
                    continue
                reach = cost + hop_cost
                leaf = neighbour in endpoints
                known = leaves[neighbour][0] if leaf and neighbour in leaves else best.get(neighbour)
                # The names string is built only when the label can win: it is new, cheaper, or tied.
                if known is not None and (reach > known[0] or (reach == known[0] and hops >= known[1])):
                    if reach != known[0] or hops != known[1]:
                        continue
                label = (reach, hops, f"{names}\0{neighbour}")
                if known is not None and label >= known:
                    continue
                if leaf:
                    leaves[neighbour] = (label, node, next_link)
                else:
                    best[neighbour] = label
                    push(heap, (*label, neighbour, node, next_link))
        for leaf, (label, previous, link) in leaves.items():
            tree[leaf] = _Reach(*label, tree[previous].links + (link,))
        self._trees[key] = tree
        return tree

    def _route(self, src: str, dst: str) -> tuple[Link, ...]:
        """The cheapest path from ``src`` to ``dst`` (:meth:`_tree`'s order).

        Servers meet only at the ``fabric`` node (:mod:`sim.hw.link_graph`): every path from one server to another
        crosses it once. So the cheapest path is the better of the one that stays on ``src``'s side (a tree that stops
        at the fabric, a server's few nodes) and the cheapest path to the fabric followed by the fabric's cheapest path
        to ``dst`` (one tree for the whole cluster). Each part is the cheapest of its own (cost, then hops, then names),
        so their concatenation is the cheapest crossing path, labelled as one search would label it; without this,
        every source would search the whole cluster (16,384 GPUs: hours).
        """
        barrier = _FABRIC if _FABRIC in self._adjacency and _FABRIC not in (src, dst) else None
        local = self._tree(src, barrier)
        found = local.get(dst)
        if barrier is not None:
            near = local.get(barrier)
            far = self._tree(barrier).get(dst) if near is not None else None
            if near is not None and far is not None:
                cost = near.cost
                for link in far.links:  # in path order, as a search would add them
                    cost += _hop_cost(link)
                crossing = _Reach(cost, near.hops + far.hops, near.names + far.names[len(barrier):],
                                  near.links + far.links)
                if found is None or crossing.label < found.label:
                    found = crossing
        if found is None:  # build_graph connects every node; this is an internal invariant
            raise AssertionError(f"no path from {src} to {dst} in {self.spec!r}")
        return found.links

    def path(self, src_rank: int, dst_rank: int) -> tuple[Link, ...]:
        """The links a message from ``src_rank`` to ``dst_rank`` crosses, in order; ``()`` when they are equal.

        Raises:
            SpecError: a rank is not an integer in ``range(num_ranks)``.
        """
        cached = self._paths.get((src_rank, dst_rank))
        if cached is not None:
            return cached
        src, dst = self._rank(src_rank), self._rank(dst_rank)
        links = () if src == dst else self._route(f"gpu{src}", f"gpu{dst}")
        self._paths[src, dst] = links
        return links

    def link_keys(self, src_rank: int, dst_rank: int) -> tuple[tuple[str, str], ...]:
        """The ``(src, dst)`` names of the links :meth:`path` crosses, sorted: how the engine names the links a
        message holds; cached (every pipeline message of a search asks).

        Raises:
            SpecError: a rank is not an integer in ``range(num_ranks)``.
        """
        cached = self._link_keys.get((src_rank, dst_rank))
        if cached is None:
            cached = self._link_keys[src_rank, dst_rank] = tuple(sorted((link.src, link.dst)
                                                                        for link in self.path(src_rank, dst_rank)))
        return cached

    def host_to_device_path(self, rank: int) -> tuple[Link, ...]:
        """Links from the host memory of ``rank``'s server to ``rank`` (the H2D copy-engine direction)."""
        index = self._rank(rank)
        return self._route(f"host{self.node_of_rank[index]}", f"gpu{index}")

    def device_to_host_path(self, rank: int) -> tuple[Link, ...]:
        """Links from ``rank`` to the host memory of its server (the D2H copy-engine direction)."""
        index = self._rank(rank)
        return self._route(f"gpu{index}", f"host{self.node_of_rank[index]}")

    def link_names(self) -> tuple[str, ...]:
        """The link types of the graph, sorted (what ``sim.run --straggler LINK:FACTOR`` may name)."""
        return tuple(sorted({link.spec.name for _, _, link in self.graph.edges(data="link")}))

    def with_slowed_links(self, selector: str, factor: float) -> Topology:
        """This topology with the links ``selector`` names ``factor`` times slower (bandwidth divided by it): every
        link of a type (``nvswitch-h100``), or every link into and out of one device (its node, ``gpu5``; the command
        line spells it ``gpu5-links``, ``gpu5`` being the device's compute there). The spec string
        stays (a plan records it); the graph is new, so a cost oracle must be built for the result.

        Raises:
            SpecError: a selector that names no link of this topology.
        """
        def chosen(src: str, dst: str, link: Link) -> bool:
            return selector in (src, dst) if selector.startswith("gpu") else link.spec.name == selector

        graph = self.graph.copy()
        hits = 0
        for src, dst, link in self.graph.edges(data="link"):
            if chosen(src, dst, link):
                slowed = replace(link.spec, bandwidth=link.spec.bandwidth / factor)
                graph[src][dst]["link"] = Link(link.src, link.dst, slowed)
                hits += 1
        if not hits:
            last = self.num_ranks - 1
            raise SpecError(f"--straggler {selector}:{factor:g}: no link of {self.spec} is {selector!r}; name a link "
                            f"type ({', '.join(self.link_names())}), a device's links (gpu0-links..gpu{last}-links) "
                            f"or a device's compute (0..{last} or gpu0..gpu{last})")
        return Topology(self.spec, self.devices, self.node_of_rank, graph, self.nodes)

    def links(self) -> tuple[Link, ...]:
        """Every directed link, in construction order (deterministic for a given spec)."""
        return tuple(link for _, _, link in self.graph.edges(data="link"))

    def transfer_time(self, nbytes: float, src_rank: int, dst_rank: int) -> float:
        """Uncontended time to move ``nbytes`` bytes from ``src_rank`` to ``dst_rank`` (s).

        ``Σ latency + nbytes / min bandwidth`` over :meth:`path` (the module's transfer model); 0 for the same rank.

        Raises:
            SpecError: ``nbytes`` is negative or not finite, or a rank is out of range.
        """
        if not (isinstance(nbytes, int | float) and math.isfinite(nbytes) and nbytes >= 0):
            raise SpecError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
        return message_time(self.path(src_rank, dst_rank), nbytes)

    def describe(self) -> str:
        """A multi-line human description: servers (shape, device, ranks), link kinds with counts and GB/s."""
        servers = len(self.nodes)
        lines = [f"topology {self.spec}: {self.num_ranks} ranks on {servers} server{'s' * (servers != 1)}"]
        start = 0
        groups: list[tuple[NodeShape, int, int]] = []  # (shape, first server, first rank) of runs of equal servers
        for n, shape in enumerate(self.nodes):
            if not groups or groups[-1][0] != shape:
                groups.append((shape, n, start))
            start += shape.count
        for i, (shape, first, rank) in enumerate(groups):
            last = groups[i + 1][1] - 1 if i + 1 < len(groups) else servers - 1
            last_rank = (groups[i + 1][2] if i + 1 < len(groups) else self.num_ranks) - 1
            label = f"server {first}" if first == last else f"servers {first}-{last} ({last - first + 1} x)"
            preset = f" [{shape.preset}]" if shape.preset else ""
            lines.append(
                f"  {label}: {shape.count} x {shape.device.name}{preset}, {_wiring(shape)}; ranks {rank}-{last_rank}"
            )
        slowed = [f"rank {r} x{d.slowdown:g} ({d.name})" for r, d in enumerate(self.devices) if d.base is not None]
        if slowed:
            lines.append(f"  slowed devices (each compute op takes FACTOR times its catalog device's time): "
                         f"{', '.join(slowed)}")
        if servers > 1 and not all(s.device.name == "ideal" for s in self.nodes):
            port = self.nodes[0].network
            nics = sorted({s.nics for s in self.nodes})
            own = sorted({s.device.name for s in self.nodes if s.nic_per_gpu})
            lines.append(
                f"  network: {port.name} ({_gbs(port.bandwidth)} effective / {_gbs(port.spec_bandwidth)} spec "
                f"per port), {'/'.join(map(str, nics))} port(s) per server, non-blocking fabric; "
                "GPUs reach the NICs over their host link" + (f"; one NIC per GPU on {', '.join(own)}" if own else "")
            )
        lines.append("  links (full duplex; per direction: count, effective / spec bandwidth, latency per hop):")
        counts = Counter(link.spec for link in self.links())
        for spec, count in sorted(counts.items(), key=lambda item: item[0].name):
            lines.append(
                f"    {spec.name:<16} {count // 2:>5} x {_gbs(spec.bandwidth):>12} / {_gbs(spec.spec_bandwidth):<12}"
                f" {spec.latency * 1e6:g} us"
            )
        return "\n".join(lines)


def _gbs(bandwidth: float) -> str:
    return "inf" if math.isinf(bandwidth) else f"{bandwidth / 1e9:g} GB/s"


def _wiring(shape: NodeShape) -> str:
    if shape.intra == "cube-mesh":
        pairs = [k for (i, j), k in DGX1_NVLINK_PAIRS.items() if i < shape.count and j < shape.count]
        unlinked = shape.count * (shape.count - 1) // 2 - len(pairs)
        return (
            f"DGX-1 hybrid cube-mesh NVLink ({pairs.count(2)} pairs x2, {pairs.count(1)} pairs x1, "
            f"{unlinked} pairs through host PCIe)"
        )
    if shape.intra == "nvswitch":
        return "NVSwitch all-to-all"
    if shape.intra == "pcie":
        return "PCIe only (GPU to GPU through the host)"
    return f"every pair on its own {mesh_link(shape.device).name} link"
