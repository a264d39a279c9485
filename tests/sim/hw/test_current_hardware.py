"""The 2024-2026 hardware: H200, GH200, B200, L40S and MI300X, their links and node presets.

Oracles: the raw numbers of the data files (read here with plain ``yaml.safe_load``) times the unit factor, the
vendor figures the data files cite (Gb/s ÷ 8, links × per-link rate), the wiring the cited sources describe, and the
closed form ``Σ latency + bytes / min bandwidth`` of a path.
"""

from __future__ import annotations

import itertools
import re
from importlib.resources import files
from math import comb

import pytest
import yaml

from sim.core.errors import SpecError
from sim.hw.catalog import get_device, get_link, list_devices
from sim.hw.grammar import PRESETS
from sim.hw.node_shapes import max_gpus_per_node
from sim.hw.topology import Topology, format_topology_list

_DATA = files("profiles") / "hardware"
RAW_DEVICES = {d["name"]: d for d in yaml.safe_load((_DATA / "devices.yaml").read_text())["devices"]}
RAW_LINKS = {d["name"]: d for d in yaml.safe_load((_DATA / "links.yaml").read_text())["links"]}

# alias → (catalog id, dense bf16 TFLOP/s, GB, GB/s, host link, measured large-GEMM TFLOP/s), as the sources cited in
# devices.yaml give them.
NEW_DEVICES = {
    "H200": ("h200-sxm-141gb", 989.0, 141, 4800, "pcie5-x16", 794.5),  # MAMF of H100, 'H200 is the same'
    "GH200": ("gh200-96gb", 989.0, 96, 4000, "nvlink-c2c", 828.6),
    "B200": ("b200-sxm-180gb", 2250.0, 180, 8000, "pcie5-x16", 1745.0),
    "L40S": ("l40s-48gb", 362.0, 48, 864, "pcie4-x16", 269.15),  # torch.mm bf16
    "MI300X": ("mi300x-192gb", 1307.4, 192, 5300, "pcie5-x16", 668.4),
}


def hops(links) -> list[tuple[str, str, str]]:
    return [(link.src, link.dst, link.spec.name) for link in links]


@pytest.mark.parametrize("alias", sorted(NEW_DEVICES))
def test_new_device_resolves_by_alias_in_si_units(alias: str) -> None:
    name, tflops, gb, gbs, host_link, measured = NEW_DEVICES[alias]
    raw = RAW_DEVICES[name]
    assert (raw["peak_tflops"], raw["memory_gb"], raw["memory_bandwidth_gbs"], raw["host_link"]) == (
        tflops, gb, gbs, host_link)  # the data file holds the cited figures
    device = get_device(alias)
    assert device.name == name and device.host_link == host_link
    assert device.peak_flops == raw["peak_tflops"] * 1e12
    assert device.memory_bytes == raw["memory_gb"] * 1e9
    assert device.memory_bandwidth == raw["memory_bandwidth_gbs"] * 1e9
    assert device.launch_overhead_s == pytest.approx(raw["launch_overhead_us"] * 1e-6, rel=1e-15)
    assert device.matmul_efficiency == raw["matmul_efficiency"] == round(measured / tflops, 2)


def test_mi300x_peak_is_its_matrix_cores_at_the_peak_clock() -> None:
    # 2100 MHz x 1216 Matrix Cores x 256 FMA per core per clock x 2 FLOP per FMA (stas00, cited in devices.yaml)
    assert get_device("MI300X").peak_flops == pytest.approx(2100e6 * 1216 * 256 * 2, rel=1e-4)


# link → vendor per-direction rate in GB/s, from the cited figure
NEW_LINK_SPECS = {
    "nvswitch-h200": 18 * 25,  # NVLink 4: 18 links x 25 GB/s per dir
    "nvswitch-b200": 18 * 50,  # NVLink 5: 18 links x 50 GB/s per dir
    "nvlink4-x6": 6 * 25,  # 6 NVLink 4 links between two GH200 of a node
    "xgmi-mi300x": 128 / 2,  # AMD's 128 GB/s peak link bandwidth, duplex
    "nvlink-c2c": 900 / 2,  # 900 GB/s total
    "ib-xdr": 800 / 8,  # 800 Gb/s
    "slingshot-11": 200 / 8,
    "roce-200g": 200 / 8,
    "roce-400g": 400 / 8,
}


@pytest.mark.parametrize("name", sorted(NEW_LINK_SPECS))
def test_new_link_in_si_units(name: str) -> None:
    raw, link = RAW_LINKS[name], get_link(name)
    assert raw["spec_bandwidth_gbs"] == NEW_LINK_SPECS[name]
    assert link.spec_bandwidth == raw["spec_bandwidth_gbs"] * 1e9
    assert link.bandwidth == raw["bandwidth_gbs"] * 1e9 and link.bandwidth < link.spec_bandwidth
    assert link.latency == pytest.approx(raw["latency_us"] * 1e-6, rel=1e-15)


