"""Collective costs against closed forms, hand-derived link loads and a plain-Python reference of the flow model."""

import gc
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.cost import flows
from sim.cost.collectives import ALGORITHMS, COLLECTIVE_KINDS, collective_cost, concurrent_transfer
from sim.hw.topology import Topology

S = 3 * 2**26  # bytes; divisible by every group size used below, so link byte counts are exact
ONE_SWITCH = Topology.parse("8xA100")  # every GPU→GPU path is gpu → nvswitch → gpu
TWO_SERVERS = Topology.parse("2x8xA100")  # 8 HDR ports per server, aggregated into one nic→fabric link


def hop(topology, src, dst):
    """(min bandwidth in bytes/s, summed latency in s) of the path src → dst."""
    path = topology.path(src, dst)
    return min(link.spec.bandwidth for link in path), sum(link.spec.latency for link in path)


def one_nic_topology(tmp_path, count, network):
    """Two servers of ``count`` A100s whose only NIC port is ``network``."""
    spec = tmp_path / "one_nic.yaml"
    spec.write_text(f"nodes:\n  - device: A100\n    count: {count}\n    repeat: 2\n"
                    f"network: {network}\nnics_per_node: 1\n")
    return Topology.parse(str(spec))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_matches_its_closed_forms_on_one_switch(n):
    group = [7, 2, 5, 0, 3, 6, 1, 4][:n]  # any order: every hop is one gpu → nvswitch → gpu path
    bandwidth, alpha = hop(ONE_SWITCH, 0, 1)
    cost = {kind: collective_cost(ONE_SWITCH, kind, [group], S, "ring") for kind in COLLECTIVE_KINDS}
    assert cost["all_reduce"].seconds == pytest.approx(2 * (n - 1) / n * S / bandwidth + 2 * (n - 1) * alpha, rel=1e-12)
    for kind in ("reduce_scatter", "all_gather"):
        assert cost[kind].seconds == pytest.approx((n - 1) / n * S / bandwidth + (n - 1) * alpha, rel=1e-12)
    assert cost["broadcast"].seconds == pytest.approx(S / bandwidth + (n - 1) * alpha, rel=1e-12)
    # each member sends 2(n-1) chunks of S/n through its own uplink and receives as many through its downlink
    expected = {(f"gpu{r}", "nvswitch0"): 2 * (n - 1) * S // n for r in group}
    expected |= {("nvswitch0", f"gpu{r}"): 2 * (n - 1) * S // n for r in group}
    assert dict(cost["all_reduce"].bytes_per_link) == expected
    assert cost["all_reduce"].link_keys == tuple(sorted(expected))
    assert [key for key, _ in cost["all_reduce"].bytes_per_link] == sorted(expected)


@pytest.mark.parametrize("spec, n, depth", [("8xA100", 4, 2), ("8xA100", 8, 3), ("16xV100", 16, 4)])
def test_tree_all_reduce_matches_the_double_binary_tree_closed_form(spec, n, depth):
    # NCCL's model: 2·(log2 n · α + S/B): each tree carries S/2 up then down; every member is an inner node (two
    # children) of one tree and a leaf of the other, so each uplink and downlink carries S per phase
    topology = Topology.parse(spec)
    bandwidth, alpha = hop(topology, 0, 1)
    cost = collective_cost(topology, "all_reduce", [range(n)], S, "tree")
    assert cost.algorithm == "tree"
    assert depth == math.ceil(math.log2(n))
    assert cost.seconds == pytest.approx(2 * (depth * alpha + S / bandwidth), rel=1e-12)


def test_tree_on_two_ranks_and_tree_broadcast_match_their_closed_forms():
    bandwidth, alpha = hop(ONE_SWITCH, 0, 1)
    # two ranks: each tree is one edge carrying S/2, so each link carries S/2 per phase
    assert collective_cost(ONE_SWITCH, "all_reduce", [[3, 6]], S, "tree").seconds == pytest.approx(
        2 * alpha + S / bandwidth, rel=1e-12)
    # heap-ordered broadcast tree on 8: depth 3, inner nodes send S to two children through one uplink
    assert collective_cost(ONE_SWITCH, "broadcast", [range(8)], S, "tree").seconds == pytest.approx(
        3 * alpha + 2 * S / bandwidth, rel=1e-12)


def test_reduce_scatter_and_all_gather_have_no_tree_and_fall_back_to_ring():
    for kind in ("reduce_scatter", "all_gather"):
        tree = collective_cost(TWO_SERVERS, kind, [range(16)], S, "tree")
        assert tree.algorithm == "ring"
        assert tree == collective_cost(TWO_SERVERS, kind, [range(16)], S, "ring")


def test_two_groups_through_one_shared_nic_take_the_bandwidth_term_twice(tmp_path):
    topology = one_nic_topology(tmp_path, 2, "eth-10g")  # ranks 0, 1 on server 0; 2, 3 on server 1
    nic = topology.graph.edges["nic0", "fabric"]["link"].spec.bandwidth
    assert nic == min(link.spec.bandwidth for link in topology.path(0, 2))  # precondition: the NIC is the bottleneck
    latency = 2 * hop(topology, 0, 2)[1]  # ring all-reduce of 2: two steps
    alone = collective_cost(topology, "all_reduce", [[0, 2]], S, "ring")
    shared = collective_cost(topology, "all_reduce", [[0, 2], [1, 3]], S, "ring")
    assert alone.seconds - latency == pytest.approx(S / nic, rel=1e-12)
    assert shared.seconds - latency == pytest.approx(2 * S / nic, rel=1e-12)
    assert dict(shared.bytes_per_link)[("nic0", "fabric")] == 2 * S
    # point-to-point messages sent at once share the NIC the same way
    one, _ = concurrent_transfer(topology, [(0, 2)], S)
    two, carried = concurrent_transfer(topology, [(0, 2), (1, 3)], S)
    assert one == pytest.approx(topology.transfer_time(S, 0, 2), rel=1e-12)
    assert two - latency / 2 == pytest.approx(2 * S / nic, rel=1e-12)
    assert dict(carried)[("nic0", "fabric")] == 2 * S


def test_groups_that_share_no_link_cost_what_one_costs_alone():
    alone = collective_cost(TWO_SERVERS, "all_reduce", [range(8)], S, "ring")
    both = collective_cost(TWO_SERVERS, "all_reduce", [range(8), range(8, 16)], S, "ring")
    assert both.seconds == alone.seconds
    assert len(both.link_keys) == 2 * len(alone.link_keys)


def inter_step(topology, per_nic):
    """One inter-server ring step of the hierarchical all-reduce of all ranks of two servers: ``per_nic`` flows of
    S/16 each leave through each NIC link, one through each GPU's PCIe link."""
    path = topology.path(0, 8)
    chunk = S / 16
    worst = max((per_nic if "fabric" in (link.src, link.dst) else 1) * chunk / link.spec.bandwidth for link in path)
    return sum(link.spec.latency for link in path) + worst


def test_hierarchical_matches_its_three_phase_closed_form():
    b_nv, a_nv = hop(TWO_SERVERS, 0, 1)
    intra = 7 * (a_nv + S / 8 / b_nv)  # ring reduce-scatter of S among 8 (the same again for the all-gather)
    expected = 2 * intra + 2 * inter_step(TWO_SERVERS, per_nic=8)  # inter: 8 rings of 2 all-reduce S/8 each
    cost = collective_cost(TWO_SERVERS, "all_reduce", [range(16)], S, "hierarchical")
    assert cost.algorithm == "hierarchical"
    assert cost.seconds == pytest.approx(expected, rel=1e-12)
    assert collective_cost(TWO_SERVERS, "reduce_scatter", [range(16)], S, "hierarchical").seconds == pytest.approx(
        intra + inter_step(TWO_SERVERS, per_nic=8), rel=1e-12)


def test_hierarchical_beats_the_flat_ring_when_the_nic_is_the_bottleneck(tmp_path):
    topology = one_nic_topology(tmp_path, 8, "ib-hdr")
    b_nv, a_nv = hop(topology, 0, 1)
    b_x, a_x = hop(topology, 7, 8)
    # flat ring over 0..15: each of its 30 steps waits for the slowest hop, the one through a NIC
    ring = collective_cost(topology, "all_reduce", [range(16)], S, "ring")
    assert ring.seconds == pytest.approx(30 * max(a_nv + S / 16 / b_nv, a_x + S / 16 / b_x), rel=1e-12)
    hierarchical = collective_cost(topology, "all_reduce", [range(16)], S, "hierarchical")
    assert hierarchical.seconds == pytest.approx(
        2 * 7 * (a_nv + S / 8 / b_nv) + 2 * inter_step(topology, per_nic=8), rel=1e-12)
    assert hierarchical.seconds < ring.seconds / 1.5
    assert collective_cost(topology, "all_reduce", [range(16)], S).algorithm == "hierarchical"


def test_hierarchical_within_one_server_or_with_uneven_servers_is_the_ring():
    for kind in COLLECTIVE_KINDS:
        ring = collective_cost(ONE_SWITCH, kind, [[5, 1, 7, 2]], S, "ring")
        within = collective_cost(ONE_SWITCH, kind, [[5, 1, 7, 2]], S, "hierarchical")
        assert (within.seconds, within.link_keys, within.bytes_per_link) == (
            ring.seconds, ring.link_keys, ring.bytes_per_link)
    uneven = collective_cost(TWO_SERVERS, "all_reduce", [[0, 1, 8]], S, "hierarchical")
    assert uneven == collective_cost(TWO_SERVERS, "all_reduce", [[0, 1, 8]], S, "ring")


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_single_rank_groups_and_the_ideal_topology_cost_nothing(kind, algorithm):
    alone = collective_cost(TWO_SERVERS, kind, [[3], [12]], S, algorithm)
    assert (alone.seconds, alone.link_keys, alone.bytes_per_link) == (0.0, (), ())
    assert collective_cost(TWO_SERVERS, kind, [], S, algorithm).seconds == 0.0
    assert collective_cost(Topology.parse("4xideal"), kind, [[0, 1, 2, 3]], S, algorithm).seconds == 0.0


@pytest.mark.parametrize("nbytes", [8, 2**16, S])
@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("spec, groups", [
    ("2x8xA100", [range(16)]),
    ("2x8xA100", [range(0, 16, 2), range(1, 16, 2)]),
    ("8xV100", [[0, 5, 2, 7], [1, 4, 3, 6]]),
    ("2xdgx1-v100", [[r, r + 8] for r in range(8)]),
])
def test_auto_is_the_fastest_algorithm_with_ties_to_ring_then_tree(spec, groups, kind, nbytes):
    topology = Topology.parse(spec)
    costs = [collective_cost(topology, kind, groups, nbytes, name) for name in ALGORITHMS]
    fastest = min(range(len(ALGORITHMS)), key=lambda i: costs[i].seconds)  # min keeps the first of equal ones
    auto = collective_cost(topology, kind, groups, nbytes)
    assert auto == costs[fastest]


def test_auto_picks_the_tree_for_small_messages_on_many_servers():
    topology = Topology.parse("8x2xA100")  # 16 ranks on 8 servers: a ring pays 30 network latencies
    assert collective_cost(topology, "all_reduce", [range(16)], 8).algorithm == "tree"


TOPOLOGIES = [Topology.parse(spec) for spec in ("8xA100", "8xV100", "2x8xA100", "2x4xV100-PCIE", "2xdgx1-v100")]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_an_all_reduce_is_its_reduce_scatter_plus_its_all_gather(data):
    topology = data.draw(st.sampled_from(TOPOLOGIES))
    group = data.draw(st.permutations(range(topology.num_ranks)))[:data.draw(st.integers(1, topology.num_ranks))]
    nbytes = data.draw(st.integers(0, 2**30))
    for algorithm in ("ring", "hierarchical"):
        cost = {kind: collective_cost(topology, kind, [group], nbytes, algorithm).seconds for kind in COLLECTIVE_KINDS}
        assert cost["all_reduce"] >= cost["reduce_scatter"]
        assert cost["all_reduce"] == pytest.approx(cost["reduce_scatter"] + cost["all_gather"], rel=1e-12, abs=1e-15)


def reference_ring(topology, kind, groups, nbytes):
    """The flow model written out plainly for ring collectives: per-link byte loads in a dict, then each transfer's
    latency plus its most loaded link, the worst member per step, times the steps; the slowest group."""
    load = {}
    routes = []
    for group in groups:
        n = len(group)
        if kind == "broadcast":
            hops = [(group[i], group[i + 1]) for i in range(n - 1)]
            chunk = nbytes
        else:
            hops = [(group[i], group[(i + 1) % n]) for i in range(n)]
            chunk = nbytes / n
        paths = [topology.path(a, b) for a, b in hops]
        for path in paths:
            for link in path:
                load[link.src, link.dst] = load.get((link.src, link.dst), 0.0) + chunk
        routes.append((n, paths))

    def bandwidth_term(path):
        return max(load[link.src, link.dst] / link.spec.bandwidth for link in path)

    def latency(path):
        return sum(link.spec.latency for link in path)

    worst = 0.0
    for n, paths in routes:
        if kind == "broadcast":  # one pipelined chain
            time = sum(map(latency, paths)) + max(map(bandwidth_term, paths))
        else:
            step = max(latency(path) + bandwidth_term(path) for path in paths)
            time = step * (n - 1) * (2 if kind == "all_reduce" else 1)
        worst = max(worst, time)
    return worst


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_concurrent_rings_match_a_plain_reference_of_the_flow_model(data):
    topology = data.draw(st.sampled_from(TOPOLOGIES))
    ranks = data.draw(st.permutations(range(topology.num_ranks)))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ranks) - 1), max_size=4)))
    groups = [ranks[a:b] for a, b in zip([0, *cuts], [*cuts, len(ranks)], strict=True)]
    groups = [g for g in groups if len(g) > 1]
    kind = data.draw(st.sampled_from(COLLECTIVE_KINDS))
    nbytes = data.draw(st.integers(1, 2**30))
    expected = reference_ring(topology, kind, groups, nbytes)
    assert collective_cost(topology, kind, groups, nbytes, "ring").seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("call, value", [
    (lambda: collective_cost(ONE_SWITCH, "allreduce", [[0, 1]], S), "'allreduce'"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 1]], S, "butterfly"), "'butterfly'"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 1]], -1), "-1"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 1]], math.nan), "nan"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 99]], S), "99"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, "x"]], S), "'x'"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 1], [1, 2]], S), "rank 1"),
    (lambda: collective_cost(ONE_SWITCH, "all_reduce", [[0, 1], []], S), "empty"),
    (lambda: concurrent_transfer(ONE_SWITCH, [(0, 8)], S), "8"),
    (lambda: concurrent_transfer(ONE_SWITCH, [(0, 1)], -5), "-5"),
])
def test_bad_input_raises_a_value_error_naming_the_value(call, value):
    with pytest.raises(ValueError, match=re.escape(value)):
        call()


