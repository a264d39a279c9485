"""The last step of :meth:`sim.hw.topology.Topology.parse`: a topology's servers (:mod:`sim.hw.servers`) become its
link graph.

:func:`build_graph` turns the servers' :class:`~sim.hw.node_shapes.NodeShape` list into a ``networkx.DiGraph`` whose
edges carry one directed :class:`Link` each.

Graph nodes: ``gpu{r}`` (rank r), ``host{n}`` (host memory and PCIe root of server n), ``nvswitch{n}``, ``nic{n}``
(the aggregated NIC ports of server n), ``nic{n}.{i}`` (the own NIC of the i-th GPU of server n, where each GPU has
one) and ``fabric`` (the non-blocking network between servers). Every physical link is full duplex and appears as two
:class:`Link` objects, one per direction. A graph node with attribute ``transit=False`` is an endpoint that routes
never cross (:mod:`sim.hw.topology`): the host of a GH200 server, whose GPUs reach their Grace CPU memory over
NVLink-C2C; peer traffic there takes the NVLink mesh (NCCL does), not a detour through host memory.

Each server's GPUs are joined as its ``intra`` wiring says (:mod:`sim.hw.node_shapes`): the DGX-1 pairs of a
cube-mesh, one link each to ``nvswitch{n}``, nothing but the host under ``pcie``, or a link per pair in a full mesh.

Every GPU also has its device's ``host_link`` (PCIe x16, or NVLink-C2C on a GH200) to ``host{n}``. Between servers,
each GPU reaches ``nic{n}`` over a second link of its ``host_link`` type (GPUDirect RDMA through the PCIe switch; the
model does not make network traffic share bandwidth with host copies), and ``nic{n}`` reaches ``fabric`` over one link
whose bandwidth is the NIC port bandwidth × the number of ports (:func:`aggregate`). Where the source says each GPU
has its own NIC and the host link is faster than the port (GH200: one Slingshot-11 NIC per superchip), GPU i has its
own ``nic{n}.{i}`` with one port instead, so one GPU's message cannot use its neighbours' NICs: on an Alps GH200 node a
single GPU pair across nodes moved 22.9 GB/s and four pairs 92.6 GB/s (the sources in ``links.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import networkx as nx

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec, LinkSpec, get_link, slowed_device
from sim.hw.description import MAX_RANKS
from sim.hw.node_shapes import C2C_HOSTED, DGX1_NVLINK_PAIRS, IDEAL_MAX, NodeShape, mesh_link, switch_link

__all__ = ["Link", "aggregate", "build_graph"]


@dataclass(frozen=True)
class Link:
    """One directed link instance (a full-duplex link is two of these, one per direction).

    Attributes:
        src: graph node the data leaves, e.g. ``"gpu0"``, ``"host1"``, ``"nic0"``.
        dst: graph node the data enters.
        spec: the link type (bandwidth in bytes/s, latency in s).
    """

    src: str
    dst: str
    spec: LinkSpec



def aggregate(link: LinkSpec, count: int) -> LinkSpec:
    """``count`` parallel ports of ``link`` as one link: ``count`` × the bandwidths, the same latency (s)."""
    if count == 1:
        return link
    return LinkSpec(
        name=f"{link.name}-x{count}",
        bandwidth=link.bandwidth * count,
        latency=link.latency,
        spec_bandwidth=link.spec_bandwidth * count,
        source=f"{count} x {link.name} ports as one link [derived]; {link.source}",
    )


def _add_duplex(graph: nx.DiGraph, a: str, b: str, spec: LinkSpec) -> None:
    graph.add_edge(a, b, link=Link(a, b, spec))
    graph.add_edge(b, a, link=Link(b, a, spec))


def build_graph(shapes: list[NodeShape]) -> tuple[nx.DiGraph, tuple[DeviceSpec, ...], tuple[int, ...]]:
    """The link graph of servers ``shapes`` (ranks numbered server by server).

    Returns:
        ``(graph, device of each rank, server of each rank)``; each edge has attribute ``link`` (a :class:`Link`).
    """
    devices = tuple(slowed_device(s.device, s.slowdown[i]) if s.slowdown else s.device
                    for s in shapes for i in range(s.count))
    node_of_rank = tuple(n for n, s in enumerate(shapes) for _ in range(s.count))
    all_ideal = all(s.device.name == "ideal" for s in shapes)
    limit = IDEAL_MAX if all_ideal else MAX_RANKS
    if len(devices) > limit:
        raise SpecError(f"at most {limit} ranks are supported here, got {len(devices)}")
    graph = nx.DiGraph()
    graph.add_nodes_from(f"gpu{r}" for r in range(len(devices)))
    ideal = get_link("ideal")
    first = 0
    for n, shape in enumerate(shapes):
        ranks = range(first, first + shape.count)
        first += shape.count
        host_link = get_link(shape.device.host_link)
        for r in ranks:
            _add_duplex(graph, f"gpu{r}", f"host{n}", host_link)
        if shape.device.name in C2C_HOSTED:
            graph.nodes[f"host{n}"]["transit"] = False
        if shape.intra == "cube-mesh":
            for (i, j), links in DGX1_NVLINK_PAIRS.items():
                if i < shape.count and j < shape.count:
                    _add_duplex(graph, f"gpu{ranks[i]}", f"gpu{ranks[j]}", get_link(f"nvlink2-x{links}"))
        elif shape.intra == "nvswitch":
            switch = switch_link(shape.device)
            for r in ranks:
                _add_duplex(graph, f"gpu{r}", f"nvswitch{n}", switch)
        elif shape.intra == "full-mesh" and not all_ideal:
            pair = mesh_link(shape.device)
            for a, b in combinations(ranks, 2):
                _add_duplex(graph, f"gpu{a}", f"gpu{b}", pair)
        if len(shapes) > 1 and not all_ideal:
            if shape.nic_per_gpu:  # nics == count (unify_network refuses anything else)
                for i, r in enumerate(ranks):
                    _add_duplex(graph, f"gpu{r}", f"nic{n}.{i}", host_link)
                    _add_duplex(graph, f"nic{n}.{i}", "fabric", shape.network)
            else:
                for r in ranks:
                    _add_duplex(graph, f"gpu{r}", f"nic{n}", host_link)
                _add_duplex(graph, f"nic{n}", "fabric", aggregate(shape.network, shape.nics))
    if all_ideal:  # every pair of ranks, across servers too, has its own ideal link
        for a, b in combinations(range(len(devices)), 2):
            _add_duplex(graph, f"gpu{a}", f"gpu{b}", ideal)
    return graph, devices, node_of_rank
