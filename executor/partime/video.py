"""A seeded synthetic video stream for online learning (PARTIME): frame f is a pure function of (spec, f).

PARTIME (Meloni et al., ICMLA 2022) learns from a live source one frame at a time and bets that consecutive frames
differ little. This module makes such a source without a camera: a smoothly moving image and, per pixel, a target
the network can learn, computed for any frame index alone, so every rank of a pipeline (and the single-process
reference, :mod:`executor.partime.partime_reference`) makes bitwise the same frame f without making the frames before
it.

The scene. Each of the 3 input channels is a sum of :data:`WAVES` plane waves over the S x S pixel grid::

    x[c, i, j] = sum_k  a_k * sin(2 pi (u_k * i + v_k * j) / S + phi_k + r_k * drift * f)

with seeded amplitudes a_k, integer spatial frequencies (u_k, v_k) (so the pattern tiles the grid), phases phi_k
and phase rates r_k in [0.5, 1.5] with a random sign (waves move at different speeds and directions). A wave's phase
advances by at most 1.5 * ``drift`` radians per frame, so consecutive frames differ by O(drift); ``drift = 0`` is a
still image (every frame equal). The amplitudes are normalised so the channel's mean square over a period is 1, the
scale of a normalised camera frame.

The teacher. ``y = sigmoid(2 * (w * x + b))``, with ``w * x + b`` a fixed seeded 3 -> C 3x3 convolution ('same'
zero padding, bias) of the frame: a per-pixel function of the neighbourhood that a 'same' CNN can represent, so the
online loss can go down. It is a tanh squashing shifted into (0, 1) (``sigmoid(2z) = (1 + tanh z) / 2``) because the
``cnn`` model's last layer is a ReLU, which cannot output a negative target. The teacher depends on the stream's
seed only, not on the scene: it is the fixed labelling function of the world.

The cut. With ``cut_at = k``, frames ``f >= k`` show another scene: new seeded frequencies, amplitudes, phases and
rates (scene 1 instead of scene 0), an abrupt change of content between frames k - 1 and k, as at a cut in a video.
The teacher does not change: what was learnt about the labelling function still holds, only the input moved.

Determinism. Every random draw comes from a ``torch.Generator`` seeded by :func:`executor.nn.seeds.derive_seed` with
its own purpose tag, and the arithmetic is CPU float64 rounded once to fp32, so the same spec and f give identical
tensors in any process on the same build. Nothing touches the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from executor.nn.seeds import derive_seed
from sim.core.errors import SpecError

__all__ = ["VideoSpec", "frame", "scene_of", "WAVES", "IN_CHANNELS", "MAX_FRAME_ELEMENTS"]

IN_CHANNELS = 3  # RGB, as the cnn model's first layer expects
WAVES = 4  # plane waves per channel: enough for a textured image, few enough to stay smooth
MAX_SPATIAL_FREQUENCY = 3  # cycles per frame width: the image stays smooth at any size >= 7 pixels
#: The largest frame a stream may describe, in fp32 elements of x or y (2^26 = 256 MiB): refused before allocating.
MAX_FRAME_ELEMENTS = 2**26


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class VideoSpec:
    """A synthetic stream.

    Attributes:
        size: S, the frame's height and width in pixels, >= 1.
        features: C, the target's channels (the ``cnn`` model's ``features``), >= 1.
        seed: the stream's seed (any int): the scenes and the teacher derive from it.
        drift: phase rate scale in radians per frame, finite (0: a still image; a wave moves at 0.5 to 1.5 times it).
        cut_at: the first frame of the second scene (an abrupt change of content), >= 0, or ``None`` for one scene.

    Raises:
        SpecError: a value outside these ranges, or a frame of more than :data:`MAX_FRAME_ELEMENTS` elements; the
            message names the value.
    """

    size: int
    features: int
    seed: int = 0
    drift: float = 0.05
    cut_at: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.size) or self.size < 1:
            raise SpecError(f"stream size must be an int >= 1, got {self.size!r}")
        if not _is_int(self.features) or self.features < 1:
            raise SpecError(f"stream features must be an int >= 1, got {self.features!r}")
        if not _is_int(self.seed):
            raise SpecError(f"stream seed must be an int, got {self.seed!r}")
        if isinstance(self.drift, bool) or not isinstance(self.drift, (int, float)) or not math.isfinite(self.drift):
            raise SpecError(f"stream drift must be a finite number of radians per frame, got {self.drift!r}")
        if self.cut_at is not None and (not _is_int(self.cut_at) or self.cut_at < 0):
            raise SpecError(f"stream cut_at must be an int >= 0 or None, got {self.cut_at!r}")
        elements = max(IN_CHANNELS, self.features) * self.size * self.size
        if elements > MAX_FRAME_ELEMENTS:
            raise SpecError(f"stream frame of {max(IN_CHANNELS, self.features)} x {self.size} x {self.size} = "
                            f"{elements} elements exceeds the limit of {MAX_FRAME_ELEMENTS}")


def scene_of(spec: VideoSpec, f: int) -> int:
    """The scene frame ``f`` shows: 0, or 1 from ``spec.cut_at`` on."""
    return 0 if spec.cut_at is None or f < spec.cut_at else 1


def _scene_image(spec: VideoSpec, scene: int, f: int) -> Tensor:
    """x of frame ``f`` in ``scene``: (3, S, S) float64 (module docstring's sum of plane waves)."""
    g = torch.Generator(device="cpu").manual_seed(derive_seed("stream-scene", spec.seed, scene))
    shape = (IN_CHANNELS, WAVES)
    amplitude = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    # frequencies in -3..3 per axis; (0, 0) would be a constant, so it is moved to (1, 0)
    u = torch.randint(-MAX_SPATIAL_FREQUENCY, MAX_SPATIAL_FREQUENCY + 1, shape, generator=g).to(torch.float64)
    v = torch.randint(-MAX_SPATIAL_FREQUENCY, MAX_SPATIAL_FREQUENCY + 1, shape, generator=g).to(torch.float64)
    u = torch.where((u == 0) & (v == 0), torch.ones_like(u), u)
    phase = torch.rand(shape, generator=g, dtype=torch.float64) * (2 * math.pi)
    rate = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5) * torch.where(
        torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    # each wave's mean square over a period is a^2 / 2: scale so that the channel's sum is 1
    amplitude = amplitude * torch.sqrt(2.0 / (amplitude * amplitude).sum(dim=1, keepdim=True))
    grid = torch.arange(spec.size, dtype=torch.float64) * (2 * math.pi / spec.size)
    # the phase of frame f is computed from f directly (no accumulation), so any rank gets the same value
    shift = phase + rate * (spec.drift * f)
    # sin(A_i + B_j) = sin A_i cos B_j + cos A_i sin B_j: 4 K S sines instead of K S^2 (torch's CPU sin costs
    # about 0.5 us an element here, which made a 32 x 32 frame cost 8 ms)
    rows = u[..., None] * grid + shift[..., None]  # A_i: (3, K, S)
    cols = v[..., None] * grid  # B_j: (3, K, S)
    weighted_sin, weighted_cos = amplitude[..., None] * torch.sin(rows), amplitude[..., None] * torch.cos(rows)
    cos_cols, sin_cols = torch.cos(cols), torch.sin(cols)
    image = torch.zeros((IN_CHANNELS, spec.size, spec.size), dtype=torch.float64)
    for k in range(WAVES):  # summed wave by wave, elementwise: the same order whatever torch's thread count
        image += weighted_sin[:, k, :, None] * cos_cols[:, k, None, :]
        image += weighted_cos[:, k, :, None] * sin_cols[:, k, None, :]
    return image


def _convolve(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``conv2d(x, weight, bias, padding=1)`` for one (3, S, S) image and 3x3 weights, float64, as 27 elementwise
    multiply-adds in a fixed order: bitwise the same in every process (a library convolution may split its sums
    differently by thread count), and faster than torch's float64 CPU convolution at these sizes."""
    size = x.shape[-1]
    padded = F.pad(x, (1, 1, 1, 1))
    out = bias[:, None, None].expand(-1, size, size).clone()
    for c in range(x.shape[0]):
        for di in range(3):
            for dj in range(3):
                out += weight[:, c, di, dj, None, None] * padded[c, di:di + size, dj:dj + size]
    return out


def _teacher(spec: VideoSpec) -> tuple[Tensor, Tensor]:
    """The teacher's 3 -> C 3x3 weights (C, 3, 3, 3) and bias (C,), float64, from the stream's seed alone."""
    g = torch.Generator(device="cpu").manual_seed(derive_seed("stream-teacher", spec.seed, 0))
    fan_in = IN_CHANNELS * 9
    weight = torch.randn((spec.features, IN_CHANNELS, 3, 3), generator=g, dtype=torch.float64) / math.sqrt(fan_in)
    bias = torch.randn((spec.features,), generator=g, dtype=torch.float64) * 0.5
    return weight, bias


def frame(spec: VideoSpec, f: int) -> tuple[Tensor, Tensor]:
    """Frame ``f`` of the stream and its target.

    Args:
        spec: the stream.
        f: the frame index, an int >= 0.

    Returns:
        ``(x, y)``: x (1, 3, S, S) fp32, mean square about 1; y (1, C, S, S) fp32 in (0, 1), the teacher of x.

    Raises:
        SpecError: ``f`` is not an int >= 0.
    """
    if not _is_int(f) or f < 0:
        raise SpecError(f"frame index must be an int >= 0, got {f!r}")
    x = _scene_image(spec, scene_of(spec, f), f)
    y = torch.sigmoid(2.0 * _convolve(x, *_teacher(spec)))
    return x[None].to(torch.float32), y[None].to(torch.float32)
