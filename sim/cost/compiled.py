"""``torch.compile`` for a plan (``--compile``): which models and devices it applies to.

What it changes is costed where the kernels are listed: a Llama-family block's memory-bound work between its GEMMs
fused into fewer kernels and fewer passes over memory (:mod:`sim.cost.kernels.pointwise`), its FP8 casts writing
both major orders in one pass (:func:`sim.cost.kernels.block.linear_kernels`), as torchtitan compiles each
``TransformerBlock`` (``apply_compile``). The embedding and the head stay eager, as there. Only the kernel-level GPU
cost model lists kernels, so the option needs GPUs; ``gpt`` is Megatron's already-fused kernels, which it does not
apply to. The plan records it (option ``compile``), and ``sim.predict`` checks it again for a written plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec
from sim.models.graph import LayerGraph

__all__ = ["check_compile"]


def check_compile(compiled: bool, graph: LayerGraph, devices: Iterable[DeviceSpec]) -> None:
    """Refuse ``compiled`` for a model other than the llama and moe families or for a plan with a device that is not a
    GPU (the moe family's fused kernels are also how Transformer Engine runs Megatron-Core's blocks).

    Raises:
        SpecError: naming the argument ``compile`` (``--compile`` on the command line) and what would be valid.
    """
    if not compiled:
        return
    family = graph.spec.partition(":")[0]
    if not any(layer.transformer is not None and layer.transformer.family in ("llama", "moe")
               for layer in graph.layers):
        raise SpecError(f"{{compile}} is modelled for the llama and moe families (torchtitan compiles their blocks), "
                        f"not {family}", "compile")
    others = sorted({device.name for device in devices if not device.is_gpu})
    if others:
        raise SpecError(f"{{compile}} needs GPUs (it fuses GPU kernels); the plan runs on {', '.join(others)}",
                        "compile")
