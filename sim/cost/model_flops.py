"""What people read a training run by: model FLOPs per iteration, MFU, and tokens per second.

**Model FLOPs** are the FLOPs the model needs per iteration, whatever the plan does on top: three times the forward
FLOPs of the whole model's layer graph (forward, then the backward's input and weight gradients, twice the forward)
for every sample of the iteration. For the transformer families that is the count of Narayanan et al. (SC'21,
arXiv 2104.04473, Appendix: 72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V for GPT) and of torchtitan's
``6·N·T + 12·L·H·Q·T²`` per sequence (N the parameters outside the token table): the weights' GEMMs, and the
attention's two matmuls over the whole causal sequence (12·L·h·s² per sequence, not halved for the mask). Not
counted: recomputation (MFU, not HFU), elementwise work, and a layer with no FLOPs of its own.

**MFU** is model FLOPs per second over the dense peak of every device the plan uses, for the precision the model
trains in (``sim.hw.catalog.DeviceSpec.peak_flops`` for 2-byte types, ``peak_fp32_flops`` for fp32,
``peak_fp8_flops`` under ``--precision fp8`` and ``mxfp8``, ``peak_fp4_flops`` under ``nvfp4``). A mixture of experts
counts the FLOPs of the experts each token visits (its active parameters), as Megatron-LM and torchtitan do.

**Tokens** are samples × the model's sequence length, for a model that has one (``seq`` in its spec).
"""

from __future__ import annotations

from typing import Any

from sim.core.spec import parse_spec
from sim.cost.precision import narrow_format
from sim.hw.catalog import DeviceSpec
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.models import build_model

__all__ = ["FLOP_COUNT", "training_rates"]

#: How ``model_flops_per_iteration`` is counted, for the files that report it.
FLOP_COUNT = ("3 x forward FLOPs of the whole model per sample (Megatron-LM's and torchtitan's MFU count: the "
              "weights' GEMMs and the attention over the full causal sequence; no recomputation, no elementwise "
              "work)")


def training_rates(plan: Plan, topology: Topology, iteration_s: float) -> dict[str, Any]:
    """The model FLOPs, MFU and token rates of one iteration of ``plan`` taking ``iteration_s`` seconds.

    Returns:
        ``model_flops_per_iteration`` (FLOP), ``model_flops_counted_as`` (:data:`FLOP_COUNT`), ``mfu`` (a fraction,
        ``None`` where the model has no FLOPs or the iteration no time), ``tokens_per_iteration``, ``tokens_per_s``
        and ``tokens_per_s_per_device`` (``None`` for a model without a sequence).
    """
    graph = build_model(plan.model)
    layout = plan.layout
    samples = plan.num_microbatches * plan.microbatch_size * layout.dp
    model_flops = 3 * samples * sum(layer.flops_fwd for layer in graph.layers)
    devices = [topology.devices[index] for index in layout.device_ranks]
    narrow = narrow_format(plan.option("precision"))

    def device_peak(device: DeviceSpec) -> float:
        if narrow is not None:
            return device.peak_fp4_flops if narrow.tensor_cores == "fp4" else device.peak_fp8_flops
        return device.peak_flops if graph.dtype_bytes <= 2 else device.peak_fp32_flops

    peak = sum(device_peak(device) for device in devices)
    seq = parse_spec(graph.spec)[1].get("seq")
    tokens = samples * int(seq) if seq is not None else None
    timed = iteration_s > 0
    return {
        "model_flops_per_iteration": float(model_flops),
        "model_flops_counted_as": FLOP_COUNT,
        "mfu": model_flops / iteration_s / peak if timed and model_flops > 0 and peak > 0 else None,
        "tokens_per_iteration": tokens,
        "tokens_per_s": tokens / iteration_s if timed and tokens is not None else None,
        "tokens_per_s_per_device": tokens / iteration_s / len(devices) if timed and tokens is not None else None,
    }
