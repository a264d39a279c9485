"""Measured layer profiles: the JSON that ``profiles.measure`` writes and ``sim.run --profile`` reads.

The schema is documented in ``profiles/README.md``; this module is its one reader. A profile gives, for one model
spec on one device, the measured forward and backward time of every layer at a given microbatch size, and
optionally point-to-point and host-copy measurements. Times replace the roofline estimate of ``sim.cost.model`` on ranks
whose device name matches the profile's ``device``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sim.core.errors import SpecError
from sim.core.fileio import read_text

__all__ = ["LayerTiming", "MeasuredProfile", "load_profile", "profile_document", "PROFILE_FORMAT_VERSION"]

PROFILE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class LayerTiming:
    """Measured times of one layer at the profile's microbatch size.

    Attributes:
        name: layer name, as in the ``LayerGraph``.
        fwd_s: forward time in s.
        bwd_s: full backward time in s.
        opt_s: optimizer-step time in s (0 when not measured).
    """

    name: str
    fwd_s: float
    bwd_s: float
    opt_s: float = 0.0


@dataclass(frozen=True)
class MeasuredProfile:
    """A measured profile.

    Attributes:
        source: the file it was read from.
        model: canonical model spec it was measured for.
        device: device name it was measured on (a catalog id such as ``"cpu"`` or ``"v100-sxm2-32gb"``).
        microbatch_size: samples per microbatch during the measurement.
        layers: timings in layer order.
        p2p_latency_s: fitted point-to-point latency α in s, if measured.
        p2p_bandwidth: fitted point-to-point bandwidth in bytes/s, if measured.
    """

    source: str
    model: str
    device: str
    microbatch_size: int
    layers: tuple[LayerTiming, ...]
    p2p_latency_s: float | None = None
    p2p_bandwidth: float | None = None


def _number(data: dict[str, Any], key: str, where: str, *, required: bool = True) -> float | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{where}: {key} must be a non-negative number, got {value!r}")
    return float(value)


def load_profile(path: str | Path) -> MeasuredProfile:
    """Read and check a measured profile; SpecError naming the file and the bad field on any problem."""
    source = str(path)
    try:
        data = json.loads(read_text(path, "profile"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"profile {source} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != "pipedejavu-profile":
        raise SpecError(f"profile {source} lacks \"format\": \"pipedejavu-profile\"")
    if data.get("format_version") != PROFILE_FORMAT_VERSION:
        raise SpecError(f"profile {source} has format_version {data.get('format_version')!r}, "
                        f"expected {PROFILE_FORMAT_VERSION}")
    for key in ("model", "device"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise SpecError(f"profile {source}: {key} must be a non-empty string, got {data.get(key)!r}")
    mbs = data.get("microbatch_size")
    if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
        raise SpecError(f"profile {source}: microbatch_size must be a positive integer, got {mbs!r}")
    layers_raw = data.get("layers")
    if not isinstance(layers_raw, list) or not layers_raw:
        raise SpecError(f"profile {source}: layers must be a non-empty list")
    layers = []
    for i, entry in enumerate(layers_raw):
        where = f"profile {source}, layers[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise SpecError(f"{where}: expected an object with a name")
        layers.append(LayerTiming(entry["name"], _number(entry, "fwd_s", where), _number(entry, "bwd_s", where),
                                  _number(entry, "opt_s", where, required=False) or 0.0))
    p2p = data.get("p2p") or {}
    if not isinstance(p2p, dict):
        raise SpecError(f"profile {source}: p2p must be an object")
    latency = _number(p2p, "latency_s", f"profile {source}, p2p", required=False)
    bandwidth = _number(p2p, "bandwidth_bytes_per_s", f"profile {source}, p2p", required=False)
    if not _p2p_measured_on_profile_device(p2p.get("device"), data["device"]):
        # Host-memory figures (two CPU processes over loopback, p2p.device "cpu") say nothing about GPU-to-GPU
        # links, and the reverse; such transfers keep the topology's link model.
        latency = bandwidth = None
    return MeasuredProfile(source, data["model"], data["device"], mbs, tuple(layers), latency, bandwidth)


def _p2p_measured_on_profile_device(p2p_device: Any, device: str) -> bool:
    """Whether the profile's p2p figures were taken where its layers ran.

    ``p2p.device`` is ``"cpu"`` (host memory) or ``"cuda"``; a profile without it (older files, the executor's
    calibration, which measures the ranks' own transfers) counts as measured on its own device.
    """
    if p2p_device is None:
        return True
    return (p2p_device == "cpu") == (device == "cpu")


def profile_document(*, model: str, device: str, microbatch_size: int, layers: list[dict[str, Any]],
                     method: dict[str, Any], machine: dict[str, Any], software: dict[str, Any],
                     p2p: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one writer of the profile schema (``profiles/README.md``), for ``profiles.measure`` and for
    ``executor.run --calibrate-out``: every profile has the same header, provenance and date stamp.

    Args:
        model: canonical model spec.
        device: catalog id of the device measured.
        microbatch_size: samples per microbatch during the measurement.
        layers: per layer ``name``, ``fwd_s``, ``bwd_s``, ``opt_s`` (s) and any measured extras.
        method: how the figures were obtained (statistic, repeats, what each time includes).
        machine: hostname, CPU, GPU, cores, threads.
        software: versions (Python, torch, CUDA).
        p2p: ``latency_s``, ``bandwidth_bytes_per_s`` and how/where they were measured, if measured.
        extra: further top-level fields (e.g. ``optimizer``, ``host_copy``).
    """
    document: dict[str, Any] = {
        "format": "pipedejavu-profile", "format_version": PROFILE_FORMAT_VERSION, "model": model, "device": device,
        "microbatch_size": microbatch_size, **(extra or {}), "method": method, "layers": layers,
        "machine": machine, "software": software, "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if p2p is not None:
        document["p2p"] = p2p
    return document
