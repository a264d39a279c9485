"""``sim.cost.nccl``: NCCL's protocol choice and latencies against closed forms of its tuner's formula."""

from __future__ import annotations

import pytest

from sim.cost.nccl import PROTOCOLS, link_class, nccl_seconds, steps
from sim.hw.topology import Topology


@pytest.mark.parametrize(("kind", "algorithm", "members", "expected"), [
    ("all_reduce", "ring", 8, 14),  # reduce-scatter then all-gather: 2(n - 1)
    ("all_reduce", "tree", 8, 6),  # up and down a tree of depth ⌈log2 8⌉ = 3
    ("all_reduce", "tree", 5, 6),  # ⌈log2 5⌉ = 3
    ("reduce_scatter", "ring", 4, 3),
    ("all_gather", "ring", 4, 3),
    ("broadcast", "ring", 4, 3),
    ("p2p", "ring", 2, 1),
    ("all_reduce", "ring", 1, 0),  # a group of one moves nothing
])
def test_steps_of_each_algorithm(kind, algorithm, members, expected):
    assert steps(kind, algorithm, members) == expected


def test_a_small_message_takes_ll_and_a_large_one_simple():
    # LL: 3.6 µs + 14 × 0.47 µs + 2 × link; Simple: 8.4 µs + 14 × 3.4 µs + link. They cross where
    # 10.18 + 2·x = 56 + x, at x = 45.82 µs of link time.
    small, large = 1e-6, 1e-3
    assert nccl_seconds(small, "all_reduce", "ring", 8, "nvlink") == pytest.approx(3.6e-6 + 14 * 0.47e-6 + 2 * small)
    assert nccl_seconds(large, "all_reduce", "ring", 8, "nvlink") == pytest.approx(8.4e-6 + 14 * 3.4e-6 + large)
    crossing = (8.4e-6 + 14 * 3.4e-6) - (3.6e-6 + 14 * 0.47e-6)
    below, above = crossing * 0.99, crossing * 1.01
    assert nccl_seconds(below, "all_reduce", "ring", 8, "nvlink") == pytest.approx(3.6e-6 + 14 * 0.47e-6 + 2 * below)
    assert nccl_seconds(above, "all_reduce", "ring", 8, "nvlink") == pytest.approx(8.4e-6 + 14 * 3.4e-6 + above)


def test_the_network_class_costs_more_per_step_and_nothing_costs_nothing():
    nvlink = nccl_seconds(1e-5, "all_gather", "ring", 16, "nvlink")
    net = nccl_seconds(1e-5, "all_gather", "ring", 16, "net")
    assert net - nvlink == pytest.approx(15 * (PROTOCOLS["LL"][1]["net"] - PROTOCOLS["LL"][1]["nvlink"]))
    assert nccl_seconds(0.0, "all_reduce", "ring", 8, "nvlink") == 0.0
    assert nccl_seconds(1e-3, "all_reduce", "ring", 1, "nvlink") == 0.0


def test_link_class_is_the_slowest_hop_between_ring_neighbours():
    two_servers = Topology.parse("2x8xA100")
    assert link_class(two_servers, ((0, 1, 2),)) == "nvlink"
    assert link_class(two_servers, ((7, 8),)) == "net"
    assert link_class(two_servers, ((0, 1), (8, 15))) == "nvlink"  # two groups, each inside a server
    assert link_class(two_servers, ((0, 1), (7, 8))) == "net"  # the slowest group decides
    pcie = Topology.parse("4xA100-PCIE")
    assert pcie.nodes[0].intra == "pcie" and link_class(pcie, ((0, 3),)) == "pcie"
    # A DGX-1 cube-mesh: 0-3 share NVLink, 0-5 do not (their route crosses PCIe through the host); a ring 0-1-2-3
    # closes with 3-0, all NVLink, while a ring 0-3-5 has a PCIe hop.
    mesh = Topology.parse("8xV100")
    assert link_class(mesh, ((0, 1, 2, 3),)) == "nvlink"
    assert link_class(mesh, ((0, 5),)) == "pcie" and link_class(mesh, ((0, 3, 5),)) == "pcie"