def test_an_mi300x_reaches_its_seven_peers_at_448_gbs_in_all() -> None:
    assert 7 * get_link("xgmi-mi300x").spec_bandwidth == 448e9  # stas00: 'Uni-dir. all-to-all 448'


def _gpu_pairs(topology: Topology, link_name: str) -> set[tuple[int, int]]:
    return {(int(link.src[3:]), int(link.dst[3:])) for link in topology.links()
            if link.spec.name == link_name and link.src.startswith("gpu") and link.dst.startswith("gpu")}


def test_cray_ex_gh200_node_is_an_nvlink_all_to_all_of_four() -> None:
    topology = Topology.parse("cray-ex-gh200")
    assert topology.devices == (get_device("GH200"),) * 4
    assert _gpu_pairs(topology, "nvlink4-x6") == set(itertools.permutations(range(4), 2))
    for rank in range(4):  # 6 links to each of 3 peers: all 18 NVLink 4 links of a Hopper GPU (hardware.md §2.1)
        out = [link.spec for link in topology.links() if link.src == f"gpu{rank}" and link.dst.startswith("gpu")]
        assert sum(spec.spec_bandwidth for spec in out) == 18 * 25e9
    assert not [node for node in topology.graph.nodes if node.startswith("nvswitch")]
    for rank in range(4):
        assert hops(topology.host_to_device_path(rank)) == [("host0", f"gpu{rank}", "nvlink-c2c")]


def test_gh200_peers_never_detour_through_the_grace_host() -> None:
    topology = Topology.parse("4xGH200")
    c2c, nvlink = get_link("nvlink-c2c"), get_link("nvlink4-x6")
    mib = 2**20  # the routing reference size: the C2C detour would be cheaper, so only the transit rule prevents it
    assert 2 * (c2c.latency + mib / c2c.bandwidth) < nvlink.latency + mib / nvlink.bandwidth
    for a, b in itertools.permutations(range(4), 2):
        assert hops(topology.path(a, b)) == [(f"gpu{a}", f"gpu{b}", "nvlink4-x6")]


def test_gh200_nodes_give_each_superchip_its_own_slingshot_nic() -> None:
    topology = Topology.parse("2x4xGH200")
    nics = sorted(node for node in topology.graph.nodes if node.startswith("nic"))
    assert nics == [f"nic{n}.{i}" for n in range(2) for i in range(4)]
    for rank in range(8):
        n, i = divmod(rank, 4)
        assert [nic for nic in topology.graph.successors(f"gpu{rank}") if nic.startswith("nic")] == [f"nic{n}.{i}"]
        port = topology.graph.edges[f"nic{n}.{i}", "fabric"]["link"].spec
        assert port == get_link("slingshot-11")  # one 200 Gb/s port, not the node's four as one link
    assert hops(topology.path(1, 6)) == [("gpu1", "nic0.1", "nvlink-c2c"), ("nic0.1", "fabric", "slingshot-11"),
                                         ("fabric", "nic1.2", "slingshot-11"), ("nic1.2", "gpu6", "nvlink-c2c")]
    nbytes = 10**9
    expected = 2 * 1e-6 + 2 * 1.35e-6 + nbytes / 22.93e9  # links.yaml: nvlink-c2c 1 µs, slingshot 1.35 µs, 22.93 GB/s
    assert topology.transfer_time(nbytes, 1, 6) == pytest.approx(expected, rel=1e-12)


def test_mi300x_platform_is_an_infinity_fabric_full_mesh_of_eight() -> None:
    topology = Topology.parse("mi300x-platform")
    pairs = _gpu_pairs(topology, "xgmi-mi300x")
    assert pairs == set(itertools.permutations(range(8), 2)) and len(pairs) == 2 * comb(8, 2)
    assert all(sum(1 for a, _ in pairs if a == rank) == 7 for rank in range(8))  # one link to each of 7 peers
    assert hops(topology.path(2, 5)) == [("gpu2", "gpu5", "xgmi-mi300x")]
    doubled = Topology.parse("2xmi300x-platform")
    assert doubled.graph.edges["nic0", "fabric"]["link"].spec.bandwidth == 8 * get_link("roce-400g").bandwidth


@pytest.mark.parametrize(("preset", "switch"), [("dgx-h200", "nvswitch-h200"), ("dgx-b200", "nvswitch-b200")])
def test_dgx_h200_and_b200_are_nvswitch_nodes_with_eight_ndr_ports(preset: str, switch: str) -> None:
    topology = Topology.parse(f"2x{preset}")
    assert not _gpu_pairs(topology, switch) and not [link for link in topology.links() if link.dst.startswith("gpu")
                                                     and link.src.startswith("gpu")]
    for rank in range(8):  # one port per GPU on the node's switch
        assert [n for n in topology.graph.successors(f"gpu{rank}") if n.startswith("nvswitch")] == ["nvswitch0"]
    assert topology.graph.edges["nic0", "fabric"]["link"].spec.bandwidth == 8 * get_link("ib-ndr").bandwidth


