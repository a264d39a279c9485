"""The topology spec language: compact strings, named presets and YAML files → a
:class:`~sim.hw.description.ClusterDescription` (what the text says; :mod:`sim.hw.servers` wires it).

Grammar (DESIGN §5; case-insensitive device and preset names, ``x`` or ``X`` as separator)::

    spec   := term ("+" term)*  |  PATH.yaml  |  PATH.yml
    term   := N "x" DEVICE       one server of N GPUs            8xV100, 4xA100-PCIE, 4xGH200, 16xideal, 2xcpu
            | M "x" N "x" DEVICE M servers of N GPUs each       2x8xA100, 16x4xGH200, 2x8xMI300X
            | PRESET | M "x" PRESET                             dgx-a100, 2xdgx-h100, 8xcray-ex-gh200

Each term is one server or several; ranks are numbered term by term, server by server. A server's wiring and NICs
are those of the real system (:func:`sim.hw.node_shapes.default_shape`, applied by :mod:`sim.hw.servers`); a
heterogeneous spec (``A+B``) joins all servers by one fabric running at the slowest server's NIC port speed, each
server keeping its port count.

Reading checks what the text alone decides: its syntax, its counts, its device, preset and link names (looked up in the
catalog) and the ranks a file's ``slowdown:`` names; whether a server of that many devices can be wired is
:mod:`sim.hw.servers`' question. A spec or file may describe at most :data:`sim.hw.description.MAX_RANKS` ranks, checked
term by term (and ``repeat`` x ``count`` entry by entry) before any server is listed, so a huge count costs nothing. A
topology file may have at most ``sim.core.fileio.INPUT_LIMITS["topology file"]`` bytes (256 KiB: YAML parsing takes
seconds per MiB, and ``repeat:`` covers identical servers), and a key may appear once per mapping (YAML 1.2; PyYAML
would keep the last one silently).

YAML topology file schema (unknown or repeated keys are errors)::

    nodes:                     # required, non-empty list of server groups, ranks numbered in this order
      - device: V100           # required: catalog id or alias (sim.hw.catalog.get_device)
        count: 8               # required: GPUs per server, >= 1
        intra: cube-mesh       # optional: cube-mesh | nvswitch | pcie | full-mesh (default: as the grammar picks)
        repeat: 2              # optional: this many identical servers (default 1)
    network: ib-edr            # optional: link type of one NIC port, a name of --topology list's links
                               # (default: the slowest server default)
    nics_per_node: 4           # optional: NIC ports per server (default: each server's own default; a GH200
                               # server has one NIC per GPU, so only its GPU count fits it)
    slowdown: {1: 2}           # optional: RANK: FACTOR, that rank's device takes FACTOR times as long for every
                               # compute op (1 <= FACTOR <= 1000; sim.hw.catalog.slowed_device), its links unchanged

``slowdown`` describes the cluster that ``executor.run --slowdown RANK:FACTOR`` emulates (the same ranks and
factors): ``nodes: [{device: cpu, count: 2}]`` with ``slowdown: {1: 2}`` is two executor ranks on this host whose
rank 1 is a device half as fast, so that the simulator, and a search, cost it as that (a measured profile of
``cpu`` applies to it, times 2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from sim.core.errors import SpecError, did_you_mean
from sim.core.fileio import read_text
from sim.hw.catalog import (
    MAX_SLOWDOWN,
    DeviceSpec,
    device_aliases,
    get_device,
    get_link,
    list_devices,
    list_links,
    load_yaml,
)
from sim.hw.description import MAX_RANKS, MAX_RANKS_REASON, ClusterDescription, ServerGroup, check_rank_count

__all__ = ["Preset", "PRESETS", "parse_description", "load_topology_yaml", "format_topology_list"]


@dataclass(frozen=True)
class Preset:
    """A named real server: ``count`` × ``device`` wired by ``intra`` with ``nics`` × ``network`` ports."""

    name: str
    device: str
    count: int
    intra: str
    network: str
    nics: int
    description: str
    source: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("dgx1-v100", "v100-sxm2-32gb", 8, "cube-mesh", "ib-edr", 4,
               "NVIDIA DGX-1: 8 x V100 SXM2 32 GB, hybrid cube-mesh NVLink, 4 x EDR InfiniBand",
               "hardware.md §2.2 (DGX-1 nvidia-smi topo; four 100 Gb/s IB NICs, DGX-1 V100 whitepaper summary)"),
        Preset("dgx2-v100", "v100-sxm2-32gb", 16, "nvswitch", "ib-edr", 8,
               "NVIDIA DGX-2: 16 x V100 32 GB on NVSwitch, 8 x EDR InfiniBand",
               "hardware.md §2.2 (NVIDIA/nccl-tests#78; Megatron-LM 2019: 8 InfiniBand adapters per server)"),
        Preset("dgx-a100", "a100-sxm4-80gb", 8, "nvswitch", "ib-hdr", 8,
               "NVIDIA DGX A100: 8 x A100 SXM4 80 GB on NVSwitch, 8 x HDR InfiniBand",
               "hardware.md §2.2 (stas00 network README; Selene, Megatron SC'21 §5: 8 x 200 Gb HDR)"),
        Preset("dgx-h100", "h100-sxm5-80gb", 8, "nvswitch", "ib-ndr", 8,
               "NVIDIA DGX H100: 8 x H100 SXM5 80 GB on NVSwitch, 8 x NDR InfiniBand",
               "hardware.md §2.2 (HGX H100 blog copy; stas00 inter-node table: 8 x 400 Gb NDR)"),
        Preset("p3.16xlarge", "v100-sxm2-16gb", 8, "cube-mesh", "eth-25g", 1,
               "AWS p3.16xlarge: 8 x V100 SXM2 16 GB, hybrid cube-mesh NVLink, 25 Gb Ethernet",
               "hardware.md §2.5/§3 (mlsys-seo/ooo-backprop AWS-doc: 8 x V100 with NVLink, 25 Gbps)"),
        Preset("dgx-h200", "h200-sxm-141gb", 8, "nvswitch", "ib-ndr", 8,
               "NVIDIA DGX H200: 8 x H200 SXM 141 GB on NVSwitch, 8 x NDR InfiniBand",
               "NVIDIA DGX BasePOD reference architecture, core components (https://docs.nvidia.com/dgx-basepod/"
               "reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html): eight "
               "Hopper GPUs, 1,128 GB for H200, four NVSwitch chips, 'eight single-port NVIDIA ConnectX-7 VPI ... up "
               "to 400 Gb/s InfiniBand/Ethernet'"),
        Preset("dgx-b200", "b200-sxm-180gb", 8, "nvswitch", "ib-ndr", 8,
               "NVIDIA DGX B200: 8 x B200 180 GB on NVSwitch (NVLink 5), 8 x NDR InfiniBand",
               "NVIDIA DGX B200 user guide (https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200"
               ".html): 8 x B200, 1,440 GB, 2 x 5th generation NVLink switches, '8 x NVIDIA ConnectX-7 Single Port "
               "Cards ... InfiniBand (default): Up to 400Gbps'"),
        Preset("cray-ex-gh200", "gh200-96gb", 4, "full-mesh", "slingshot-11", 4,
               "HPE Cray EX node (CSCS Alps): 4 x GH200 96 GB, NVLink all-to-all, a Slingshot-11 NIC per GPU",
               "CSCS Alps hardware page and GH200 node schematic (https://github.com/eth-cscs/cscs-docs/blob/"
               "80abed138e7cc52ebf6703b82ed02520ab9bf92f/docs/alps/hardware.md): 'four Grace-Hopper modules and four "
               "corresponding network interface cards', 'GPU All2all: 3x6 NVLink P2P 150GB/s per direction', "
               "'Slingshot hsn0..hsn3 200Gb/s (25GB/s)'"),
        Preset("mi300x-platform", "mi300x-192gb", 8, "full-mesh", "roce-400g", 8,
               "AMD Instinct MI300X platform: 8 x MI300X 192 GB, Infinity Fabric full mesh, 8 x 400 GbE RoCE",
               "stas00/ml-engineering network/README.md 'Infinity Fabric / xGMI' (7 links per GPU, one per peer; "
               "https://www.amd.com/en/products/accelerators/instinct/mi300/platform.html); 8 x 400 Gb/s ConnectX-7, "
               "one per GPU (https://rocm.docs.amd.com/en/latest/how-to/rocm-for-ai/inference/benchmark-docker/"
               "vllm-mori-distributed.html)"),
        Preset("l40s-pcie8", "l40s-48gb", 8, "pcie", "roce-200g", 2,
               "PCIe server: 8 x L40S 48 GB (no NVLink), 2 x 200 GbE RoCE [network assumed]",
               "8 GPUs is the PCIe box limit of sim.hw.node_shapes (hardware.md §2.2); L40S has no NVLink and runs on "
               "PCIe 4.0 x16 (devices.yaml l40s-48gb); network 2 x 200 GbE RoCE [assumed], see node_shapes._NETWORK"),
    )
}  # fmt: skip

_TERM = re.compile(r"(\d+)[xX](?:(\d+)[xX])?(.+)")
_COUNT_DIGITS = len(str(MAX_RANKS))  # a longer count is over the limit whatever its digits (and int() stays cheap)
_YAML_SUFFIXES = (".yaml", ".yml")


def _preset_group(preset: Preset, servers: int, where: str) -> ServerGroup:
    return ServerGroup(get_device(preset.device), preset.count, servers, preset.intra, preset.name,
                       get_link(preset.network), preset.nics, where=where)


def _parse_term(term: str, where: str) -> ServerGroup:
    """The servers of one ``+``-separated term (``where``: how an error about them begins)."""
    if not term:
        raise SpecError("empty term (a '+' with nothing on one side)")
    if term.lower() in PRESETS:
        return _preset_group(PRESETS[term.lower()], 1, where)
    match = _TERM.fullmatch(term)
    if match is None:
        try:
            device = _device(term)
        except SpecError as exc:
            hint = str(exc) if "did you mean" in str(exc) else "expected NxDEVICE, MxNxDEVICE or a preset, e.g. 8xV100"
            raise SpecError(f"cannot read {term!r}: {hint}") from None
        raise SpecError(f"{term!r} has no GPU count: write NxDEVICE, e.g. 8x{term} ({device.name})")
    first, second, name = match.groups()
    if max(len(first.lstrip("0")), len((second or "").lstrip("0"))) > _COUNT_DIGITS:
        raise SpecError(f"{term!r}: a count over {_COUNT_DIGITS} digits; at most {MAX_RANKS} ranks are supported "
                        f"({MAX_RANKS_REASON})")
    preset = PRESETS.get(name.lower())
    if preset is not None and second is not None:
        raise SpecError(f"{term!r}: a preset is a whole server, so only Mx{name} is allowed")
    servers, count = (int(first), 1) if preset else ((1, int(first)) if second is None else (int(first), int(second)))
    if servers < 1 or count < 1:
        raise SpecError(f"{term!r}: server and GPU counts must be >= 1")
    check_rank_count(servers * count, f"{term!r} would make")
    if preset:
        return _preset_group(preset, servers, where)
    return ServerGroup(_device(name), count, servers, name=name, where=where)


def _device(name: str) -> DeviceSpec:
    """``get_device(name)``, also suggesting presets when the name is unknown."""
    try:
        return get_device(name)
    except SpecError:
        hint = did_you_mean(name, PRESETS, n=2, cutoff=0.6)
        if hint:
            raise SpecError(f"unknown device or preset {name!r}{hint}") from None
        raise


def parse_description(spec: str) -> ClusterDescription:
    """What topology ``spec`` says (grammar in the module docstring): a compact spec, or a YAML file's path.

    Raises:
        SpecError: anything malformed; the message contains ``spec``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty topology spec ({spec!r}); try 8xV100 or see --topology list")
    if spec.strip().lower().endswith(_YAML_SUFFIXES):
        return load_topology_yaml(spec.strip())
    try:
        groups: list[ServerGroup] = []
        for term in spec.split("+"):
            groups.append(_parse_term(term.strip(), f"bad topology {spec!r}: {term.strip()!r}"))
            check_rank_count(sum(group.ranks for group in groups), "the terms would make")
    except SpecError as exc:
        raise SpecError(f"bad topology {spec!r}: {exc}") from None
    return ClusterDescription(spec, tuple(groups))


