"""What a decoder block keeps for its backward, by the modules the framework builds it from (``--blocks``).

The same Llama or MoE block keeps different tensors in different frameworks, and at long sequences the difference is
tens of gigabytes per GPU. Two implementations are modelled (per token, bytes; h the hidden size, q = a·d the query
width, f the SwiGLU's inner width, w the bytes per element of a linear's saved input, below):

``eager`` (the default): the block as PyTorch modules, torchtitan's (``nn.Linear``; under FP8 torchao's
``Float8Linear``, which keeps its high-precision input and casts again in the backward). Each norm's bf16 output is
kept as the next linear's input, and the Llama family's SwiGLU runs as three eager ops whose gate, up, SiLU and product
outputs are all kept (8f). What each family counts is in its module (:mod:`sim.models.llama`,
:mod:`sim.models.moe`); the MoE family counts a fused SwiGLU (6f) in both implementations.

``transformer-engine``: Megatron-Core's blocks of Transformer Engine layers (Megatron-Bridge's recipes; TE read at
d0067d0, Megatron-LM at d98e8a6):

* a norm feeding a linear is fused into it (``LayerNormLinear``): the layer keeps the norm's input, its fp32 statistics
  and the norm's output **as the linear will multiply it**: quantized under a narrow precision (``layernorm_linear.py``,
  ``prepare_for_saving(inputmat, ..., ln_out_to_save, mu, rsigma)``, the quantized ``ln_out`` with only the
  column-wise copy the weight gradient needs: ``ln_out.update_usage(rowwise_usage=False)``);
* a plain ``Linear`` keeps its input the same way (``linear.py``: ``inputmat.update_usage(rowwise_usage=False,
  columnwise_usage=True)`` then ``saved_inputmat = inputmat``): in bf16 the very tensor the layer before keeps (the
  attention's output), under a narrow precision a quantized copy beside it;
* the SwiGLU is Megatron-Core's fused ``bias_swiglu`` (``megatron/core/fusions/fused_bias_swiglu.py``:
  ``ctx.save_for_backward(input_for_backward, ...)``, the fc1 output, in bf16 unless
  ``activation_func_fp8_input_store``, which Megatron-Bridge's performance recipes do not set): 4f kept, the SiLU
  recomputed, and the fc2 input kept by fc2 at w: 4f + w·f in all;
* the experts' ``GroupedLinear`` keep their inputs as ``Linear`` does: the routed tokens at w·h, the fc2 input at
  w·f_e.

w is 2 in bf16 and, under a narrow precision (``--precision``), the format's value plus its share of a block scale
(the columnwise copy's: FP8 with one scale per tensor 1, MXFP8 1 + 1/32, NVFP4 1/2 + 1/16), which ``sim.cost``
supplies from the format (:func:`sim.cost.plan_settings.plan_sharding`). Attention (``DotProductAttention``) keeps q,
k, v, its output and the fp32 softmax statistics in bf16 in both (FP8 attention is not modelled).
"""

from __future__ import annotations

__all__ = ["BLOCKS", "EAGER", "TRANSFORMER_ENGINE", "check_blocks"]

#: Activations' bytes per element in the training dtype (bf16).
DTYPE_BYTES = 2
#: The block implementations ``--blocks`` takes, the default first.
EAGER = "eager"
TRANSFORMER_ENGINE = "transformer-engine"
BLOCKS = (EAGER, TRANSFORMER_ENGINE)


def check_blocks(blocks: str, saved_input_bytes: float) -> None:
    """Raise ValueError unless ``blocks`` is one of :data:`BLOCKS` and ``saved_input_bytes`` (w, bytes per element)
    is the training dtype's, or a narrow one's (0 < w < 2) under ``transformer-engine``."""
    if blocks not in BLOCKS:
        raise ValueError(f"blocks must be one of {', '.join(BLOCKS)}, got {blocks!r}")
    width = saved_input_bytes
    if isinstance(width, bool) or not isinstance(width, int | float) or not 0 < width <= DTYPE_BYTES:
        raise ValueError(f"saved_input_bytes must be a number in (0, {DTYPE_BYTES}], got {width!r}")
    if blocks == EAGER and width != DTYPE_BYTES:
        raise ValueError(f"eager blocks keep their linears' inputs in the training dtype ({DTYPE_BYTES} bytes); "
                         f"saved_input_bytes {width!r} needs blocks {TRANSFORMER_ENGINE!r}")
