"""The Alpa assumption as a baseline strategy (``--strategy alpa``).

Alpa (Zheng et al., OSDI'22) splits the search in two: intra-operator parallelism (tensor and data parallelism)
inside a submesh, inter-operator parallelism (pipeline stages) between submeshes, on the assumption that links inside
a server are much faster than links between servers; so a stage's devices sit inside one server and the pipeline
runs across servers, in the cluster's own order. The baseline keeps exactly the candidates of the space that honour
that assumption and ranks them with the same simulator, so comparing it with the unrestricted search measures what
the assumption costs on a given cluster (it costs nothing where it holds, e.g. NVLink servers joined by a slower
network, and can cost much where it does not: servers whose PCIe is slower than their network, consumer GPUs without
NVLink).
"""

from __future__ import annotations

from sim.hw.topology import Topology
from sim.ir.parallel import DEFAULT_RANK_ORDER, Parallelism
from sim.search.space import Candidate

__all__ = ["honours_alpa_assumption"]


def honours_alpa_assumption(candidate: Candidate, topology: Topology) -> bool:
    """Whether every pipeline stage's tensor × data-parallel devices lie in one server, with the pipeline outermost
    (Megatron's ``tp-dp-pp`` nesting) and the cluster's own device order."""
    if candidate.rank_order != DEFAULT_RANK_ORDER or candidate.devices:
        return False
    layout = Parallelism(tp=candidate.tp, dp=candidate.dp, pp=candidate.pp, cp=candidate.cp)
    for p in range(layout.pp):
        servers = {topology.node_of_rank[layout.device(p, d, t)] for d in range(layout.data_ranks)
                   for t in range(layout.tp)}
        if len(servers) > 1:
            return False
    return True