def _int_field(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _keys(mapping: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(map(str, set(mapping) - allowed))
    if unknown:
        close = did_you_mean(unknown[0], allowed) if len(unknown) == 1 else ""
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)}{close} (known: {', '.join(sorted(allowed))})")


def load_topology_yaml(path: str) -> ClusterDescription:
    """What a YAML topology file says (schema in the module docstring).

    Raises:
        SpecError: missing or unreadable file, malformed YAML, or a bad field; the message names the file and field.
    """
    where = f"topology file {path!r}"
    try:
        data = load_yaml(read_text(path, "topology file"))
    except OSError as exc:
        raise SpecError(f"{where}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: malformed YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping with a 'nodes:' list, got {type(data).__name__}")
    _keys(data, {"nodes", "network", "nics_per_node", "slowdown"}, where)
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise SpecError(f"{where}: 'nodes' must be a non-empty list, got {nodes!r}")
    groups: list[ServerGroup] = []
    ranks = 0
    for i, entry in enumerate(nodes):
        at = f"{where}: nodes[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(f"{at} must be a mapping with device and count, got {entry!r}")
        _keys(entry, {"device", "count", "intra", "repeat"}, at)
        if not isinstance(entry.get("device"), str):
            raise SpecError(f"{at}.device must be a device name, got {entry.get('device')!r}")
        intra = entry.get("intra")
        if intra is not None and not isinstance(intra, str):
            raise SpecError(f"{at}.intra must be a string, got {intra!r}")
        count = _int_field(entry.get("count"), f"{at}.count")
        repeat = _int_field(entry.get("repeat", 1), f"{at}.repeat")
        ranks += count * repeat  # checked before the servers are listed: repeat may be 10**10
        check_rank_count(ranks, f"{at}: repeat {repeat} x count {count} would bring the topology to")
        try:
            device = get_device(entry["device"])
        except SpecError as exc:
            raise SpecError(f"{at}: {exc}") from None
        groups.append(ServerGroup(device, count, repeat, intra, where=at))
    network, nics = data.get("network"), data.get("nics_per_node")
    if network is not None:
        try:
            if not isinstance(network, str):
                raise SpecError(f"must be a link name, got {network!r}")
            network = get_link(network)
        except SpecError as exc:
            raise SpecError(f"{where}: network: {exc}") from None
    if nics is not None:
        nics = _int_field(nics, f"{where}: nics_per_node")
    slowdown = _slowdown(data["slowdown"], ranks, f"{where}: slowdown") if "slowdown" in data else ()
    return ClusterDescription(path, tuple(groups), network, nics, slowdown)


