"""A published row's prediction, shared by the experiments that set the simulator against published throughput
tables (``megatron_bridge``, ``torchtitan``): each reads its own rows, and judges them by the same record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["PublishedRow", "RowResult"]


class PublishedRow(Protocol):
    """What a published row must give to be judged: its throughput."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The published training throughput, tokens/s per GPU."""
        ...


R = TypeVar("R", bound=PublishedRow)


@dataclass(frozen=True)
class RowResult(Generic[R]):
    """A published row, its prediction (tokens/s per GPU), its predicted peak memory (bytes, max over devices) and
    what of its configuration is assumed or the simulator does not model."""

    row: R
    predicted: float
    peak_memory_bytes: float
    unmodelled: tuple[str, ...]

    @property
    def error(self) -> float:
        """predicted / published − 1."""
        return self.predicted / self.row.tokens_per_s_per_gpu - 1