def test_h200_nvswitch_transfer_time_is_the_closed_form() -> None:
    topology = Topology.parse("8xH200")
    nbytes = 123_456_789
    # two hops of links.yaml nvswitch-h200: 1.0 µs each, 396.4 GB/s effective
    assert topology.transfer_time(nbytes, 0, 7) == pytest.approx(2 * 1.0e-6 + nbytes / 396.4e9, rel=1e-12)
    assert hops(topology.path(0, 7)) == [("gpu0", "nvswitch0", "nvswitch-h200"), ("nvswitch0", "gpu7", "nvswitch-h200")]


def test_l40s_server_is_pcie_only_with_two_roce_ports() -> None:
    topology = Topology.parse("2xl40s-pcie8")
    assert not [link for link in topology.links() if link.src.startswith("gpu") and link.dst.startswith("gpu")]
    assert not [node for node in topology.graph.nodes if node.startswith("nvswitch")]
    assert hops(topology.path(0, 7)) == [("gpu0", "host0", "pcie4-x16"), ("host0", "gpu7", "pcie4-x16")]
    assert topology.graph.edges["nic0", "fabric"]["link"].spec.bandwidth == 2 * get_link("roce-200g").bandwidth


_REAL_DEVICES = [d.name for d in list_devices() if d.name != "ideal"]


@pytest.mark.parametrize("name", _REAL_DEVICES)
def test_a_multi_node_spec_of_every_device_routes_between_nodes_through_the_nics(name: str) -> None:
    device = get_device(name)
    per_node = min(max_gpus_per_node(device), 8)
    topology = Topology.parse(f"2x{per_node}x{name}")
    assert topology.num_ranks == 2 * per_node and topology.node_of_rank[per_node] == 1
    path = topology.path(0, per_node)
    host_link, port = device.host_link, topology.nodes[0].network.name
    assert [(link.src.split(".")[0], link.dst.split(".")[0]) for link in path] == [
        ("gpu0", "nic0"), ("nic0", "fabric"), ("fabric", "nic1"), ("nic1", f"gpu{per_node}")]
    assert [re.sub(r"-x\d+$", "", link.spec.name) if link.spec.name.startswith(port) else link.spec.name
            for link in path] == [
        host_link, port, port, host_link]


@pytest.mark.parametrize(("spec", "ranks"), [
    ("4x8xA100", 32), ("16x4xGH200", 64), ("8x4xGH200", 32), ("2x8xMI300X", 16), ("2x8xB200", 16),
    ("4x8xL40S", 32), ("2x8xH200", 16), ("4xGH200", 4), ("8xcray-ex-gh200", 32),
])  # fmt: skip
def test_issue_specs_parse(spec: str, ranks: int) -> None:
    topology = Topology.parse(spec)
    assert str(topology) == spec and topology.num_ranks == ranks


@pytest.mark.parametrize(("spec", "hint"), [("8xGH200", "2x4xGH200"), ("16xMI300X", "2x8xMI300X")])
def test_too_many_per_node_suggests_the_multi_node_spec(spec: str, hint: str) -> None:
    with pytest.raises(SpecError, match=hint):
        Topology.parse(spec)


@pytest.mark.parametrize(("text", "message"), [
    ("nodes:\n  - {device: GH200, count: 4, repeat: 2}\nnics_per_node: 8\n", "nics_per_node 8"),
    ("nodes:\n  - {device: GH200, count: 4, intra: pcie}\n", "pcie"),
    ("nodes:\n  - {device: GH200, count: 4, intra: nvswitch}\n", "nvswitch"),
    ("nodes:\n  - {device: H200, count: 8, intra: full-mesh}\n", "full-mesh"),
])  # fmt: skip
def test_impossible_gh200_and_h200_files_are_refused(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        Topology.parse(str(path))


def test_a_gh200_file_with_one_nic_per_superchip_is_accepted(tmp_path) -> None:
    path = tmp_path / "alps.yaml"
    path.write_text("nodes:\n  - {device: GH200, count: 4, repeat: 3}\nnics_per_node: 4\n")
    assert Topology.parse(str(path)).nodes == Topology.parse("3x4xGH200").nodes


def test_every_gh200_preset_has_one_nic_per_gpu() -> None:
    for preset in PRESETS.values():
        if get_device(preset.device).name == "gh200-96gb":
            assert preset.nics == preset.count and Topology.parse(preset.name).nodes[0].nic_per_gpu


def test_topology_list_shows_the_new_presets_devices_and_links() -> None:
    text = format_topology_list()
    for name in ("dgx-h200", "dgx-b200", "cray-ex-gh200", "mi300x-platform", "l40s-pcie8", *NEW_DEVICES,
                 *NEW_LINK_SPECS, "16x4xGH200"):
        assert name in text, name
