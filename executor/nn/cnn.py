"""Torch layers of the ``cnn`` model: PARTIME's stack of 'same' convolutions + ReLU, no downscaling, fp32.

Mirrors ``sim/models/cnn.py``: layer i (``conv{i}``) is Conv2d(C_in -> features, k x k, stride 1, padding
(k - 1) / 2, bias) followed by ReLU, C_in = 3 for layer 0 and ``features`` after, so every output is
(features, size, size) per sample and the parameter count is ``k^2 * C_in * features + features``. The graph's
dtype is fp32 (4 bytes), the same as these modules, so even the bytes agree.

Notation: n = samples, C = features, S = size (height = width in pixels), k = kernel.

Initialisation: He et al. 2015 (arXiv 1502.01852, §2.2, Eq. 10), weights N(0, 2 / fan_in) with
fan_in = C_in * k^2, biases 0. It keeps the activation variance constant through a deep ReLU stack, which
PyTorch's default (uniform, bound 1/sqrt(fan_in), variance shrinking ~6x per layer) does not; at PARTIME's
30 layers the default would leave the last layers' outputs and gradients vanishingly small.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["IN_CHANNELS", "ConvLayer", "make_layer", "make_batch", "loss"]

IN_CHANNELS = 3  # RGB frames, as in sim.models.cnn


class ConvLayer(nn.Module):
    """Layer ``conv{i}``: Conv2d(c_in, c_out, k, stride 1, 'same' zero padding, bias) then ReLU.

    Args:
        c_in: input channels (3 for layer 0, C after).
        c_out: output channels, C.
        kernel: k, odd (``sim.models.cnn`` rejects even kernels), so padding (k - 1) / 2 keeps S x S.
    """

    def __init__(self, c_in: int, c_out: int, kernel: int) -> None:
        super().__init__()
        assert kernel % 2 == 1, kernel  # the spec parser enforces it
        self.conv = nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2)

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator``: He-normal weights, zero biases (module docstring)."""
        fan_in = self.conv.in_channels * self.conv.kernel_size[0] * self.conv.kernel_size[1]
        with torch.no_grad():
            self.conv.weight.normal_(0.0, math.sqrt(2.0 / fan_in), generator=generator)
            self.conv.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """Convolve and rectify.

        Args:
            x: (n, c_in, S, S) fp32.

        Returns:
            (n, C, S, S) fp32, >= 0.
        """
        return F.relu(self.conv(x))


def make_layer(values: dict[str, int], i: int) -> nn.Module:
    """The uninitialised module of graph layer ``i`` (``conv{i}``).

    Args:
        values: the canonical spec's keys: ``layers``, ``features``, ``kernel``, ``size``.
        i: layer index in ``[0, layers)``.
    """
    assert 0 <= i < values["layers"], (i, values)
    c_in = IN_CHANNELS if i == 0 else values["features"]
    return ConvLayer(c_in, values["features"], values["kernel"])


def make_batch(values: dict[str, int], num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random frames and per-pixel regression targets.

    Images are N(0, 1), like normalised frames (zero mean, so no first-layer ReLU starts dead); targets are
    U[0, 1), inside the range a ReLU output can reach.

    Returns:
        images: (n, 3, S, S) fp32; targets: (n, C, S, S) fp32, the shape of the last layer's output.
    """
    size, features = values["size"], values["features"]
    images = torch.randn((num_samples, IN_CHANNELS, size, size), generator=generator)
    targets = torch.rand((num_samples, features, size, size), generator=generator)
    return images, targets


def loss(output: Tensor, targets: Tensor) -> Tensor:
    """Per-pixel mean-squared error, averaged over all n x C x S x S elements (``sim.models.cnn``'s loss).

    Args:
        output: (n, C, S, S) fp32, the last layer's output.
        targets: (n, C, S, S) fp32.

    Returns:
        () fp32 scalar.
    """
    return F.mse_loss(output, targets)
