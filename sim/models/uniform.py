"""``uniform``: N identical layers with fixed, device-independent times, for analytic tests.

Every schedule's closed-form makespan and memory (DESIGN §4, style guide §10.21) is stated for equal per-stage
costs; this model gives exactly that. Sizes are in decimal megabytes: 1 MB = 1e6 bytes (not MiB).
"""

from __future__ import annotations

from sim.core.spec import SpecParams
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "build"]

NAME = "uniform"
DESCRIPTION = "N identical layers with fixed per-sample times (ms) and sizes (MB = 1e6 bytes); for analytic tests"
DEFAULTS: dict[str, int | float] = {
    "layers": 8,
    "fwd_ms": 1.0,  # forward time per sample and layer, ms
    "bwd_ms": 2.0,  # backward time per sample and layer, ms (the usual 2x forward)
    "act_mb": 1.0,  # output (= saved) activation per sample and layer, MB
    "param_mb": 10.0,  # weights per layer, MB
}

DTYPE_BYTES = 2  # fp16 training; only param_count() depends on it
MB = 1_000_000  # bytes in a decimal megabyte


def build(params: SpecParams) -> LayerGraph:
    """Build ``uniform:layers=N,fwd_ms=..,bwd_ms=..,act_mb=..,param_mb=..``.

    Each layer has ``fwd_s = fwd_ms / 1e3`` and ``bwd_s = bwd_ms / 1e3`` seconds per sample, zero FLOPs,
    ``act_mb * 1e6`` bytes of output (also its saved bytes) and ``param_mb * 1e6`` bytes of weights. The model
    input is the same size as one activation.

    Raises:
        SpecError: a non-positive layer count, a negative or non-numeric time or size, or an unknown key.
    """
    n = params.int("layers", int(DEFAULTS["layers"]))
    values = {key: float(params.float(key, DEFAULTS[key])) for key in ("fwd_ms", "bwd_ms", "act_mb", "param_mb")}
    params.finish()
    act_bytes = round(values["act_mb"] * MB)
    layer_kwargs = {
        "kind": "uniform",
        "flops_fwd": 0.0,
        "flops_bwd": 0.0,
        "param_bytes": round(values["param_mb"] * MB),
        "activation_bytes": act_bytes,
        "saved_bytes": act_bytes,
        "fwd_s": values["fwd_ms"] / 1e3,
        "bwd_s": values["bwd_ms"] / 1e3,
    }
    layers = [Layer(name=f"layer{i}", **layer_kwargs) for i in range(n)]  # type: ignore[arg-type]
    spec = canonical_spec(NAME, {"layers": n, **values})
    return LayerGraph(spec, layers, dtype_bytes=DTYPE_BYTES, input_bytes=act_bytes)
