"""What one server (node) of each device is: its wiring, its NVLink domain and its network ports, as real systems
have them.

A :class:`NodeShape` says what one server holds: ``count`` GPUs of one device, how they are wired to each other
(``intra``), and its network ports. :func:`default_shape` picks the wiring and ports a real server of that device
has; :mod:`sim.hw.servers` applies it to each group of a topology's description, and :mod:`sim.hw.link_graph` turns
the servers into their link graph.

Intra-node wiring (``intra``):

* ``cube-mesh``: the DGX-1 V100 hybrid cube-mesh, restricted to GPUs 0..count-1, with the exact NVLink pairs of
  hardware.md §2.2 (:data:`DGX1_NVLINK_PAIRS`: two-link pairs ``nvlink2-x2``, one-link pairs ``nvlink2-x1``); other
  pairs meet at the host.
* ``nvswitch``: every GPU has one link of its generation's NVSwitch type (:func:`switch_link`) to the server's
  NVSwitch (DGX-2, DGX A100/H100/H200, DGX B200).
* ``pcie``: no GPU-to-GPU link; GPUs meet at the host over their PCIe links (PCIe cards such as the L40S).
* ``full-mesh``: every GPU pair has its own direct link of the device's mesh type (:func:`mesh_link`): 6 x NVLink 4
  between the four GH200 of an HPE Cray EX node, one Infinity Fabric link between the eight MI300X of an AMD
  platform, ``ideal`` for the ideal device.

Between servers a server has ``nics`` ports of its ``network`` link type; where the source says each GPU has its own
NIC and the host link is faster than the port (GH200, GB200, GB300), ``nic_per_gpu`` gives GPU i its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec, LinkSpec, get_link

__all__ = [
    "NodeShape",
    "INTRA_KINDS",
    "DGX1_NVLINK_PAIRS",
    "RACK_SCALE",
    "C2C_HOSTED",
    "IDEAL_MAX",
    "mesh_link",
    "switch_link",
    "default_shape",
    "max_gpus_per_node",
    "check_shape",
]

INTRA_KINDS = ("cube-mesh", "nvswitch", "pcie", "full-mesh")

#: DGX-1 (V100) NVLink pairs → number of NVLink2 links, from ``nvidia-smi topo -m`` of a real DGX-1
#: (hardware.md §2.2; microsoft/msccl-tools tests/test_topologies.py, NVIDIA/nccl#671). Pairs not listed have none.
DGX1_NVLINK_PAIRS: dict[tuple[int, int], int] = {
    (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 5): 2, (2, 3): 2, (4, 7): 2, (5, 6): 2, (6, 7): 2,
    (0, 1): 1, (0, 2): 1, (1, 3): 1, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (5, 7): 1,
}  # fmt: skip

_V100_SXM2 = ("v100-sxm2-16gb", "v100-sxm2-32gb")
_CUBE_MESH_MAX = 8  # the DGX-1 has 8 GPUs
IDEAL_MAX = 256  # a full mesh has n(n-1) directed links; bounded to keep the graph small

# device → (link type of every GPU pair, most GPUs) of a full mesh:
# - GH200: an HPE Cray EX node holds 4 superchips, each pair joined by 6 NVLink 4 links ('GPU All2all: 3x6 NVLink',
#   CSCS Alps GH200 node schematic, cited in links.yaml nvlink4-x6);
# - MI300X: the AMD platform holds 8 OAM modules, each with 7 Infinity Fabric links, one to each peer (stas00
#   network README, cited in links.yaml xgmi-mi300x);
# - TPU v3: the 8 cores (4 chips x 2 TensorCores) of a v3-8 board, every pair on one ICI link [a simplification: the
#   four chips form a 2 x 2 torus and the two cores of a chip share it; a pipeline talks only to its neighbour, and
#   every neighbour pair of the simplification has the one link the board gives it];
# - ideal: every pair on an ideal link.
_MESH: dict[str, tuple[str, int]] = {
    "ideal": ("ideal", IDEAL_MAX),
    "tpu-v3-core": ("ici-tpu-v3", 8),
    "gh200-96gb": ("nvlink4-x6", 4),
    "mi300x-192gb": ("xgmi-mi300x", 8),
}
#: GPUs whose host link is NVLink-C2C to their own Grace CPU: no PCIe path joins two of them, and their host is not a
#: transit node of the link graph (:mod:`sim.hw.link_graph`).
C2C_HOSTED = frozenset({"gh200-96gb"})
# GPUs with their own NIC each, where the source says so and it matters (host link faster than the port, see the
# module docstring): GH200, 'four Grace-Hopper modules and four corresponding network interface cards' (CSCS Alps
# hardware page, docs/alps/hardware.md in eth-cscs/cscs-docs).
_NIC_PER_GPU = frozenset({"gh200-96gb", "gb200", "gb300"})
_PCIE_MAX = 8  # PCIe boxes hold 4-8 GPUs (hardware.md §2.2 'PCIe boxes without NVLink', NVIDIA/nccl#814)
_CPU_MAX = 64  # executor ranks (processes) on one host; beyond the core count they only oversubscribe it

# device → (NVSwitch link type, most GPUs on one NVSwitch node). DGX-2: 16 V100 on NVSwitch gen1; DGX A100 / H100:
# 8 GPUs on NVSwitch gen2 / gen3 (hardware.md §2.1-§2.2); H800 servers: 8 GPUs on NVSwitch (DeepSeek-V3, arXiv
# 2412.19437 §3.1: 'Each node in the H800 cluster contains 8 GPUs connected by NVLink and NVSwitch'); DGX H200: 8
# GPUs, NVSwitch gen3; DGX B200: 8 GPUs, NVSwitch
# gen4 (NVIDIA DGX BasePOD reference architecture and DGX B200 user guide, cited in grammar.PRESETS).
_SWITCH: dict[str, tuple[str, int]] = {
    "v100-sxm2-16gb": ("nvswitch-v100", 16),
    "v100-sxm2-32gb": ("nvswitch-v100", 16),
    "a100-sxm4-40gb": ("nvswitch-a100", 8),
    "a100-sxm4-80gb": ("nvswitch-a100", 8),
    "h100-sxm5-80gb": ("nvswitch-h100", 8),
    "h100-sxm-96gb-hbm2e": ("nvswitch-h100", 8),
    "h800-sxm5-80gb": ("nvswitch-h800", 8),
    "h200-sxm-141gb": ("nvswitch-h200", 8),
    "b200-sxm-180gb": ("nvswitch-b200", 8),
    "b300-sxm-270gb": ("nvswitch-b200", 8),
    "gb200": ("nvlink-switch-nvl72", 72),
    "gb300": ("nvlink-switch-nvl72", 72),
}
#: Devices sold as NVLink domains of a rack: ``NxDEVICE`` means N GPUs handed out in such domains (the last one
#: partial, as a scheduler allocates them) rather than one server.
RACK_SCALE = frozenset({"gb200", "gb300"})

# device → (NIC port type, ports per server) between servers:
# - V100 SXM2: DGX-1V has 4 × 100 Gb/s InfiniBand (hardware.md §2.2; 8 on a DGX-2, see default_shape);
# - A100 SXM4: DGX A100 / Selene, 8 × HDR (hardware.md §2.2, Megatron SC'21 §5);
# - H100 SXM5: DGX H100, 8 × NDR (hardware.md §2.2, stas00 inter-node table);
# - H800: DeepSeek-V3's cluster, 'cross-node GPUs are fully interconnected with IB' at 50 GB/s each (arXiv 2412.19437
#   §3.2.2), one 400 Gb/s port per GPU: NDR;
# - H200, B200: DGX H200 / DGX B200, 8 single-port ConnectX-7 at 400 Gb/s, InfiniBand by default (NDR);
# - H100 96 GB HBM2e: Meta's Grand Teton hosts, '400 Gbps RDMA' per GPU (torchtitan's benchmark files), RoCE as Meta's
#   Llama 3 clusters run it (Llama 3 report, arXiv 2407.21783 §3.3.1: 'RDMA over Converged Ethernet (RoCE) fabric');
# - GH200: HPE Cray EX node, one Slingshot-11 NIC per superchip (CSCS Alps; the count follows the GPUs, see below);
# - GB200 NVL72: one 400 Gb/s ConnectX-7 per GPU, four per compute tray (fibermall's GB200 analysis; dev.to/aicplight:
#   'In B200-based systems, high-performance 400Gb/s network adapters (ConnectX-7 SuperNICs)'), InfiniBand NDR;
# - GB300 NVL72 and B300: ConnectX-8 at 800 Gb/s, one per GPU (NVIDIA's GB300 NVL72 reference architecture: '4
#   ConnectX-8 Host Channel Adapters' per four-GPU tray; dev.to/aicplight: 'B300 platforms ... 800Gb/s-class adapters
#   (ConnectX-8 SuperNICs)'), InfiniBand XDR;
# - MI300X: one 400 Gb/s NIC per GPU, 8 per node, taken as RoCE 400 GbE (AMD ROCm docs, cited in links.yaml roce-400g);
# - L40S: PCIe servers on Ethernet: 2 × 200 GbE RoCE per server [assumed: naddod's L40S guide asks for '200Gbps RoCE
#   or IB' without a port count; one port per CPU socket of a two-socket server];
# - V100 PCIe, T4: 10 GbE, the PipeDream Cluster-A servers of 4 × V100 PCIe (hardware.md §3, [recalled]);
# - A10, RTX 3090/4090: 25 GbE [assumed: commodity servers; the p3.16xlarge rate of hardware.md §2.5];
# - A100/H100 PCIe: 100 GbE [assumed: hardware.md §2.5 Ethernet rates; no cited server];
# - cpu: 10 GbE [assumed: commodity hosts running the executor on several machines];
# - P100 PCIe: 10 GbE [assumed: the 2017-era servers of GPipe Table 3; only one server is ever used there];
# - TPU v3 core: 100 GbE [assumed: the data-centre network between TPU hosts; pods are joined by ICI instead, which
#   this catalog does not model beyond one board];
# - ideal: the ideal link.
_NETWORK: dict[str, tuple[str, int]] = {
    "v100-sxm2-16gb": ("ib-edr", 4),
    "v100-sxm2-32gb": ("ib-edr", 4),
    "a100-sxm4-40gb": ("ib-hdr", 8),
    "a100-sxm4-80gb": ("ib-hdr", 8),
    "h100-sxm5-80gb": ("ib-ndr", 8),
    "h100-sxm-96gb-hbm2e": ("roce-400g", 8),
    "h800-sxm5-80gb": ("ib-ndr", 8),
    "h200-sxm-141gb": ("ib-ndr", 8),
    "b200-sxm-180gb": ("ib-ndr", 8),
    "b300-sxm-270gb": ("ib-xdr", 8),
    "gb200": ("ib-ndr", 72),
    "gb300": ("ib-xdr", 72),
    "gh200-96gb": ("slingshot-11", 4),
    "mi300x-192gb": ("roce-400g", 8),
    "l40s-48gb": ("roce-200g", 2),
    "v100-pcie-16gb": ("eth-10g", 1),
    "v100-pcie-32gb": ("eth-10g", 1),
    "t4-16gb": ("eth-10g", 1),
    "a10-24gb": ("eth-25g", 1),
    "rtx3090-24gb": ("eth-25g", 1),
    "rtx4090-24gb": ("eth-25g", 1),
    "a100-pcie-40gb": ("eth-100g", 1),
    "a100-pcie-80gb": ("eth-100g", 1),
    "h100-pcie-80gb": ("eth-100g", 1),
    "cpu": ("eth-10g", 1),
    "p100-pcie-16gb": ("eth-10g", 1),
    "tpu-v3-core": ("eth-100g", 1),
    "ideal": ("ideal", 1),
}
_DGX2_NICS = 8  # DGX-2H: '8 InfiniBand adapters per server' (hardware.md §2.2, Megatron-LM 2019)


@dataclass(frozen=True)
class NodeShape:
    """One server: ``count`` GPUs of ``device``, wired by ``intra``, with ``nics`` ports of ``network``.

    Attributes:
        device: the device of every GPU in the server.
        count: GPUs in the server.
        intra: one of :data:`INTRA_KINDS`.
        network: link type of one NIC port (used only when the topology has more than one server).
        nics: NIC ports of the server.
        preset: the preset the server came from (``"dgx-a100"``), or ``""``.
        nic_per_gpu: each GPU has its own NIC (``nics == count``) instead of sharing the server's ports.
        slowdown: per GPU of the server, how many times as long its compute ops take as ``device``'s
            (:func:`sim.hw.catalog.slowed_device`; a topology file's ``slowdown:``); empty when none is slowed. The
            wiring and the network stay ``device``'s.
    """

    device: DeviceSpec
    count: int
    intra: str
    network: LinkSpec
    nics: int
    preset: str = ""
    nic_per_gpu: bool = False
    slowdown: tuple[float, ...] = ()


def _max_gpus(device: DeviceSpec, intra: str) -> int:
    """The most GPUs of ``device`` a server with ``intra`` wiring holds; 0 if that wiring is impossible."""
    if intra == "full-mesh":
        return _MESH.get(device.name, ("", 0))[1]
    if device.name == "ideal":
        return 0
    if intra == "cube-mesh":
        return _CUBE_MESH_MAX if device.name in _V100_SXM2 else 0
    if intra == "nvswitch":
        return _SWITCH.get(device.name, ("", 0))[1]
    if intra == "pcie":
        if device.name in C2C_HOSTED:
            return 0
        return _CPU_MAX if device.name == "cpu" else _PCIE_MAX
    return 0


def mesh_link(device: DeviceSpec) -> LinkSpec:
    """The link type joining every GPU pair of a ``full-mesh`` server of ``device``.

    Raises:
        SpecError: ``device`` has no full-mesh server.
    """
    if device.name not in _MESH:
        raise SpecError(f"{device.name} cannot be wired as 'full-mesh'")
    return get_link(_MESH[device.name][0])


def switch_link(device: DeviceSpec) -> LinkSpec:
    """The link type joining each GPU of an ``nvswitch`` server of ``device`` to its NVSwitch.

    Raises:
        SpecError: ``device`` has no NVSwitch server.
    """
    if device.name not in _SWITCH:
        raise SpecError(f"{device.name} cannot be wired as 'nvswitch'")
    return get_link(_SWITCH[device.name][0])


def max_gpus_per_node(device: DeviceSpec) -> int:
    """The most GPUs of ``device`` in one server over all wirings (for the 'write MxNxDEV' hint)."""
    return max(_max_gpus(device, intra) for intra in INTRA_KINDS)


def check_shape(device: DeviceSpec, count: int, intra: str) -> None:
    """Raise :class:`SpecError` unless a server can hold ``count`` GPUs of ``device`` wired by ``intra``."""
    if intra not in INTRA_KINDS:
        raise SpecError(f"unknown intra-node wiring {intra!r} (known: {', '.join(INTRA_KINDS)})")
    limit = _max_gpus(device, intra)
    if limit == 0:
        raise SpecError(f"{device.name} cannot be wired as {intra!r}")
    if not 1 <= count <= limit:
        raise SpecError(f"a {intra} server holds 1 to {limit} x {device.name}, got {count}")


def default_shape(device: DeviceSpec, count: int, intra: str | None = None) -> NodeShape:
    """The server a real system of ``count`` × ``device`` has (wiring and network defaults above).

    Args:
        device: the GPU model.
        count: GPUs in the server.
        intra: force this wiring instead of the default one.

    Raises:
        SpecError: the server cannot be built; the message suggests ``MxNxDEV`` when ``count`` is too large.
    """
    if intra is None:
        if device.name in _MESH:
            intra = "full-mesh"
        elif device.name in _V100_SXM2:
            intra = "cube-mesh" if count <= _CUBE_MESH_MAX else "nvswitch"
        elif device.name in _SWITCH:
            intra = "nvswitch"
        else:
            intra = "pcie"
        limit = max_gpus_per_node(device)
        if count > limit:
            hint = f"{count // limit}x{limit}x{device.name}" if count % limit == 0 else f"Mx{limit}x{device.name}"
            raise SpecError(f"one server holds at most {limit} x {device.name}, got {count}; write e.g. {hint}")
    check_shape(device, count, intra)
    network, nics = _NETWORK[device.name]
    if device.name in _V100_SXM2 and intra == "nvswitch":
        nics = _DGX2_NICS
    per_gpu = device.name in _NIC_PER_GPU
    if per_gpu:
        nics = count  # one NIC per GPU: a server of 2 of the 4 superchips has 2
    return NodeShape(device=device, count=count, intra=intra, network=get_link(network), nics=nics,
                     nic_per_gpu=per_gpu)
