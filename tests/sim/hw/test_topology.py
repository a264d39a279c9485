"""Tests for the topology grammar, wiring, routing and transfer model (sim.hw.topology*)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.hw.catalog import get_device, get_link
from sim.hw.grammar import PRESETS
from sim.hw.topology import Topology, _hop_cost, format_topology_list

# `nvidia-smi topo -m` of a real DGX-1, copied from hardware.md §2.2: the oracle for the cube-mesh wiring.
DGX1_TOPO = """
      GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7
GPU0   X   NV1  NV1  NV2  NV2  SYS  SYS  SYS
GPU1  NV1   X   NV2  NV1  SYS  NV2  SYS  SYS
GPU2  NV1  NV2   X   NV2  SYS  SYS  NV1  SYS
GPU3  NV2  NV1  NV2   X   SYS  SYS  SYS  NV1
GPU4  NV2  SYS  SYS  SYS   X   NV1  NV1  NV2
GPU5  SYS  NV2  SYS  SYS  NV1   X   NV2  NV1
GPU6  SYS  SYS  NV1  SYS  NV1  NV2   X   NV2
GPU7  SYS  SYS  SYS  NV1  NV2  NV1  NV2   X
"""
DGX1 = [row.split()[1:] for row in DGX1_TOPO.strip().splitlines()[1:]]

ROUND_TRIP = [
    "1xV100", "4xV100", "8xV100", "16xV100", "8xv100", "8XV100", "2x8xA100", "4x4xV100-PCIE", "8xH100",
    "4xV100+4xA100", "2xA100+2xH100+2xT4", "dgx1-v100", "dgx2-v100", "dgx-a100", "dgx-h100", "p3.16xlarge",
    "2xdgx-a100", "3xp3.16xlarge", "DGX-A100", "1xideal", "4xideal", "2x2xideal", "2xideal+2xV100",
    "8xRTX4090", "4xA10", "2x4xT4", "8xa100-sxm4-40gb", "dgx1-v100+dgx-a100", "4xV100 + 4xA100",
    "8xH200", "2x8xB200", "4xGH200", "3x4xGH200", "2xcray-ex-gh200", "2x8xMI300X", "2x8xL40S", "dgx-b200+4xGH200",
]  # fmt: skip


def hops(links) -> list[tuple[str, str, str]]:
    return [(link.src, link.dst, link.spec.name) for link in links]


@pytest.mark.parametrize("spec", ROUND_TRIP)
def test_round_trip(spec: str) -> None:
    topology = Topology.parse(spec)
    assert str(topology) == spec and topology.spec == spec
    assert topology.num_ranks == len(topology.devices) == len(topology.node_of_rank)
    assert sorted(n for n in topology.graph.nodes if n.startswith("gpu")) == sorted(
        f"gpu{r}" for r in range(topology.num_ranks)
    )


@pytest.mark.parametrize("spec", ROUND_TRIP)
def test_every_gpu_has_its_host_link_and_every_link_is_full_duplex(spec: str) -> None:
    topology = Topology.parse(spec)
    for rank, device in enumerate(topology.devices):
        link = topology.graph.edges[f"gpu{rank}", f"host{topology.node_of_rank[rank]}"]["link"]
        assert link.spec == get_link(device.host_link)
    for link in topology.links():
        assert topology.graph.edges[link.dst, link.src]["link"].spec == link.spec


@pytest.mark.parametrize("spec", ROUND_TRIP)
def test_gpus_are_never_intermediate_hops(spec: str) -> None:
    topology = Topology.parse(spec)
    for a, b in itertools.product(range(topology.num_ranks), repeat=2):
        path = topology.path(a, b)
        assert [link.src for link in path[1:]] == [link.dst for link in path[:-1]]  # contiguous
        assert all(not link.dst.startswith("gpu") for link in path[:-1])
        if a != b:
            assert (path[0].src, path[-1].dst) == (f"gpu{a}", f"gpu{b}")


def test_dgx1_cube_mesh_matches_nvidia_smi_exactly() -> None:
    topology = Topology.parse("8xV100")
    pcie = get_link("pcie3-x16")
    for i, j in itertools.permutations(range(8), 2):
        expected = {
            "NV1": [(f"gpu{i}", f"gpu{j}", "nvlink2-x1")],
            "NV2": [(f"gpu{i}", f"gpu{j}", "nvlink2-x2")],
            "SYS": [(f"gpu{i}", "host0", pcie.name), ("host0", f"gpu{j}", pcie.name)],
        }[DGX1[i][j]]
        assert hops(topology.path(i, j)) == expected, (i, j)


def test_dgx1_named_pairs() -> None:
    topology = Topology.parse("dgx1-v100")
    assert hops(topology.path(0, 3)) == [("gpu0", "gpu3", "nvlink2-x2")]
    assert hops(topology.path(0, 1)) == [("gpu0", "gpu1", "nvlink2-x1")]
    assert hops(topology.path(0, 5)) == [("gpu0", "host0", "pcie3-x16"), ("host0", "gpu5", "pcie3-x16")]
    nvlinks = {r: 0 for r in range(8)}  # each V100 has 6 NVLink2 links (hardware.md §2.2)
    for link in topology.links():
        if link.spec.name.startswith("nvlink2") and link.src.startswith("gpu"):
            nvlinks[int(link.src[3:])] += int(link.spec.name[-1])
    assert set(nvlinks.values()) == {6}


def test_smaller_v100_node_is_the_cube_mesh_restricted() -> None:
    topology = Topology.parse("4xV100")
    nvlink = {(link.src, link.dst): link.spec.name for link in topology.links() if link.spec.name.startswith("nv")}
    assert nvlink == {
        (f"gpu{i}", f"gpu{j}"): f"nvlink2-x{DGX1[i][j][2]}"
        for i, j in itertools.permutations(range(4), 2)
        if DGX1[i][j] != "SYS"
    }


@pytest.mark.parametrize(
    ("spec", "switch", "device"),
    [
        ("8xA100", "nvswitch-a100", "a100-sxm4-80gb"),
        ("8xH100", "nvswitch-h100", "h100-sxm5-80gb"),
        ("16xV100", "nvswitch-v100", "v100-sxm2-32gb"),
        ("9xV100", "nvswitch-v100", "v100-sxm2-32gb"),
        ("dgx2-v100", "nvswitch-v100", "v100-sxm2-32gb"),
        ("8xH200", "nvswitch-h200", "h200-sxm-141gb"),
        ("dgx-h200", "nvswitch-h200", "h200-sxm-141gb"),
        ("8xB200", "nvswitch-b200", "b200-sxm-180gb"),
        ("dgx-b200", "nvswitch-b200", "b200-sxm-180gb"),
    ],
)
def test_nvswitch_paths_have_two_hops(spec: str, switch: str, device: str) -> None:
    topology = Topology.parse(spec)
    assert {d.name for d in topology.devices} == {device}
    last = topology.num_ranks - 1
    assert hops(topology.path(0, last)) == [("gpu0", "nvswitch0", switch), ("nvswitch0", f"gpu{last}", switch)]


@pytest.mark.parametrize(
    ("spec", "link"),
    [("4xT4", "pcie3-x16"), ("8xA100-PCIE", "pcie4-x16"), ("2xH100-PCIE", "pcie5-x16"), ("8xL40S", "pcie4-x16")],
)
def test_pcie_cards_talk_through_the_host(spec: str, link: str) -> None:
    topology = Topology.parse(spec)
    assert hops(topology.path(1, 0)) == [("gpu1", "host0", link), ("host0", "gpu0", link)]


def test_inter_node_path_crosses_the_network() -> None:
    topology = Topology.parse("2x8xA100")
    assert topology.node_of_rank == (0,) * 8 + (1,) * 8
    assert hops(topology.path(0, 8)) == [
        ("gpu0", "nic0", "pcie4-x16"),
        ("nic0", "fabric", "ib-hdr-x8"),
        ("fabric", "nic1", "ib-hdr-x8"),
        ("nic1", "gpu8", "pcie4-x16"),
    ]
    nic = topology.path(0, 8)[1].spec
    assert nic.bandwidth == 8 * get_link("ib-hdr").bandwidth and nic.latency == get_link("ib-hdr").latency
    assert len(topology.path(0, 7)) == 2  # same server: NVSwitch, not the network


def test_transfer_time_is_the_closed_form_over_the_hops() -> None:
    topology = Topology.parse("2x8xV100")
    pcie, edr = get_link("pcie3-x16"), get_link("ib-edr")  # DGX-1: 4 x EDR per server
    nbytes = 123_456_789
    latency = pcie.latency + edr.latency + edr.latency + pcie.latency
    expected = latency + nbytes / min(pcie.bandwidth, 4 * edr.bandwidth)
    assert topology.transfer_time(nbytes, 2, 13) == expected
    assert expected == pytest.approx(17.7e-6 + nbytes / 11e9, rel=1e-12)
    nvlink = get_link("nvlink2-x2")
    assert topology.transfer_time(nbytes, 0, 3) == nvlink.latency + nbytes / nvlink.bandwidth
    assert topology.transfer_time(nbytes, 5, 5) == 0.0 and topology.path(5, 5) == ()


def test_transfer_time_matches_closed_form_on_every_pair() -> None:
    topology = Topology.parse("4xV100+2xA100+2xT4")
    for a, b in itertools.product(range(topology.num_ranks), repeat=2):
        path = topology.path(a, b)
        latency = sum(link.spec.latency for link in path)
        expected = 0.0 if a == b else latency + 1e6 / min(link.spec.bandwidth for link in path)
        assert topology.transfer_time(1e6, a, b) == expected


def test_heterogeneous_ranks_in_term_order_and_slowest_network() -> None:
    topology = Topology.parse("4xV100+4xA100")
    assert [d.name for d in topology.devices] == ["v100-sxm2-32gb"] * 4 + ["a100-sxm4-80gb"] * 4
    assert topology.node_of_rank == (0, 0, 0, 0, 1, 1, 1, 1)
    path = topology.path(0, 4)
    assert "fabric" in [link.dst for link in path]
    edr = get_link("ib-edr")  # the V100 side's NIC type is the slower one
    assert [link.spec.bandwidth for link in path[1:3]] == [4 * edr.bandwidth, 8 * edr.bandwidth]
    assert hops(topology.path(4, 5)) == [("gpu4", "nvswitch1", "nvswitch-a100"), ("nvswitch1", "gpu5", "nvswitch-a100")]


@pytest.mark.parametrize("spec", ["1xideal", "4xideal", "2x3xideal"])
def test_ideal_topology_is_free(spec: str) -> None:
    topology = Topology.parse(spec)
    assert topology.is_ideal
    assert {d.name for d in topology.devices} == {"ideal"}
    for a, b in itertools.product(range(topology.num_ranks), repeat=2):
        assert topology.transfer_time(1e12, a, b) == 0.0
        assert len(topology.path(a, b)) == (a != b)  # every pair has its own link
    assert all(link.spec.name == "ideal" for link in topology.host_to_device_path(0))


def test_real_topologies_are_not_ideal() -> None:
    assert not Topology.parse("8xV100").is_ideal
    assert not Topology.parse("2xideal+2xV100").is_ideal


def test_host_and_device_paths() -> None:
    topology = Topology.parse("2x8xA100")
    pcie = get_link("pcie4-x16")
    assert hops(topology.host_to_device_path(9)) == [("host1", "gpu9", pcie.name)]
    assert hops(topology.device_to_host_path(9)) == [("gpu9", "host1", pcie.name)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_parse_and_describe_themselves(preset: str) -> None:
    topology = Topology.parse(preset)
    expected = PRESETS[preset]
    device = get_device(expected.device)
    assert topology.devices == (device,) * expected.count
    text = topology.describe()
    assert device.name in text and f"{expected.count} x {device.name}" in text and preset in text
    doubled = Topology.parse(f"2x{preset}")
    assert doubled.num_ranks == 2 * expected.count and doubled.node_of_rank[-1] == 1
    own_nics = doubled.nodes[0].nic_per_gpu  # one port per GPU (GH200) instead of the server's ports as one link
    network = f"{expected.network}-x{expected.nics}" if expected.nics > 1 and not own_nics else expected.network
    assert network in doubled.describe() and f"{expected.nics} port(s) per server" in doubled.describe()
    assert "fabric" in [link.dst for link in doubled.path(0, expected.count)]


def test_describe_mentions_shape_and_links() -> None:
    text = Topology.parse("2x8xA100").describe()
    assert "16 ranks on 2 servers" in text and "8 x a100-sxm4-80gb" in text and "NVSwitch" in text
    assert "nvswitch-a100" in text and "235 GB/s" in text and "ib-hdr" in text
    assert "12 pairs through host PCIe" in Topology.parse("8xV100").describe()


def test_format_topology_list_mentions_grammar_and_presets() -> None:
    text = format_topology_list()
    assert all(name in text for name in PRESETS)
    assert "MxNxDEVICE" in text and "Nxideal" in text and ".yaml" in text and "RTX4090" in text


def test_parse_is_deterministic() -> None:
    a, b = Topology.parse("2x8xV100+4xT4"), Topology.parse("2x8xV100+4xT4")
    assert a == b and hash(a) == hash(b)
    assert a.links() == b.links()
    for src, dst in itertools.product(range(a.num_ranks), repeat=2):
        assert a.path(src, dst) == b.path(src, dst)
    assert a.path(0, 19) is a.path(0, 19)  # cached


BAD_SPECS = [
    "0xV100", "-2xV100", "16xV1OO", "xV100", "4x", "V100", "4xV100+", "3x0xA100", "dgx-a1000", "2xdgx-b300",
    "9xA100", "17xV100", "9xT4", "2x8xdgx-a100", "+4xV100", "4xV100++4xA100", "4xcube", "2x2x2xV100",
    "5xGH200", "9xMI300X", "9xH200", "9xB200", "9xL40S", "2x4xcray-ex-gh200",
]  # fmt: skip


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_bad_specs_raise_spec_error_naming_the_value(spec: str) -> None:
    with pytest.raises(SpecError) as info:
        Topology.parse(spec)
    assert spec in str(info.value)


@pytest.mark.parametrize("spec", ["", "   "])
def test_empty_spec(spec: str) -> None:
    with pytest.raises(SpecError, match="empty topology spec"):
        Topology.parse(spec)


@pytest.mark.parametrize(
    ("spec", "hint"),
    [("16xV1OO", "did you mean v100"), ("dgx-a1000", "dgx-a100"), ("16xA100", "2x8xA100"), ("V100", "8xV100")],
)
def test_errors_suggest_a_fix(spec: str, hint: str) -> None:
    with pytest.raises(SpecError, match=hint):
        Topology.parse(spec)


def test_bad_rank_and_size_arguments() -> None:
    topology = Topology.parse("4xV100")
    with pytest.raises(SpecError, match="rank 4"):
        topology.path(0, 4)
    with pytest.raises(SpecError, match="-1"):
        topology.host_to_device_path(-1)
    with pytest.raises(SpecError, match="nbytes"):
        topology.transfer_time(-1, 0, 1)


@given(
    servers=st.integers(1, 4),
    device=st.sampled_from(["V100", "A100", "H100", "T4", "RTX3090", "ideal", "v100-pcie-16gb"]),
    count=st.integers(1, 8),
)
def test_grammar_property(servers: int, device: str, count: int) -> None:
    spec = f"{servers}x{count}x{device}"
    topology = Topology.parse(spec)
    assert str(topology) == spec and topology.num_ranks == servers * count
    assert topology.node_of_rank == tuple(r // count for r in range(servers * count))
    crossing = topology.path(0, topology.num_ranks - 1)
    assert (servers > 1 and device != "ideal") == ("fabric" in [link.dst for link in crossing])


# --- YAML topology files ---------------------------------------------------------------------------------------


def test_yaml_topology_equals_the_equivalent_spec(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n"
        "  - {device: V100, count: 8, intra: cube-mesh, repeat: 2}\n"
        "  - {device: a100-sxm4-80gb, count: 8}\n"
        "network: ib-edr\n"
        "nics_per_node: 4\n"
    )
    topology = Topology.parse(str(path))
    assert str(topology) == str(path)
    reference = Topology.parse("2x8xV100+8xA100")
    assert topology.devices == reference.devices and topology.node_of_rank == reference.node_of_rank
    assert hops(topology.path(0, 5)) == hops(reference.path(0, 5))
    assert hops(topology.path(16, 23)) == hops(reference.path(16, 23))
    assert topology.path(0, 16)[2].spec.bandwidth == 4 * get_link("ib-edr").bandwidth  # nics_per_node applies


def test_yaml_pcie_wiring_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "box.yml"
    path.write_text("nodes:\n  - device: V100\n    count: 4\n    intra: pcie\n")
    topology = Topology.parse(str(path))
    assert hops(topology.path(0, 3)) == [("gpu0", "host0", "pcie3-x16"), ("host0", "gpu3", "pcie3-x16")]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("nodes: [unclosed\n", "malformed YAML"),
        ("- just a list\n", "mapping"),
        ("nodes: []\n", "nodes"),
        ("nodes:\n  - {device: V100}\n", "nodes[0].count"),
        ("nodes:\n  - {device: V100, count: abc}\n", "nodes[0].count"),
        ("nodes:\n  - {device: V100, count: 0}\n", "nodes[0].count"),
        ("nodes:\n  - {count: 2}\n", "nodes[0].device"),
        ("nodes:\n  - {device: V1OO, count: 2}\n", "V1OO"),
        ("nodes:\n  - {device: A100, count: 4, intra: cube-mesh}\n", "cube-mesh"),
        ("nodes:\n  - {device: V100, count: 4, intra: torus}\n", "torus"),
        ("nodes:\n  - {device: V100, count: 4, gpus: 2}\n", "gpus"),
        ("nodes:\n  - {device: V100, count: 4, repeat: -1}\n", "nodes[0].repeat"),
        ("nodes:\n  - {device: V100, count: 4}\nnetwork: ib-gdr\n", "network"),
        ("nodes:\n  - {device: V100, count: 4}\nnics_per_node: 0\n", "nics_per_node"),
        ("nodes:\n  - {device: V100, count: 4}\nswitch: yes\n", "switch"),
    ],
)
def test_malformed_yaml_names_the_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        Topology.parse(str(path))
    assert str(path) in str(info.value) and field in str(info.value)


def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="nope.yaml"):
        Topology.parse(missing)


def test_cpu_ranks_meet_at_the_host_over_loopback() -> None:
    topo = Topology.parse("2xcpu")
    assert str(topo) == "2xcpu" and [d.name for d in topo.devices] == ["cpu", "cpu"]
    path = topo.path(0, 1)
    assert [(hop.src, hop.dst, hop.spec.name) for hop in path] == [("gpu0", "host0", "loopback"),
                                                                   ("host0", "gpu1", "loopback")]
    link = path[0].spec
    assert topo.transfer_time(4e6, 0, 1) == pytest.approx(2 * link.latency + 4e6 / link.bandwidth, rel=1e-12)


def _brute_force_route(topology: Topology, src: str, dst: str) -> tuple:
    """Every simple path from ``src`` to ``dst`` whose inner nodes forward (not GPUs, not non-transit hosts), the
    least by (cost, hops, node names): the order the router promises, by enumeration."""
    graph = topology.graph
    forwards = {node for node, transit in graph.nodes(data="transit", default=True)
                if transit and not node.startswith("gpu")}
    best = None

    def walk(node: str, seen: list[str], links: tuple, cost: float) -> None:
        nonlocal best
        for neighbour in graph.successors(node):
            if neighbour in seen:
                continue
            link = graph.edges[node, neighbour]["link"]
            step = cost + _hop_cost(link)
            if neighbour == dst:
                label = (step, len(links) + 1, "\0".join([*seen, neighbour]))
                if best is None or label < best[0]:
                    best = (label, links + (link,))
            elif neighbour in forwards:
                walk(neighbour, [*seen, neighbour], links + (link,), step)

    walk(src, [src], (), 0.0)
    assert best is not None
    return best[1]


@pytest.mark.parametrize("spec", ["3x4xA100", "3x2xL40S", "3x4xGH200", "2x8xV100", "2xA100+1x2xH100"])
def test_routes_are_the_least_paths_found_by_enumeration(spec):
    # Oracle: enumeration of every simple path, on clusters of every wiring (NVSwitch, PCIe through the host, a NIC
    # per GPU, the DGX-1 cube-mesh, mixed servers), for the router that joins a search inside a server with one from
    # the fabric.
    topology = Topology.parse(spec)
    for src in range(topology.num_ranks):
        for dst in range(topology.num_ranks):
            if src != dst:
                assert topology.path(src, dst) == _brute_force_route(topology, f"gpu{src}", f"gpu{dst}"), (src, dst)
    assert topology.host_to_device_path(0) == _brute_force_route(topology, "host0", "gpu0")
