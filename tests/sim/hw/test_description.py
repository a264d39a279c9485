"""Reading a topology goes one way: the text into a description (sim.hw.grammar), the description into servers
(sim.hw.servers), the servers into a graph (sim.hw.link_graph). Oracles: the specs' own words, and Topology.parse."""

from __future__ import annotations

import pytest

from sim.core.errors import SpecError
from sim.hw.catalog import get_device, get_link
from sim.hw.description import ClusterDescription, ServerGroup
from sim.hw.grammar import load_topology_yaml, parse_description
from sim.hw.link_graph import build_graph
from sim.hw.servers import server_shapes
from sim.hw.topology import Topology


def test_a_spec_is_described_as_written_one_group_per_term():
    description = parse_description("2x8xA100+dgx-h100")
    a100, h100 = description.groups
    assert (a100.device, a100.count, a100.repeat, a100.intra, a100.preset, a100.name) == \
        (get_device("A100"), 8, 2, None, "", "A100")
    assert (h100.device, h100.count, h100.repeat, h100.intra, h100.preset, h100.network, h100.nics) == \
        (get_device("h100-sxm5-80gb"), 8, 1, "nvswitch", "dgx-h100", get_link("ib-ndr"), 8)
    assert description.ranks == 24 and (description.network, description.nics_per_node, description.slowdown) == \
        (None, None, ())


def test_a_file_is_described_without_listing_its_servers(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("nodes:\n  - {device: cpu, count: 2, repeat: 4000}\nnetwork: eth-25g\nnics_per_node: 2\n"
                    "slowdown: {1: 2, 0: 1.5}\n")
    description = load_topology_yaml(str(path))
    assert description == ClusterDescription(
        str(path), (ServerGroup(get_device("cpu"), 2, 4000, None, where=f"topology file {str(path)!r}: nodes[0]"),),
        get_link("eth-25g"), 2, ((1, 2.0), (0, 1.5)))


def test_wiring_is_the_servers_question_not_the_readers():
    description = parse_description("20xV100")  # read: a term of 20 V100s; built: no server holds them
    assert description.groups[0].count == 20
    with pytest.raises(SpecError, match=r"^bad topology '20xV100': '20xV100': one server holds at most 16 x "):
        server_shapes(description)


@pytest.mark.parametrize("spec", ["8xV100", "2x8xA100", "4xV100+4xA100", "2xdgx-a100", "4xideal", "16x4xGH200"])
def test_the_three_steps_are_topology_parse(spec):
    shapes = server_shapes(parse_description(spec))
    graph, devices, node_of_rank = build_graph(shapes)
    topology = Topology.parse(spec)
    assert (devices, node_of_rank, tuple(shapes)) == (topology.devices, topology.node_of_rank, topology.nodes)
    assert sorted(graph.edges(data="link")) == sorted(topology.graph.edges(data="link"))
