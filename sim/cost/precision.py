"""The training precision a plan asks for (``--precision``), and which model and devices can take it.

* ``bf16`` and ``fp16``: mixed precision with 2-byte weights, activations and gradients, fp32 master weights and Adam
  states (ZeRO §3.1's 16 bytes per parameter), GEMMs on the 16-bit tensor cores. The two cost the same here; the
  transformer families (``gpt``: fp16, ``llama``: bf16) are built in them.
* ``fp8``: as bf16, with every linear of a Llama-family block run as torchao's ``Float8Linear`` (dynamic tensorwise
  scaling, as torchtitan's float8 converter does): FP8 GEMMs at the device's FP8 peak and measured FP8 ceiling, and
  the casts and transposes that feed them as kernels (:func:`sim.cost.kernels.block.linear_kernels`). Attention and
  the LM head stay in bf16; weights, activations and optimizer state keep their bf16 sizes (the casts are
  transient). Needs a device with an FP8 peak in the catalog.
* ``fp32``: the precision the fp32 models (``cnn``, ``vgg16``) are built in; a 2-byte model in fp32 is not modelled
  (its activation and state sizes are counted for 2-byte tensors).

``None`` (no ``--precision``) is the model's own. The plan records the precision when one is given (option
``precision``), and ``sim.predict`` checks it again for a written plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec, list_devices
from sim.models.graph import LayerGraph

__all__ = ["PRECISIONS", "check_precision", "fp8_devices"]

#: The precisions ``--precision`` takes.
PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


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
        raise SpecError(f"{{precision}} must be one of {', '.join(PRECISIONS)}, got {precision!r}", "precision")
    two_bytes = graph.dtype_bytes == 2
    if precision == "fp32" and two_bytes:
        raise SpecError(f"{{precision}} fp32 is not modelled for {graph.spec}: its activation and state sizes are "
                        f"counted for 2-byte tensors (use bf16, fp16 or fp8)", "precision")
    if precision in ("fp16", "bf16", "fp8") and not two_bytes:
        raise SpecError(f"{{precision}} {precision}: {graph.spec} is modelled in fp32 only", "precision")
    if precision == "fp8":
        if not any(layer.transformer is not None and layer.transformer.family in ("llama", "moe")
                   for layer in graph.layers):
            raise SpecError(f"{{precision}} fp8 is modelled for the llama and moe families (FP8 linears in their "
                            f"blocks), not {graph.spec.partition(':')[0]}", "precision")
        without = sorted({device.name for device in devices if not device.is_gpu or device.peak_fp8_flops <= 0})
        if without:
            raise SpecError(f"{{precision}} fp8 needs FP8 tensor cores; {', '.join(without)} has none in the catalog "
                            f"(devices with FP8: {', '.join(fp8_devices())})", "precision")