def test_the_route_cache_does_not_outlive_its_topology():
    topology = Topology.parse("4xA100")
    collective_cost(topology, "all_reduce", [range(4)], S)
    key = id(topology)
    assert key in flows._TABLES
    del topology
    gc.collect()
    assert key not in flows._TABLES


# --- the deduplicated dispatch (DeepSeek-V3 §3.2.2) -----------------------------------------------------------------


def test_a_deduplicated_dispatch_sends_each_token_once_per_server_and_fans_out_inside():
    from sim.cost.collectives import all_to_all_cost, deduplicated_all_to_all_cost

    topology = Topology.parse("2x8xH100")
    group, token_bytes, topk, servers_per_token = tuple(range(16)), 1_000_000, 8, 1.5
    cost = deduplicated_all_to_all_cost(topology, (group,), token_bytes, topk, servers_per_token)
    carried = dict(cost.bytes_per_link)
    # Across servers: each of the 16 members sends servers_per_token copies, spread over 2 servers, its own half
    # staying home.
    assert sum(n for (src, dst), n in carried.items() if src == "fabric") == 16 * token_bytes * servers_per_token / 2
    # Inside each server: topk slots a token, 7 of 8 leaving the GPU, over each GPU's NVSwitch port.
    into_switch = sum(n for (src, dst), n in carried.items() if dst.startswith("nvswitch"))
    assert into_switch == 16 * token_bytes * topk * 7 / 8
    # Both at once: the longer of the two, each costed as the all-to-all over its own groups (built here from the
    # servers the topology names).
    by_server = [tuple(r for r in group if topology.node_of_rank[r] == s) for s in (0, 1)]
    rails = tuple(zip(*by_server))
    assert cost.seconds == max(all_to_all_cost(topology, rails, round(token_bytes * servers_per_token)).seconds,
                               all_to_all_cost(topology, tuple(by_server), token_bytes * topk).seconds)
    assert cost.seconds < all_to_all_cost(topology, (group,), token_bytes * topk).seconds


def test_a_deduplicated_dispatch_inside_one_server_is_the_plain_all_to_all():
    from sim.cost.collectives import all_to_all_cost, deduplicated_all_to_all_cost

    topology = Topology.parse("8xH100")
    group = tuple(range(8))
    assert deduplicated_all_to_all_cost(topology, (group,), 1000, 4, 1.0) == all_to_all_cost(topology, (group,), 4000)


@pytest.mark.parametrize("group, servers_per_token, message", [
    ((0, 1, 2, 8), 1.5, "spread evenly"), (tuple(range(16)), 2.5, r"servers_per_token must lie in \[1, 2\]"),
])
def test_a_deduplicated_dispatch_refuses_uneven_groups_and_impossible_spreads(group, servers_per_token, message):
    from sim.cost.collectives import deduplicated_all_to_all_cost

    with pytest.raises(ValueError, match=message):
        deduplicated_all_to_all_cost(Topology.parse("2x8xH100"), (group,), 1000, 4, servers_per_token)
