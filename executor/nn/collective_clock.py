"""A process group whose collectives are timed: what lets the interpreter report the collectives that run inside a
compute op (tensor parallelism's all-reduces, expert parallelism's all-to-alls) as the plan's op after it.

The model-parallel collectives run inside the forward and backward passes, where the layers' autograd functions put
them, so they cannot be timed as ops of their own. Instead each call adds its seconds to this clock; after a compute
op the interpreter takes the total and draws it as the ``TP_*`` or ``EP_*`` span that follows (``executor.
interpreter``). On CUDA the device is synchronised around each call, so the time is the collective's, not its
launch's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["CollectiveClock"]

_T = TypeVar("_T")


class CollectiveClock:
    """One process's group of a model-parallel dimension, and a clock of the time its collectives take.

    Args:
        group: the process group (``None``: the default group, for a world of exactly ``size``).
        size: processes in the group.
        rank: this process's index in the group, ``0..size-1``.
        sync: called before and after each collective (``torch.cuda.synchronize`` on CUDA; nothing on CPU).

    Attributes:
        group, size, rank: as given.
        calls: collectives run so far (a test's check that the plan's collectives really happen).
    """

    def __init__(self, group: Any, size: int, rank: int, *, sync: Callable[[], None] | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside 0..{size - 1} of a group of {size}")
        self.group, self.size, self.rank = group, size, rank
        self._sync = sync or (lambda: None)
        self._seconds = 0.0
        self.calls = 0

    def timed(self, collective: Callable[[], _T]) -> _T:
        """Run ``collective`` (a blocking call on the group), adding its seconds to the clock; returns its result."""
        self._sync()
        start = time.perf_counter()
        result = collective()
        self._sync()
        self._seconds += time.perf_counter() - start
        self.calls += 1
        return result

    def take_seconds(self) -> float:
        """Seconds spent inside collectives since the last call (s); restarts the count."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds
