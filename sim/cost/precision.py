"""The training precision a plan asks for (``--precision``), and which model and devices can take it.

* ``bf16`` and ``fp16``: mixed precision with 2-byte weights, activations and gradients, fp32 master weights and Adam
  states (ZeRO §3.1's 16 bytes per parameter), GEMMs on the 16-bit tensor cores. The two cost the same here; the
  transformer families (``gpt``: fp16, ``llama`` and ``moe``: bf16) are built in them.
* ``fp8``: as bf16, with every linear of a Llama- or MoE-family block on FP8 operands with one scale per tensor
  (torchao's ``Float8Linear`` with dynamic scaling, as torchtitan's float8 converter does; Transformer Engine's
  current scaling, Megatron-Bridge's "FP8-CS"): FP8 GEMMs at the device's FP8 peak and measured FP8 ceiling, and
  the casts and transposes that feed them as kernels (:func:`sim.cost.kernels.block.linear_kernels`).
* ``fp8-rowwise``: as ``fp8`` with one scale per row of each operand (torchao's ``rowwise`` recipe, torchtitan's
  ``float8.recipe_name = "rowwise"``): two cast passes per operand, since a row's scale needs the whole row and each
  GEMM reads its operands along its own reduction axis (:func:`sim.cost.kernels.block.rowwise_cast_kernels`, from
  torchao's roofline), and PyTorch's rowwise-scaled GEMM (a CUTLASS kernel) at
  :data:`sim.cost.kernels.record.ROWWISE_GEMM_SHARE` of the tensorwise (cuBLAS) one's speed. Every linear of a block
  is converted, as torchtitan did before torchao's per-recipe filter of small linears (pytorch/ao pull request 2410).
* ``mxfp8``: the same linears in MXFP8 (OCP Microscaling v1.0: 32-value blocks with a power-of-two scale), at the
  FP8 rate; block-scaled casts (no amax pass, both orders written with their scales). Blackwell's tensor cores
  multiply block-scaled operands; earlier GPUs do not (Transformer Engine's MXFP8 recipe needs compute capability
  10.0), so it needs a device with an FP4 peak in the catalog, the catalog's mark of Blackwell.
* ``nvfp4``: the linears in NVFP4 (16-value blocks with an E4M3 scale; NVIDIA, arXiv 2509.25149), at the device's FP4
  peak with the FP8 ceiling's efficiency [assumed: no FP4 GEMM ceiling was found]. Needs an FP4 peak.

In all four, attention and the LM head stay in bf16, and weights, activations and optimizer state keep their bf16
sizes (the casts are transient). A recipe that keeps some layers in bf16 (NVFP4 pre-training keeps the last few) is
not modelled: every block's linears are narrow.

* ``fp32``: the precision the fp32 models (``cnn``, ``vgg16``) are built in; a 2-byte model in fp32 is not modelled
  (its activation and state sizes are counted for 2-byte tensors).

``None`` (no ``--precision``) is the model's own. The plan records the precision when one is given (option
``precision``), and ``sim.predict`` checks it again for a written plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from sim.core.errors import SpecError, did_you_mean
from sim.cost.kernels.record import NARROW_FORMATS, Narrow
from sim.hw.catalog import DeviceSpec, list_devices
from sim.models.graph import LayerGraph

__all__ = ["PRECISIONS", "NARROW_PRECISIONS", "check_precision", "fp8_devices", "narrow_format"]

#: The precisions ``--precision`` takes.
PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4")
#: Those that run the linears on low-precision operands.
NARROW_PRECISIONS = tuple(NARROW_FORMATS)


def narrow_format(precision: str | None) -> Narrow | None:
    """The low-precision GEMM format of ``precision``, or None for a 16- or 32-bit one."""
    return NARROW_FORMATS.get(precision) if precision else None


def fp8_devices() -> tuple[str, ...]:
    """The catalog devices with an FP8 peak, for messages."""
    return tuple(device.name for device in list_devices() if device.peak_fp8_flops > 0)


def check_precision(precision: str | None, graph: LayerGraph, devices: Iterable[DeviceSpec]) -> None:
    """Refuse a precision ``graph``'s model or the plan's ``devices`` cannot take (module docstring).

    Raises:
        SpecError: naming the argument ``precision`` (``--precision`` on the command line), the value and what
            would be valid.
    """
    if precision is None:
        return
    if precision not in PRECISIONS:
        raise SpecError(f"{{precision}} must be one of {', '.join(PRECISIONS)}, got {precision!r}"
                        f"{did_you_mean(precision, PRECISIONS)}", "precision")
    two_bytes = graph.dtype_bytes == 2
    if precision == "fp32" and two_bytes:
        raise SpecError(f"{{precision}} fp32 is not modelled for {graph.spec}: its activation and state sizes are "
                        f"counted for 2-byte tensors (use bf16, fp16 or fp8)", "precision")
    if precision != "fp32" and not two_bytes:
        raise SpecError(f"{{precision}} {precision}: {graph.spec} is modelled in fp32 only", "precision")
    if precision in NARROW_PRECISIONS:
        if not any(layer.transformer is not None and layer.transformer.family in ("llama", "moe")
                   for layer in graph.layers):
            raise SpecError(f"{{precision}} {precision} is modelled for the llama and moe families (narrow linears in "
                            f"their blocks), not {graph.spec.partition(':')[0]}", "precision")
        devices = list(devices)
        without = sorted({device.name for device in devices if not device.is_gpu or device.peak_fp8_flops <= 0})
        if without:
            raise SpecError(f"{{precision}} {precision} needs FP8 tensor cores; {', '.join(without)} has none in the "
                            f"catalog (devices with FP8: {', '.join(fp8_devices())})", "precision")
        if NARROW_FORMATS[precision].block_scaled:
            older = sorted({device.name for device in devices if device.peak_fp4_flops <= 0})
            if older:
                blackwell = ", ".join(d.name for d in list_devices() if d.peak_fp4_flops > 0)
                raise SpecError(f"{{precision}} {precision} is block-scaled, which Blackwell's tensor cores run; "
                                f"{', '.join(older)} has no FP4 peak in the catalog (devices with one: {blackwell})",
                                "precision")
