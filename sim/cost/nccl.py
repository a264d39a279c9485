"""NCCL's protocol latencies: what a GPU collective or message costs beyond moving its bytes over the links.

:mod:`sim.cost.collectives` times the bytes of a collective on the topology's links (their effective bandwidth and
per-hop wire latency). NCCL adds its own software latency, and it depends on the protocol it picks for the message
size: with LL (low latency) every 8-byte word carries 4 bytes of data and a 4-byte flag, so a step is cheap but
the bandwidth halves; with Simple, data moves at full bandwidth behind a costlier synchronisation per step. NCCL's
tuner (``src/graph/tuning.cc``) costs each protocol as ``base latency + steps × per-step latency of the link class
+ bytes / (bandwidth × protocol efficiency)`` and runs the cheapest; this module does the same on top of the link
time, with the tuner's figures:

* per ring step: NVLink 0.47 µs (LL), 3.4 µs (Simple); PCIe 1.0 / 5.7 µs; network 2.7 / 9.6 µs;
* base latency of a call: LL 3.6 µs, Simple 8.4 µs;

(``../shared/reference/hardware.md`` §2.5, NVIDIA/nccl ``src/graph/tuning.cc`` at commit 01afd20, NCCL 2.7 era;
later versions shift these by a few tenths of a µs and add LL128, which the reference does not give). A
collective's steps are its algorithm's: a ring all-reduce 2(n − 1), reduce-scatter, all-gather and broadcast
n − 1, a tree all-reduce 2⌈log₂ n⌉; a point-to-point message one. The link class is that of the slowest hop
between ring neighbours: the network when two of them sit in different servers, else PCIe when the route between
two of them crosses a PCIe link (a server wired by PCIe, or GPUs of a cube-mesh without an NVLink between them),
else NVLink.
"""

from __future__ import annotations

import math

from sim.hw.topology import Topology

__all__ = ["PROTOCOLS", "nccl_seconds", "link_class", "steps"]

#: Protocol → (base latency s, per-step latency s by link class, fraction of the link bandwidth carrying data).
PROTOCOLS: dict[str, tuple[float, dict[str, float], float]] = {
    "LL": (3.6e-6, {"nvlink": 0.47e-6, "pcie": 1.0e-6, "net": 2.7e-6}, 0.5),
    "Simple": (8.4e-6, {"nvlink": 3.4e-6, "pcie": 5.7e-6, "net": 9.6e-6}, 1.0),
}


def link_class(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> str:
    """The slowest link class between ring neighbours of any of ``groups`` (each in ring order; a pair for a
    message): ``"net"``, ``"pcie"`` or ``"nvlink"``; kept in the topology's memo."""
    key = ("link class", groups)
    found = topology.cost_memo.get(key)
    if found is None:
        found = topology.cost_memo[key] = _link_class(topology, groups)
    return found


def _link_class(topology: Topology, groups: tuple[tuple[int, ...], ...]) -> str:
    worst = "nvlink"
    for ranks in groups:
        pairs = list(zip(ranks, ranks[1:])) + ([(ranks[-1], ranks[0])] if len(ranks) > 2 else [])
        for src, dst in pairs:
            if topology.node_of_rank[src] != topology.node_of_rank[dst]:
                return "net"
            if any(link.spec.name.startswith("pcie") for link in topology.path(src, dst)):
                worst = "pcie"
    return worst


def steps(kind: str, algorithm: str, members: int) -> int:
    """Sequential steps of collective ``kind`` (or ``"p2p"``) by ``algorithm`` over ``members`` ranks."""
    if kind == "p2p":
        return 1
    if members <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * math.ceil(math.log2(members)) if algorithm == "tree" else 2 * (members - 1)
    return members - 1


def nccl_seconds(link_seconds: float, kind: str, algorithm: str, members: int, klass: str) -> float:
    """Time in s of one NCCL call whose bytes take ``link_seconds`` on the links at full bandwidth: the cheapest
    protocol's ``base + steps × step latency + link_seconds / efficiency``; 0 when nothing moves."""
    count = steps(kind, algorithm, members)
    if count == 0 or link_seconds <= 0:
        return 0.0
    return min(base + count * per_step[klass] + link_seconds / efficiency
               for base, per_step, efficiency in PROTOCOLS.values())