def _slowdown(factors: Any, ranks: int, where: str) -> tuple[tuple[int, float], ...]:
    """The ``slowdown:`` mapping (global rank → factor) of a topology of ``ranks`` ranks, checked, as pairs."""
    if not isinstance(factors, dict) or not factors:
        raise SpecError(f"{where} must be a mapping of rank to factor, e.g. {{1: 2}}, got {factors!r}")
    for rank, factor in factors.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
            raise SpecError(f"{where}: rank {rank!r} is not a rank of this topology (0..{ranks - 1})")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 <= factor <= MAX_SLOWDOWN:
            raise SpecError(f"{where}: rank {rank}'s factor must be a number from 1 (as fast as the catalog's "
                            f"device) to {MAX_SLOWDOWN:g}, got {factor!r}")
    return tuple((rank, float(factor)) for rank, factor in factors.items())


def format_topology_list() -> str:
    """What ``--topology list`` prints: the grammar, the presets and the device names."""
    lines = [
        "Topology specs:",
        "  NxDEVICE          one server of N GPUs, wired as the real system is (8xV100 = DGX-1 cube-mesh,",
        "                    16xV100 = DGX-2 NVSwitch, 8xA100 / 8xH100 / 8xH200 / 8xB200 = NVSwitch, 4xGH200 =",
        "                    HPE Cray EX node with NVLink all-to-all, 8xMI300X = Infinity Fabric mesh, PCIe cards",
        "                    such as L40S through the host)",
        "  MxNxDEVICE        M such servers joined by their InfiniBand / Slingshot / Ethernet network (2x8xA100,",
        "                    16x4xGH200, 2x8xMI300X)",
        "  A+B+...           heterogeneous: servers of each term, ranks in term order (4xV100+4xA100)",
        "  PRESET, MxPRESET  a named server, or M of them (2xdgx-a100)",
        "  Nxideal           N ideal devices, every transfer free (analytic checks)",
        "  Nxcpu             N executor ranks on this host, gloo over loopback (real runs: executor.run)",
        "  FILE.yaml         a YAML topology file (nodes: [{device, count, intra, repeat}], network, nics_per_node,",
        "                    slowdown: {RANK: FACTOR} for a device FACTOR times slower, as executor.run --slowdown)",
        "",
        "Presets:",
    ]
    lines += [f"  {p.name:<17} {p.description}" for p in PRESETS.values()]
    lines += ["", "Devices (catalog id, alias):"]
    lines += [f"  {d.name:<17} {', '.join(device_aliases(d.name))}".rstrip() for d in list_devices()]
    lines += ["", "Links (what a YAML file's 'network:' names; per direction: effective / spec bandwidth, latency "
              "per hop):"]
    lines += [f"  {link.name:<17} {_gbs(link.bandwidth):>11} / {_gbs(link.spec_bandwidth):<11} "
              f"{link.latency * 1e6:g} us" for link in list_links()]
    return "\n".join(lines)


def _gbs(bandwidth: float) -> str:
    return "inf" if math.isinf(bandwidth) else f"{bandwidth / 1e9:g} GB/s"
