"""Host↔device copy bandwidth of a CUDA device, from pinned and from pageable host memory.

Pinned (page-locked) host memory lets the GPU's copy engine DMA directly; pageable memory is first staged through a
driver-owned pinned buffer, so it is slower and is what a plain ``tensor.to("cuda")`` of an ordinary CPU tensor
gets. Offloading schedules move activations or optimizer state over this link, so the simulator wants both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["HostCopyResult", "measure_host_copy", "DEFAULT_COPY_BYTES"]

#: Buffer size of each copy: 64 MiB is far above the size where the fixed per-copy cost (µs) still shows.
DEFAULT_COPY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class HostCopyResult:
    """Median copy bandwidths in bytes/s (bytes copied / median copy time)."""

    h2d_pinned_bytes_per_s: float
    d2h_pinned_bytes_per_s: float
    h2d_pageable_bytes_per_s: float
    d2h_pageable_bytes_per_s: float


def _median_copy_s(dst: torch.Tensor, src: torch.Tensor, warmup: int, repeats: int) -> float:
    """Median time in s of ``dst.copy_(src)``, synchronising the device before and after each copy."""
    device = dst.device if dst.is_cuda else src.device
    times = []
    for k in range(warmup + repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)  # a copy involving pinned memory may return before the DMA has finished
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_host_copy(device: torch.device, *, nbytes: int = DEFAULT_COPY_BYTES, warmup: int = 3,
                      repeats: int = 10) -> HostCopyResult:
    """Measure H2D and D2H bandwidth between host memory and ``device``.

    Args:
        device: a CUDA device.
        nbytes: bytes per copy.
        warmup: untimed copies per direction and memory kind.
        repeats: timed copies per direction and memory kind, >= 1; the median is kept.

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("host copy bandwidth needs a CUDA device")
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)  # touch every page so the first timed copies do not pay for page faults
    pinned.fill_(1)
    return HostCopyResult(
        h2d_pinned_bytes_per_s=nbytes / _median_copy_s(gpu, pinned, warmup, repeats),
        d2h_pinned_bytes_per_s=nbytes / _median_copy_s(pinned, gpu, warmup, repeats),
        h2d_pageable_bytes_per_s=nbytes / _median_copy_s(gpu, pageable, warmup, repeats),
        d2h_pageable_bytes_per_s=nbytes / _median_copy_s(pageable, gpu, warmup, repeats),
    )
