"""NCCL's cost of one call, written out for the closed forms of the cost and engine tests.

NCCL's tuner (``src/graph/tuning.cc``; ``sim.cost.nccl`` cites it) costs a call under each protocol as
``base latency + steps × per-step latency of the link class + link time / protocol efficiency`` and runs the
cheapest. The tests state the steps (a ring all-reduce over n ranks 2(n − 1), a point-to-point message 1) and the
link class (``nvlink``, ``pcie`` or ``net``) of each case by hand, compute the link time from the topology's
closed form, and read only the tuner's figures from the product.
"""

from sim.cost.nccl import PROTOCOLS


def nccl_call_s(link_s: float, steps: int, klass: str) -> float:
    """Seconds of one NCCL call of ``steps`` sequential steps over links of class ``klass`` whose bytes take
    ``link_s`` seconds at full bandwidth: the cheapest protocol."""
    return min(base + steps * per_step[klass] + link_s / efficiency
               for base, per_step, efficiency in PROTOCOLS.values())


def route_class(topology, src: int, dst: int) -> str:
    """The link class NCCL's tuner uses between two ranks: the network across servers, PCIe when their route crosses
    a PCIe link, else NVLink."""
    if topology.node_of_rank[dst] != topology.node_of_rank[src]:
        return "net"
    return "pcie" if any(link.spec.name.startswith("pcie") for link in topology.path(src, dst)) else "nvlink"
