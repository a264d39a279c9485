"""The hardware catalog: devices (accelerators) and link types, loaded from ``profiles/hardware/*.yaml``.

Every number comes from the data files, and every entry there carries a ``source`` that cites
``shared/reference/hardware.md`` or, for what that lacks, a public URL. The data files use human units (TFLOP/s, GB,
GB/s, µs, with 1 GB = 1e9 bytes); this module converts them once to SI units, so every :class:`DeviceSpec` and
:class:`LinkSpec` field is in FLOP/s, bytes, bytes/s or seconds.

Lookups are case-insensitive and accept short aliases (``V100``, ``A100``, ``H200``, ``GH200``, ``MI300X``, ...); an
unknown name raises :class:`~sim.core.errors.SpecError` with the closest known names. A data file that is malformed (a
missing field, a non-positive number, an unknown ``host_link``, a duplicate name or alias) fails on first use with a
message naming the file, the entry and the field. YAML here and in topology files (:mod:`sim.hw.grammar`) is read with
:func:`load_yaml`, which refuses a key that appears twice in one mapping (PyYAML would keep the last silently).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from sim.core.errors import SpecError, did_you_mean

__all__ = [
    "DeviceSpec",
    "LinkSpec",
    "Catalog",
    "load_catalog",
    "get_device",
    "get_link",
    "list_devices",
    "list_links",
    "device_aliases",
    "load_yaml",
    "DuplicateKeyError",
    "slowed_device",
    "MAX_SLOWDOWN",
]

_GIGA = 1e9  # GB and GB/s in the data files are decimal
_TERA = 1e12
_PER_MICRO = 1e6  # µs per s; dividing keeps e.g. 7.5 µs exactly 7.5e-06 s


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model.

    Attributes:
        name: catalog id, e.g. ``"v100-sxm2-32gb"``.
        peak_flops: dense fp16/bf16 tensor-core peak, FLOP/s (on GeForce cards the FP32-accumulate rate).
        matmul_efficiency: large-GEMM ceiling divided by ``peak_flops``, in (0, 1].
        memory_bytes: device memory, bytes (``math.inf`` only for the ideal device).
        memory_bandwidth: device memory bandwidth, bytes/s.
        launch_overhead_s: fixed cost per op (kernel launch and the like), s.
        host_link: name of the :class:`LinkSpec` of the card's link to its host memory: PCIe x16, or NVLink-C2C to
            the Grace CPU on a GH200.
        source: citation of every number above.
        peak_fp32_flops: dense FP32 peak, FLOP/s: the CUDA-core (AMD: vector) rate that fp32 layers run at, with no
            TF32 or tensor-core path (:mod:`sim.cost.oracle`); at most ``peak_flops`` on every catalog GPU.
        compute_units: streaming multiprocessors (compute units on AMD), the slots a kernel's thread blocks fill in
            waves; 0 for a CPU or the ideal device, which the kernel-level GPU model (:mod:`sim.cost.gpu_time`)
            then leaves to the roofline.
        base: for a slowed copy of a catalog device (:func:`slowed_device`), that catalog device; ``None`` for a
            catalog device itself.
        slowdown: how many times as long each compute op takes as on ``base`` (1.0 for a catalog device).
        peak_fp8_flops: dense FP8 tensor-core peak, FLOP/s; 0 for a device without FP8 (``--precision fp8`` is
            refused on it).
        fp8_matmul_efficiency: large FP8 GEMMs' ceiling divided by ``peak_fp8_flops``, in (0, 1]; 0 without FP8.
        peak_fp4_flops: dense FP4 tensor-core peak, FLOP/s, where the device has FP4 (Blackwell); 0 otherwise
            (``--precision nvfp4`` runs on it).
        fp4_matmul_efficiency: large FP4 GEMMs' ceiling divided by ``peak_fp4_flops``, where a source measures it;
            0 where none does, and FP4 GEMMs then run at ``fp8_matmul_efficiency`` (:attr:`fp4_throughput`).
        attention_efficiency: the attention kernel's (PyTorch's SDPA, FlashAttention-2) achieved FLOP/s divided by
            ``peak_flops``, in (0, 1], where a source measures it; 0 where none does, and the kernel model then
            uses ``matmul_efficiency`` (:attr:`attention_throughput`).
    """

    name: str
    peak_flops: float
    matmul_efficiency: float
    memory_bytes: float
    memory_bandwidth: float
    launch_overhead_s: float
    host_link: str
    source: str = field(repr=False)
    peak_fp32_flops: float
    compute_units: int = 0
    base: DeviceSpec | None = field(default=None, repr=False)
    slowdown: float = 1.0
    peak_fp8_flops: float = 0.0
    fp8_matmul_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    peak_fp4_flops: float = 0.0
    fp4_matmul_efficiency: float = 0.0

    @property
    def fp4_throughput(self) -> float:
        """FLOP/s of large FP4 GEMMs: ``peak_fp4_flops`` times ``fp4_matmul_efficiency``, or the FP8 ceiling's
        efficiency where the catalog has no FP4 measurement."""
        return self.peak_fp4_flops * (self.fp4_matmul_efficiency or self.fp8_matmul_efficiency)

    @property
    def attention_throughput(self) -> float:
        """FLOP/s of the attention kernel: ``peak_flops`` times ``attention_efficiency``, or ``matmul_efficiency``
        where the catalog has no attention figure."""
        return self.peak_flops * (self.attention_efficiency or self.matmul_efficiency)

    @property
    def hardware(self) -> DeviceSpec:
        """The catalog device this one runs on: itself, or the device a slowed copy was made from."""
        return self if self.base is None else self.base

    @property
    def is_gpu(self) -> bool:
        """Whether the device runs kernels on compute units (a GPU), so that its kernels can be costed one by one."""
        return self.compute_units > 0


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link, per direction.

    Attributes:
        name: catalog id, e.g. ``"nvlink2-x2"``, ``"pcie4-x16"``, ``"ib-hdr"``, ``"ideal"``.
        bandwidth: effective payload bandwidth for large messages, bytes/s per direction (``math.inf`` for ideal).
        latency: per-message latency of one hop over this link, s (0 for ideal).
        spec_bandwidth: vendor per-direction bandwidth, bytes/s.
        source: citation of every number above.
    """

    name: str
    bandwidth: float
    latency: float
    spec_bandwidth: float
    source: str = field(repr=False)


@dataclass(frozen=True)
class Catalog:
    """The parsed data files.

    Attributes:
        devices: catalog id → device.
        links: catalog id → link type.
        device_names: every accepted lower-case name (catalog id or alias) → catalog id.
        aliases: catalog id → its aliases as written in the data file.
    """

    devices: Mapping[str, DeviceSpec]
    links: Mapping[str, LinkSpec]
    device_names: Mapping[str, str]
    aliases: Mapping[str, tuple[str, ...]]


_DEVICE_FIELDS = ("name", "aliases", "peak_tflops", "peak_fp32_tflops", "matmul_efficiency", "memory_gb",
                  "memory_bandwidth_gbs", "launch_overhead_us", "host_link", "source")
#: Fields a device entry may leave out (older catalogs): ``compute_units`` (0, the roofline), the FP8 peak and
#: its GEMM efficiency (0: no FP8), which come together, and the attention kernel's efficiency (0: the GEMMs').
_OPTIONAL_DEVICE_FIELDS = ("compute_units", "peak_fp8_tflops", "fp8_matmul_efficiency", "attention_efficiency",
                           "peak_fp4_tflops", "fp4_matmul_efficiency")
_LINK_FIELDS = ("name", "bandwidth_gbs", "spec_bandwidth_gbs", "latency_us", "source")


def _entries(data: Any, key: str, where: str) -> list[dict[str, Any]]:
    """The list under ``key`` of a loaded YAML document, each item a mapping."""
    if not isinstance(data, dict) or not isinstance(data.get(key), list) or not data[key]:
        raise SpecError(f"{where}: expected a top-level '{key}:' list of entries")
    for i, entry in enumerate(data[key]):
        if not isinstance(entry, dict):
            raise SpecError(f"{where}: {key}[{i}] must be a mapping, got {entry!r}")
    return data[key]


def _check_fields(entry: dict[str, Any], fields: tuple[str, ...], where: str,
                  optional: tuple[str, ...] = ()) -> None:
    """Reject missing or unknown fields and an empty name or source."""
    missing = [f for f in fields if f not in entry]
    unknown = sorted(set(entry) - set(fields) - set(optional))
    if missing or unknown:
        raise SpecError(f"{where}: missing field(s) {missing} / unknown field(s) {unknown}")
    for key in ("name", "source"):
        if not isinstance(entry[key], str) or not entry[key].strip():
            raise SpecError(f"{where}: field '{key}' must be a non-empty string, got {entry[key]!r}")


def _number(entry: dict[str, Any], key: str, where: str, *, allow_inf: bool, allow_zero: bool = False) -> float:
    """``entry[key]`` as a float > 0 (≥ 0 if ``allow_zero``); ``inf`` only if ``allow_inf``."""
    value = entry[key]
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (value > 0 or (allow_zero and value == 0)) and (allow_inf or math.isfinite(value))
    if not ok:
        kind = ">= 0" if allow_zero else "> 0"
        raise SpecError(
            f"{where}: field '{key}' must be a {'' if allow_inf else 'finite '}number {kind}, got {value!r}"
        )
    return float(value)


def _parse_link(entry: dict[str, Any], where: str) -> LinkSpec:
    _check_fields(entry, _LINK_FIELDS, where)
    ideal = entry["name"] == "ideal"
    return LinkSpec(
        name=entry["name"],
        bandwidth=_number(entry, "bandwidth_gbs", where, allow_inf=ideal) * _GIGA,
        latency=_number(entry, "latency_us", where, allow_inf=False, allow_zero=True) / _PER_MICRO,
        spec_bandwidth=_number(entry, "spec_bandwidth_gbs", where, allow_inf=ideal) * _GIGA,
        source=entry["source"].strip(),
    )


def _parse_device(entry: dict[str, Any], where: str, links: Mapping[str, LinkSpec]) -> DeviceSpec:
    _check_fields(entry, _DEVICE_FIELDS, where, _OPTIONAL_DEVICE_FIELDS)
    units = entry.get("compute_units", 0)
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise SpecError(f"{where}: field 'compute_units' must be a whole number >= 0, got {units!r}")
    ideal = entry["name"] == "ideal"
    efficiency = _number(entry, "matmul_efficiency", where, allow_inf=False)
    if efficiency > 1:
        raise SpecError(f"{where}: field 'matmul_efficiency' must be in (0, 1], got {efficiency!r}")
    if entry["host_link"] not in links:
        raise SpecError(f"{where}: field 'host_link' names unknown link {entry['host_link']!r}")
    if ("peak_fp8_tflops" in entry) != ("fp8_matmul_efficiency" in entry):
        raise SpecError(f"{where}: fields 'peak_fp8_tflops' and 'fp8_matmul_efficiency' come together")
    fp8_peak = fp8_efficiency = 0.0
    if "peak_fp8_tflops" in entry:
        fp8_peak = _number(entry, "peak_fp8_tflops", where, allow_inf=False) * _TERA
        fp8_efficiency = _number(entry, "fp8_matmul_efficiency", where, allow_inf=False)
        if fp8_efficiency > 1:
            raise SpecError(f"{where}: field 'fp8_matmul_efficiency' must be in (0, 1], got {fp8_efficiency!r}")
    attention = _number(entry, "attention_efficiency", where, allow_inf=False) if "attention_efficiency" in entry \
        else 0.0
    if attention > 1:
        raise SpecError(f"{where}: field 'attention_efficiency' must be in (0, 1], got {attention!r}")
    if "fp4_matmul_efficiency" in entry and "peak_fp4_tflops" not in entry:
        raise SpecError(f"{where}: field 'fp4_matmul_efficiency' needs 'peak_fp4_tflops'")
    fp4_efficiency = _number(entry, "fp4_matmul_efficiency", where, allow_inf=False) \
        if "fp4_matmul_efficiency" in entry else 0.0
    if fp4_efficiency > 1:
        raise SpecError(f"{where}: field 'fp4_matmul_efficiency' must be in (0, 1], got {fp4_efficiency!r}")
    return DeviceSpec(
        name=entry["name"],
        peak_flops=_number(entry, "peak_tflops", where, allow_inf=False) * _TERA,
        matmul_efficiency=efficiency,
        memory_bytes=_number(entry, "memory_gb", where, allow_inf=ideal) * _GIGA,
        memory_bandwidth=_number(entry, "memory_bandwidth_gbs", where, allow_inf=ideal) * _GIGA,
        launch_overhead_s=_number(entry, "launch_overhead_us", where, allow_inf=False, allow_zero=True) / _PER_MICRO,
        host_link=entry["host_link"],
        source=entry["source"].strip(),
        peak_fp32_flops=_number(entry, "peak_fp32_tflops", where, allow_inf=False) * _TERA,
        compute_units=units,
        peak_fp8_flops=fp8_peak,
        fp8_matmul_efficiency=fp8_efficiency,
        attention_efficiency=attention,
        peak_fp4_flops=_number(entry, "peak_fp4_tflops", where, allow_inf=False) * _TERA
        if "peak_fp4_tflops" in entry else 0.0,
        fp4_matmul_efficiency=fp4_efficiency,
    )


#: The largest slowdown a topology may give a device: the same bound as ``executor.run --slowdown``, the emulation a
#: slowed device stands for (beyond it a 5 ms op takes over 5 s and the peers would wait into their timeouts).
MAX_SLOWDOWN = 1000.0


def slowed_device(device: DeviceSpec, factor: float) -> DeviceSpec:
    """``device`` with every compute op taking ``factor`` times as long: a slower device on the same host and links.

    What ``executor.run --slowdown RANK:FACTOR`` emulates, for the simulator (a topology file's ``slowdown:``). The
    cost oracle costs it as its catalog device (:attr:`DeviceSpec.hardware`, whose measured profile applies to it
    too) times ``factor``; its compute rates (both peaks) and memory bandwidth are divided, its per-op overhead
    multiplied, by ``factor`` [derived], so that its roofline agrees and a search ranks it as the slower device;
    memory, host link and compute units stay. Slowing a slowed copy multiplies the factors; ``factor`` 1 returns
    ``device``.

    Raises:
        SpecError: ``factor`` is not a finite number in [1, :data:`MAX_SLOWDOWN`] (a device cannot be made faster
            than its catalog figures this way), or the slowdown of the result would exceed it.
    """
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1.0 <= factor <= MAX_SLOWDOWN:
        raise SpecError(f"a slowdown must be a finite number from 1 to {MAX_SLOWDOWN:g}, got {factor!r}")
    total = device.slowdown * float(factor)
    if total > MAX_SLOWDOWN:
        raise SpecError(f"{device.name} slowed {factor:g}x more would be {total:g}x slower than "
                        f"{device.hardware.name}; at most {MAX_SLOWDOWN:g}x")
    if factor == 1:
        return device
    root = device.hardware
    return DeviceSpec(
        name=f"{root.name}-slowed-{total:g}x",
        peak_flops=root.peak_flops / total,
        matmul_efficiency=root.matmul_efficiency,
        memory_bytes=root.memory_bytes,
        memory_bandwidth=root.memory_bandwidth / total,
        launch_overhead_s=root.launch_overhead_s * total,
        host_link=root.host_link,
        source=f"{root.name} with every compute op {total:g}x as long [derived: emulated slowdown]; {root.source}",
        peak_fp32_flops=root.peak_fp32_flops / total,
        compute_units=root.compute_units,
        base=root,
        slowdown=total,
        peak_fp8_flops=root.peak_fp8_flops / total,
        fp8_matmul_efficiency=root.fp8_matmul_efficiency,
        attention_efficiency=root.attention_efficiency,
        peak_fp4_flops=root.peak_fp4_flops / total,
        fp4_matmul_efficiency=root.fp4_matmul_efficiency,
    )


class DuplicateKeyError(yaml.YAMLError):
    """A key appears twice in one YAML mapping; the message names the key and both lines."""


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The safe loader (libyaml's parser when installed: several times faster), refusing duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *base' keys may be overridden; that is what merging is for
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:
                continue  # an unhashable key: the base constructor reports it
            if first is not None:
                raise DuplicateKeyError(f"duplicate key {key!r} at line {line}, first at line {first}: a key may "
                                        f"appear once in a mapping")
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The YAML document ``text``, as ``yaml.safe_load`` reads it but refusing a mapping with a key twice.

    Raises:
        yaml.YAMLError: malformed YAML; :class:`DuplicateKeyError` for a repeated key (naming it and its lines).
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader


def _read_yaml(path: Traversable | Path) -> Any:
    try:
        return load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: malformed YAML ({exc})") from None


def load_catalog(directory: Traversable | Path) -> Catalog:
    """Load and validate ``devices.yaml`` and ``links.yaml`` from ``directory``.

    Args:
        directory: a folder (``Path`` or ``importlib.resources`` traversable) holding both files.

    Returns:
        The catalog, in SI units.

    Raises:
        SpecError: a file is malformed; the message names the file, the entry and the field.
        FileNotFoundError: a file is missing.
    """
    links_file, devices_file = directory / "links.yaml", directory / "devices.yaml"
    links: dict[str, LinkSpec] = {}
    for i, entry in enumerate(_entries(_read_yaml(links_file), "links", str(links_file))):
        link = _parse_link(entry, f"{links_file}: links[{i}] ({entry.get('name')!r})")
        if link.name in links:
            raise SpecError(f"{links_file}: link name {link.name!r} appears twice")
        links[link.name] = link
    devices: dict[str, DeviceSpec] = {}
    names: dict[str, str] = {}
    aliases_of: dict[str, tuple[str, ...]] = {}
    for i, entry in enumerate(_entries(_read_yaml(devices_file), "devices", str(devices_file))):
        where = f"{devices_file}: devices[{i}] ({entry.get('name')!r})"
        device = _parse_device(entry, where, links)
        aliases = entry["aliases"]
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
            raise SpecError(f"{where}: field 'aliases' must be a list of names, got {aliases!r}")
        for alias in [device.name, *aliases]:
            key = alias.strip().lower()
            if key in names:
                raise SpecError(f"{where}: name or alias {alias!r} is already used by {names[key]!r}")
            names[key] = device.name
        devices[device.name] = device
        aliases_of[device.name] = tuple(a.strip() for a in aliases)
    return Catalog(*(MappingProxyType(m) for m in (devices, links, names, aliases_of)))


@functools.cache
def _catalog() -> Catalog:
    """The built-in catalog, loaded once."""
    return load_catalog(files("profiles") / "hardware")


def _unknown(kind: str, name: object, candidates: list[str], known: list[str]) -> SpecError:
    """The error for an unknown name: the closest of ``candidates`` (lower case), then the ``known`` names."""
    return SpecError(f"unknown {kind} {name!r}{did_you_mean(name, candidates)} (known: {', '.join(known)})")


def get_device(name: str) -> DeviceSpec:
    """The device with catalog id or alias ``name`` (case-insensitive), e.g. ``"V100"`` or ``"a100-pcie-80gb"``.

    Raises:
        SpecError: unknown name; the message suggests the closest known names.
    """
    catalog = _catalog()
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in catalog.device_names:
        known = [f"{d} ({', '.join(a)})" if a else d for d, a in catalog.aliases.items()]
        raise _unknown("device", name, list(catalog.device_names), known)
    return catalog.devices[catalog.device_names[key]]


def get_link(name: str) -> LinkSpec:
    """The link type with catalog id ``name`` (case-insensitive), e.g. ``"nvlink2-x1"`` or ``"ib-edr"``.

    Raises:
        SpecError: unknown name; the message suggests the closest known names.
    """
    links = _catalog().links
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in links:
        raise _unknown("link", name, list(links), list(links))
    return links[key]


def list_devices() -> tuple[DeviceSpec, ...]:
    """Every built-in device, in data-file order."""
    return tuple(_catalog().devices.values())


def list_links() -> tuple[LinkSpec, ...]:
    """Every built-in link type, in data-file order."""
    return tuple(_catalog().links.values())


def device_aliases(name: str) -> tuple[str, ...]:
    """The short aliases of the device ``name`` (any accepted name), e.g. ``("V100",)`` for ``v100-sxm2-32gb``."""
    return _catalog().aliases[get_device(name).name]
