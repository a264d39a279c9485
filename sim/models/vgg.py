"""``vgg16``: VGG-16, configuration D of Simonyan & Zisserman (arXiv 1409.1556, Table 1), trained in fp32.

Thirteen 3x3 convolutions (stride 1, padding 1, bias, ReLU) in five blocks of 64, 128, 256, 512 and 512 channels
(2, 2, 3, 3, 3 convolutions), each block ending in a 2x2 max-pool of stride 2, then three fully connected layers of
4096, 4096 and ``classes`` outputs (ReLU and dropout 0.5 after the first two). At 224 x 224 and 1000 classes that is
138,357,544 parameters, 124 million of them (90%) in the three FC layers: what makes its data-parallel gradient
all-reduce expensive and why PipeDream (SOSP'19) pipelines it. Its forward pass is 15.47 G multiply-adds per image
(the figure torchvision publishes for ``vgg16``; 2 FLOPs each here).

Layers of the graph are the 16 weight layers (``conv1_1`` .. ``conv5_3``, ``fc6``, ``fc7``, ``fc8``): a block's
max-pool belongs to its last convolution, ReLU and dropout to the layer they follow, so a stage boundary falls only
between weight layers. The input side ``size`` must be a multiple of 32 (five halvings); ``fc6`` reads the flattened
512 x (size/32)^2 map, as in the paper (no adaptive pooling).

Per sample, fp32 (4 bytes; int64 pooling indices 8, dropout masks 1 byte per element):

* FLOPs: a convolution ``2 * 9 * C_in * C_out * H * W`` (:func:`sim.models.cnn.conv_flops_fwd`), a linear layer
  ``2 * n_in * n_out``; ReLU, pooling, dropout and the loss are elementwise and not counted. Backward is 2x forward
  (input and weight gradient, each the forward's size; ``conv1_1``'s input gradient is counted although a framework
  may skip it, as the zoo's ``cnn`` does).
* ``activation_bytes``: the layer's output, pooled where a pool follows (what crosses a stage boundary).
* ``saved_bytes``: what the layer creates and keeps for the backward: the ReLU output (ReLU runs in place on the
  convolution's output, as torchvision's), plus, after a pool, the pooled output and its int64 indices; after
  ``fc6`` and ``fc7`` the ReLU output, the dropout mask and the dropout output; ``fc8`` its logits.
* ``workspace_bytes``: the gradient of the layer's input, alive while its backward runs (cuDNN workspaces are not
  modelled).

The loss (softmax cross-entropy on the last stage) has no parameters and its FLOPs are not counted. The executor has
no torch implementation of this model: ``executor.run`` refuses a ``vgg16`` plan with one line.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.cnn import conv_flops_fwd, conv_params
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "CONFIG_D", "build", "linear_params"]

NAME = "vgg16"
DESCRIPTION = ("VGG-16 (configuration D): 13 conv3x3 + ReLU in 5 pooled blocks, FC 4096-4096-classes; size x size "
               "RGB input (a multiple of 32), fp32")
DEFAULTS: dict[str, int | float] = {
    "size": 224,  # Simonyan & Zisserman §2.1: 224 x 224 RGB crops
    "classes": 1000,  # ImageNet ILSVRC-2012
}

#: Configuration D, block by block: the output channels of each 3x3 convolution (a 2x2 max-pool ends every block).
CONFIG_D: tuple[tuple[int, ...], ...] = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
FC_WIDTH = 4096  # outputs of fc6 and fc7
DTYPE_BYTES = 4  # fp32 weights, activations and gradients
INDEX_BYTES = 8  # int64 max-pool indices kept for the backward
MASK_BYTES = 1  # bool dropout mask kept for the backward
IN_CHANNELS = 3  # RGB


def linear_params(n_in: int, n_out: int) -> int:
    """Exact parameter count of Linear(n_in, n_out) with bias: n_in * n_out + n_out."""
    return n_in * n_out + n_out


def build(params: SpecParams) -> LayerGraph:
    """Build ``vgg16:size=..,classes=..`` (module docstring for every figure).

    Raises:
        SpecError: ``size`` not a positive multiple of 32, a non-positive ``classes``, a non-integer value or an
            unknown key.
    """
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    size, classes = values["size"], values["classes"]
    spec = canonical_spec(NAME, values)
    if size % 32:
        raise SpecError(f"size must be a multiple of 32 (VGG halves it five times), got size={size} in {spec!r}")

    layers: list[Layer] = []
    c_in, side = IN_CHANNELS, size
    for b, block in enumerate(CONFIG_D, start=1):
        for j, c_out in enumerate(block, start=1):
            conv_out = DTYPE_BYTES * c_out * side * side
            saved, out = conv_out, conv_out
            if j == len(block):  # the block's max-pool: its output and indices are created here too
                pooled = c_out * (side // 2) ** 2
                out = DTYPE_BYTES * pooled
                saved += (DTYPE_BYTES + INDEX_BYTES) * pooled
            flops = conv_flops_fwd(3, c_in, c_out, side, side)
            layers.append(Layer(name=f"conv{b}_{j}", kind="conv", flops_fwd=float(flops), flops_bwd=float(2 * flops),
                                param_bytes=DTYPE_BYTES * conv_params(3, c_in, c_out), activation_bytes=out,
                                saved_bytes=saved, workspace_bytes=DTYPE_BYTES * c_in * side * side))
            c_in = c_out
        side //= 2
    n_in = c_in * side * side  # 512 x 7 x 7 = 25,088 at 224
    for name, n_out in (("fc6", FC_WIDTH), ("fc7", FC_WIDTH), ("fc8", classes)):
        dropout = name != "fc8"
        saved = n_out * (2 * DTYPE_BYTES + MASK_BYTES) if dropout else n_out * DTYPE_BYTES
        flops = 2 * n_in * n_out
        layers.append(Layer(name=name, kind="linear", flops_fwd=float(flops), flops_bwd=float(2 * flops),
                            param_bytes=DTYPE_BYTES * linear_params(n_in, n_out),
                            activation_bytes=DTYPE_BYTES * n_out, saved_bytes=saved,
                            workspace_bytes=DTYPE_BYTES * n_in))
        n_in = n_out
    return LayerGraph(spec, layers, dtype_bytes=DTYPE_BYTES, input_bytes=DTYPE_BYTES * IN_CHANNELS * size * size)
