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
Since an MFU means nothing without its peak, ``mfu_peak`` names the one ``mfu`` is against (``precision``: ``bf16``
(the 16-bit tensor-core peak, which fp16 shares on every catalog device), ``fp32``, ``fp8`` or ``fp4``; ``flop_per_s``:
the sum over the devices) and ``mfu_bf16`` is the same FLOPs against the 16-bit peak whatever the precision, so that an
FP8 run's MFU (against a peak twice as high) can be read beside a BF16 run's.

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
        ``model_flops_per_iteration`` (FLOP), ``model_flops_counted_as`` (:data:`FLOP_COUNT`), ``mfu`` (a fraction
        of the peak ``mfu_peak`` names, ``None`` where the model has no FLOPs or the iteration no time),
        ``mfu_peak`` (``precision`` and ``flop_per_s``, FLOP/s summed over the plan's devices), ``mfu_bf16`` (against
        the 16-bit peak; ``None`` where ``mfu`` is), ``tokens_per_iteration``, ``tokens_per_s`` and
        ``tokens_per_s_per_device`` (``None`` for a model without a sequence).
    """
    graph = build_model(plan.model)
    layout = plan.layout
    samples = plan.num_microbatches * plan.microbatch_size * layout.dp
    model_flops = 3 * samples * sum(layer.flops_fwd for layer in graph.layers)
    devices = [topology.devices[index] for index in layout.device_ranks]
    narrow = narrow_format(plan.option("precision"))

    # The peak the model's GEMMs run at: the narrow format's tensor cores, else the 16-bit or the fp32 one.
    precision = narrow.tensor_cores if narrow is not None else "bf16" if graph.dtype_bytes <= 2 else "fp32"

    def device_peak(device: DeviceSpec, precision: str) -> float:
        return {"fp4": device.peak_fp4_flops, "fp8": device.peak_fp8_flops, "bf16": device.peak_flops,
                "fp32": device.peak_fp32_flops}[precision]

    peak = sum(device_peak(device, precision) for device in devices)
    peak_bf16 = sum(device_peak(device, "bf16") for device in devices)
    seq = parse_spec(graph.spec)[1].get("seq")
    tokens = samples * int(seq) if seq is not None else None
    timed = iteration_s > 0
    return {
        "model_flops_per_iteration": float(model_flops),
        "model_flops_counted_as": FLOP_COUNT,
        "mfu": model_flops / iteration_s / peak if timed and model_flops > 0 and peak > 0 else None,
        "mfu_peak": {"precision": precision, "flop_per_s": float(peak)},
        "mfu_bf16": (model_flops / iteration_s / peak_bf16 if timed and model_flops > 0 and peak_bf16 > 0
                     else None),
        "tokens_per_iteration": tokens,
        "tokens_per_s": tokens / iteration_s if timed and tokens is not None else None,
        "tokens_per_s_per_device": tokens / iteration_s / len(devices) if timed and tokens is not None else None,
    }
