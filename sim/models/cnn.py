"""``cnn``: PARTIME's stack of convolutions with no downscaling, trained online in fp32.

The PARTIME talk (seed notes) benchmarks "a CNN with no downscaling (for ease of balancing)" whose basic
configuration is 10 layers, 16 features per layer and kernel size 5; its variants are 30 layers, 48 features and
kernel 15. The resolution is not stated there; PARTIME's released experiment scripts (sailab-code/partime, see
../shared/reference/hardware.md §4.6) feed 3 x 256 x 256 and 3 x 1024 x 1024 frames, so ``size`` defaults to 256.

Layer i (``conv{i}``) is Conv2d(C_in -> features, k x k, stride 1, padding (k-1)/2 ('same'), bias) + ReLU, with
C_in = 3 (an RGB frame) for layer 0 and ``features`` after. Every output is features x size x size in fp32.

Loss: the last layer's output goes into a per-pixel mean-squared error against a target of the same shape,
computed on the last stage. It has no parameters and its ~3 FLOPs per output element are not counted.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "build", "conv_params", "conv_flops_fwd"]

NAME = "cnn"
DESCRIPTION = "PARTIME conv stack: conv kxk 'same' + ReLU layers, no downscaling, size x size RGB input, fp32"
DEFAULTS: dict[str, int | float] = {
    "layers": 10,  # PARTIME talk, "basic configuration"
    "features": 16,  # output channels of every layer (same source)
    "kernel": 5,  # same source; must be odd for 'same' padding
    "size": 256,  # input height = width in pixels (PARTIME experiment scripts use 256 and 1024)
}

DTYPE_BYTES = 4  # fp32 weights and activations
IN_CHANNELS = 3  # RGB frames


def conv_params(k: int, c_in: int, c_out: int) -> int:
    """Exact parameter count of Conv2d(c_in, c_out, k) with bias: k^2 * c_in * c_out + c_out."""
    return k * k * c_in * c_out + c_out


def conv_flops_fwd(k: int, c_in: int, c_out: int, height: int, width: int) -> int:
    """Forward FLOPs per sample of a stride-1 'same' convolution: 2 * k^2 * c_in * c_out * H * W.

    Each of the c_out * H * W outputs is a k^2 * c_in dot product, one multiply and one add per term
    (zero padding is counted as if it were data). Bias add and ReLU are elementwise and not counted.
    """
    return 2 * k * k * c_in * c_out * height * width


def build(params: SpecParams) -> LayerGraph:
    """Build ``cnn:layers=..,features=..,kernel=..,size=..``.

    Each layer keeps its ReLU output for backward (ReLU's own backward and the next convolution's weight
    gradient both read it), so ``saved_bytes = activation_bytes = 4 * features * size^2``; the pre-ReLU
    convolution output of the same size is transient (``workspace_bytes``). Backward FLOPs are 2x forward
    (input gradient and weight gradient are each a convolution of the forward's size).

    Raises:
        SpecError: a size below 1, an even kernel, a non-integer value, or an unknown key.
    """
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    n_layers, c, k, size = (values[key] for key in ("layers", "features", "kernel", "size"))
    spec = canonical_spec(NAME, values)
    if k % 2 == 0:
        raise SpecError(f"kernel must be odd for 'same' padding, got kernel={k} in {spec!r}")

    out_bytes = DTYPE_BYTES * c * size * size
    layers = []
    for i in range(n_layers):
        c_in = IN_CHANNELS if i == 0 else c
        flops = conv_flops_fwd(k, c_in, c, size, size)
        layers.append(
            Layer(
                name=f"conv{i}",
                kind="conv",
                flops_fwd=float(flops),
                flops_bwd=float(2 * flops),
                param_bytes=DTYPE_BYTES * conv_params(k, c_in, c),
                activation_bytes=out_bytes,
                saved_bytes=out_bytes,
                workspace_bytes=out_bytes,
            )
        )
    return LayerGraph(spec, layers, dtype_bytes=DTYPE_BYTES, input_bytes=DTYPE_BYTES * IN_CHANNELS * size * size)
