"""Rack-scale NVLink domains (GB200 and GB300 NVL72) and the Blackwell Ultra servers: ``NxGB200`` handed out in
domains of 72, the last one partial; one NVLink hop inside a domain, the GPUs' own NICs between domains."""

import pytest

from sim.core.errors import SpecError
from sim.hw.catalog import get_device
from sim.hw.topology import Topology


@pytest.mark.parametrize("count, domains", [(72, [72]), (144, [72, 72]), (256, [72, 72, 72, 40]), (8, [8])])
def test_gpus_come_in_domains_of_72_the_last_partial(count, domains):
    topology = Topology.parse(f"{count}xGB200")
    sizes = [topology.node_of_rank.count(node) for node in range(len(domains))]
    assert topology.num_ranks == count and sizes == domains


def test_inside_a_domain_one_switch_hop_between_domains_the_gpus_own_nics():
    topology = Topology.parse("144xGB300")
    inside = topology.path(0, 71)
    assert [link.spec.name for link in inside] == ["nvlink-switch-nvl72"] * 2  # up to the switch system and down
    across = topology.path(0, 72)
    names = [link.spec.name for link in across]
    assert names[0] == "nvlink-c2c" and "ib-xdr" in names  # through its Grace and its ConnectX-8 at 800 Gb/s
    assert topology.nodes[0].nics == 72  # one NIC per GPU (four ConnectX-8 per four-GPU tray)
    assert Topology.parse("144xGB200").nodes[0].network.name == "ib-ndr"


def test_b300_servers_hold_eight_on_nvlink_5():
    topology = Topology.parse("4x8xB300")
    assert topology.num_ranks == 32 and topology.devices[0] == get_device("B300")
    assert [link.spec.name for link in topology.path(0, 7)] == ["nvswitch-b200"] * 2
    assert topology.nodes[0].network.name == "ib-xdr"
    with pytest.raises(SpecError, match="one server holds at most 8"):
        Topology.parse("16xB300")
