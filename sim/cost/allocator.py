"""What a GPU reports beside what the memory ledger counts: PyTorch's caching allocator's reserved memory (DESIGN §6).

The ledger (:mod:`sim.cost.ledger`) counts the bytes of live tensors, what ``torch.cuda.max_memory_allocated`` would
say. What training logs print, and what runs out, is the allocator's *reserved* memory: the segments it holds from
the driver (``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``; torchtitan's "memory" figure, its
``DeviceMemoryMonitor.get_peak_stats``'s ``max_reserved``). PyTorch's ``CUDACachingAllocator`` (the "CUDA semantics
→ Memory management" page of its documentation; ``c10/cuda/CUDACachingAllocator.cpp``) keeps freed blocks cached per
stream instead of returning them, rounds requests up (512-byte blocks; small requests from 2 MiB segments, large ones
to 2 MiB multiples) and splits cached segments, so a step whose tensors come and go at many sizes ends up reserving
more than it ever holds at once: fragmentation. How much depends on the allocation order no model here replays; it
is taken as a fraction of the allocated peak, :data:`FRAGMENTATION`, the one allocator constant fitted.

Two facts bound it. The reserve never passes the device: when ``cudaMalloc`` fails the allocator frees its cached
blocks and retries (``num_alloc_retries``) before raising out-of-memory, so a step whose tensors fit runs, with
its reserve squeezed to what the device has. Hence a plan *fits* when its allocated peak fits the device (the
ledger's verdict, unchanged), and its *reported* peak is ``min(capacity, allocated x (1 + FRAGMENTATION))``. On a
CPU there is no caching allocator: the reserved figure is not reported.

The fit: ``python -m experiments.run torchtitan`` fits :data:`FRAGMENTATION` on a seeded half (seed 0) of the 20
torchtitan runs that publish their peak (``experiments/data/torchtitan/benchmarks.csv``, ``memory_gib``), minimising
the median |log error| of the reported peak, and prints the held-out half's errors beside the fit half's; the
constant here is that fit, rounded to the grid it searched (steps of 0.005).
"""

from __future__ import annotations

import math

from sim.hw.catalog import DeviceSpec

__all__ = ["FRAGMENTATION", "reserved_bytes"]

#: The caching allocator's reserve beyond the allocated peak, as a fraction of it (fitted; module docstring).
FRAGMENTATION = 0.11


def reserved_bytes(allocated_peak: int, device: DeviceSpec, fragmentation: float = FRAGMENTATION) -> int | None:
    """What PyTorch's caching allocator reserves on ``device`` for a step whose live tensors peak at
    ``allocated_peak`` bytes, with ``fragmentation`` (the fraction beyond the peak; module docstring): at most the
    device's memory. ``None`` on a device without that allocator (a CPU).

    Raises:
        ValueError: ``allocated_peak`` is negative or ``fragmentation`` is not a finite number >= 0.
    """
    if allocated_peak < 0:
        raise ValueError(f"allocated_peak must be >= 0 bytes, got {allocated_peak}")
    if not math.isfinite(fragmentation) or fragmentation < 0:
        raise ValueError(f"fragmentation must be a finite number >= 0, got {fragmentation!r}")
    if not device.is_gpu:
        return None
    grown = math.ceil(allocated_peak * (1 + fragmentation))
    return grown if device.memory_bytes == math.inf else min(grown, int(device.memory_bytes))
