"""Measured layer profiles: the JSON that ``profiles.measure`` writes and ``sim.run --profile`` reads.

The schema is documented in ``profiles/README.md``; this module is its one reader. A profile gives, for one model
spec on one device, the measured forward and backward time of every layer at a given microbatch size, optionally
the memory of every layer (:class:`LayerMemory`: what its forward keeps for the backward, its transients, its
parameter, gradient and optimizer-state bytes) and how long gradients live (``gradients``), and optionally
point-to-point and host-copy measurements. Times and memory replace the models of ``sim.cost.oracle`` on ranks whose
device name matches the profile's ``device``.
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

__all__ = ["LayerTiming", "LayerMemory", "MeasuredProfile", "load_profile", "profile_document", "layer_memory_fields",
           "PROFILE_FORMAT_VERSION", "MEMORY_FIELDS", "GRADIENT_LIFETIMES", "REDUCTIONS"]

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


#: The per-layer memory fields of a profile, all bytes for one microbatch of the profile's size (the state fields for
#: the layer's parameters): a profile has all of them on every layer or none.
MEMORY_FIELDS = ("activation_bytes", "retained_bytes", "forward_transient_bytes", "backward_transient_bytes",
                 "first_backward_bytes", "input_backward_bytes", "weight_backward_bytes", "deferred_bytes",
                 "param_bytes", "gradient_bytes", "deferred_gradient_bytes",
                 "optimizer_bytes")
#: Fields ``profiles.measure`` wrote before memory was measured, for information only: alone they are no memory.
_EARLIER_FIELDS = ("activation_bytes", "param_bytes")
#: How long weight gradients live: ``resident`` (a persistent buffer, Megatron's contiguous gradient buffer, DDP's
#: buckets) or ``per_step`` (allocated by a stage's first backward after an update and freed by the update, as
#: PyTorch's ``zero_grad(set_to_none=True)`` does: the executor's).
GRADIENT_LIFETIMES = ("resident", "per_step")
#: How a data-parallel gradient reduction holds its data: ``in_place`` (on the gradient buffer itself, as
#: Megatron-LM's contiguous buffer and DDP's bucket views do: no extra bytes) or ``flat_copy`` (the stage's gradients
#: copied into one flat buffer for the collective, from its issue until the update that waits for it: the
#: executor's ``executor.data_parallel``).
REDUCTIONS = ("in_place", "flat_copy")


@dataclass(frozen=True)
class LayerMemory:
    """Measured memory of one layer (``profiles.layer_memory`` says how), bytes.

    Attributes:
        output_bytes: the layer's output for one microbatch (the profile's ``activation_bytes``): what the next
            layer, or the next stage, receives.
        retained_bytes: what one microbatch's forward keeps until its backward (output and saved tensors, the input
            excluded).
        forward_transient_bytes: held only while one microbatch's forward runs.
        backward_transient_bytes: held only while one microbatch's backward runs, weight gradients excluded.
        first_backward_bytes: the most one microbatch's backward holds above its starting level when it makes the
            weight gradients (none existed), those gradients included.
        input_backward_bytes: the most a split backward's I holds above its starting level.
        weight_backward_bytes: the same for its W.
        deferred_bytes: what a split backward's I keeps for its W (the weight GEMMs' inputs and output gradients).
        param_bytes: the layer's parameters as run.
        gradient_bytes: its weight gradients.
        deferred_gradient_bytes: those of them a split backward's W makes (the weight GEMMs'), the rest its I.
        optimizer_bytes: its optimizer state after a step (Adam's two moments, and its step counters).
    """

    output_bytes: int
    retained_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int
    first_backward_bytes: int
    input_backward_bytes: int
    weight_backward_bytes: int
    deferred_bytes: int
    param_bytes: int
    gradient_bytes: int
    deferred_gradient_bytes: int
    optimizer_bytes: int


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
        h2d_bandwidth: host → device copy bandwidth from pinned host memory in bytes/s, if measured (CUDA only).
        d2h_bandwidth: device → host copy bandwidth into pinned host memory in bytes/s, if measured (CUDA only).
        memory: per layer, its measured memory (:class:`LayerMemory`), or ``None`` when not measured.
        gradients: how long weight gradients live where the profile applies (:data:`GRADIENT_LIFETIMES`).
        reduction: how a data-parallel gradient reduction holds its data where the profile applies
            (:data:`REDUCTIONS`).
        tensor_parallel: the tensor-parallel degree whose shard of each layer was measured (``profiles.measure --tp``;
            1: whole layers); a plan takes the profile only at this ``--tp``.
    """

    source: str
    model: str
    device: str
    microbatch_size: int
    layers: tuple[LayerTiming, ...]
    p2p_latency_s: float | None = None
    p2p_bandwidth: float | None = None
    h2d_bandwidth: float | None = None
    d2h_bandwidth: float | None = None
    memory: tuple[LayerMemory, ...] | None = None
    gradients: str = "resident"
    reduction: str = "in_place"
    tensor_parallel: int = 1


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
    memory = _layer_memory(layers_raw, source)
    gradients = data.get("gradients", "resident")
    if gradients not in GRADIENT_LIFETIMES:
        raise SpecError(f"profile {source}: gradients must be one of {', '.join(GRADIENT_LIFETIMES)}, got "
                        f"{gradients!r}")
    reduction = data.get("reduction", "in_place")
    if reduction not in REDUCTIONS:
        raise SpecError(f"profile {source}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    tensor_parallel = data.get("tensor_parallel", 1)
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise SpecError(f"profile {source}: tensor_parallel must be an integer >= 1 (the measured shards' degree), "
                        f"got {tensor_parallel!r}")
    p2p = data.get("p2p") or {}
    if not isinstance(p2p, dict):
        raise SpecError(f"profile {source}: p2p must be an object")
    latency = _number(p2p, "latency_s", f"profile {source}, p2p", required=False)
    bandwidth = _number(p2p, "bandwidth_bytes_per_s", f"profile {source}, p2p", required=False)
    if not _p2p_measured_on_profile_device(p2p.get("device"), data["device"]):
        # Host-memory figures (two CPU processes over loopback, p2p.device "cpu") say nothing about GPU-to-GPU
        # links, and the reverse; such transfers keep the topology's link model.
        latency = bandwidth = None
    h2d, d2h = _host_copy_bandwidths(data.get("host_copy"), source)
    return MeasuredProfile(source, data["model"], data["device"], mbs, tuple(layers), latency, bandwidth, h2d, d2h,
                           memory=memory, gradients=gradients, reduction=reduction, tensor_parallel=tensor_parallel)


def layer_memory_fields(memory: LayerMemory) -> dict[str, int]:
    """One layer's memory as the profile's fields (:data:`MEMORY_FIELDS`; the output is ``activation_bytes``, the
    name ``profiles.measure`` has always written it under); the inverse of what :func:`load_profile` reads."""
    values = dict(zip(MEMORY_FIELDS, (memory.output_bytes, memory.retained_bytes, memory.forward_transient_bytes,
                                      memory.backward_transient_bytes, memory.first_backward_bytes,
                                      memory.input_backward_bytes, memory.weight_backward_bytes,
                                      memory.deferred_bytes, memory.param_bytes, memory.gradient_bytes,
                                      memory.deferred_gradient_bytes, memory.optimizer_bytes)))
    return values


def _layer_memory(layers_raw: list[dict[str, Any]], source: str) -> tuple[LayerMemory, ...] | None:
    """The layers' memory fields (:data:`MEMORY_FIELDS`), all of them on every layer, or ``None`` when no layer has
    any but those written before memory was measured (``param_bytes``, ``activation_bytes``); SpecError naming the
    layer and field when some are missing or not a non-negative integer."""
    if not any(key in entry for entry in layers_raw for key in MEMORY_FIELDS if key not in _EARLIER_FIELDS):
        return None
    found = []
    for i, entry in enumerate(layers_raw):
        where = f"profile {source}, layers[{i}]"
        values = []
        for key in MEMORY_FIELDS:
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{where}: {key} must be a non-negative integer number of bytes, got {value!r} "
                                f"(a profile's memory fields are on every layer or on none)")
            values.append(value)
        found.append(LayerMemory(*values))
    return tuple(found)


def _host_copy_bandwidths(host_copy: Any, source: str) -> tuple[float | None, float | None]:
    """``(host → device, device → host)`` bytes/s of a profile's ``host_copy`` object: the pinned-memory figures,
    since the copies a plan makes (a PREFETCH or EVICT, ``executor.csp.offload``) go from and to pinned host memory
    on CUDA; ``None`` where absent. A bandwidth of 0 is refused: it would make every copy endless."""
    if host_copy is None:
        return None, None
    if not isinstance(host_copy, dict):
        raise SpecError(f"profile {source}: host_copy must be an object")
    where = f"profile {source}, host_copy"
    found = []
    for key in ("h2d_pinned_bytes_per_s", "d2h_pinned_bytes_per_s"):
        value = _number(host_copy, key, where, required=False)
        if value == 0:
            raise SpecError(f"{where}: {key} must be > 0, got 0")
        found.append(value)
    return found[0], found[1]


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
