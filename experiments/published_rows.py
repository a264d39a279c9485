"""A published row's prediction, shared by the experiments that set the simulator against published throughput
tables (``megatron_bridge``, ``torchtitan``): each reads its own rows, and judges them by the same record."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["PublishedRow", "RowResult", "device_peaks"]


class PublishedRow(Protocol):
    """What a published row must give to be judged: its throughput."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The published training throughput, tokens/s per GPU."""
        ...


R = TypeVar("R", bound=PublishedRow)


@dataclass(frozen=True)
class RowResult(Generic[R]):
    """A published row, its prediction (tokens/s per GPU), its predicted peak memory (bytes, max over devices), what
    of its configuration is assumed or the simulator does not model, and the memory ledger's verdict: ``fits``, every
    device's predicted peak within its capacity (a published run ran, so ``False`` is a false out-of-memory); and
    the largest peak the GPUs' caching allocator is predicted to reserve (bytes; ``None`` without one:
    :mod:`sim.cost.allocator`), what GPUs report; and the regime its plan is in (``metrics.json``'s ``regime``,
    :mod:`sim.report.interval`), which its residual calibrates."""

    row: R
    predicted: float
    peak_memory_bytes: float
    unmodelled: tuple[str, ...]
    fits: bool
    reserved_memory_bytes: float | None = None
    regime: dict[str, str] | None = None

    @property
    def error(self) -> float:
        """predicted / published − 1."""
        return self.predicted / self.row.tokens_per_s_per_gpu - 1


def device_peaks(metrics: dict) -> tuple[float, bool, float | None]:
    """From a prediction's ``metrics.json`` object: the largest predicted peak over its devices (allocated bytes),
    whether every device's peak is within its capacity (``memory_capacity_bytes``; absent or ``None``: unlimited),
    and the largest reserved peak (bytes; ``None`` where no device reports one)."""
    devices = metrics["devices"]
    peak = max(device.get("peak_memory_bytes", 0) for device in devices)
    fits = all(device.get("peak_memory_bytes", 0) <= (device.get("memory_capacity_bytes") or math.inf)
               for device in devices)
    reserved = [device["reserved_memory_bytes"] for device in devices if "reserved_memory_bytes" in device]
    return peak, fits, max(reserved) if reserved else None
