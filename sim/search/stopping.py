"""When a search stops: its wall-clock deadline, or the person pressing Ctrl-C.

Every stage of a search (the screen, the refinement, the proof, annealing chains, the planner's estimates, the
evaluation pool) asks :func:`expired` between units of work, so both reasons stop it the same way: with what it has
found, which the command then ranks and writes. A deadline is a ``time.time()`` value (wall clock, which every worker
process reads alike); an interruption is one shared byte that the command's Ctrl-C handler sets
(:func:`stop_on_interrupt`) and that every worker process of the search's pools sees (:func:`share_with_worker`,
run by the pool's initializer), so a worker in the middle of a screen slice returns within one candidate.

A second Ctrl-C raises :class:`KeyboardInterrupt` as usual, for a person who does not want to wait for the files.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["expired", "interrupted", "request_stop", "stop_on_interrupt", "shared_flag", "share_with_worker",
           "seconds_left"]


class _Flag:
    """The interruption flag of this process: a byte in shared memory (created on first use in the command's
    process, handed to its pool workers when they start) or nothing yet."""

    shared: Any = None


def shared_flag() -> Any:
    """This process's interruption flag, created on first use: what :func:`share_with_worker` hands a pool worker."""
    if _Flag.shared is None:
        # A raw byte: one writer (the Ctrl-C handler), readers that only test it, so no lock is needed; spawn's
        # context, as the pools that receive it.
        _Flag.shared = multiprocessing.get_context("spawn").RawValue("b", 0)
    return _Flag.shared


def share_with_worker(flag: Any) -> None:
    """In a pool worker at start-up: read the interruption flag of the process that started the pool."""
    _Flag.shared = flag


def interrupted() -> bool:
    """Whether Ctrl-C asked this search to stop."""
    return _Flag.shared is not None and bool(_Flag.shared.value)


def request_stop() -> None:
    """Ask the search to stop with what it has (what Ctrl-C does): every stage sees :func:`expired` at its next
    check, in this process and in the pool workers."""
    shared_flag().value = 1


def clear() -> None:
    """Forget an earlier interruption (a new search in the same process starts afresh)."""
    if _Flag.shared is not None:
        _Flag.shared.value = 0


def expired(deadline: float | None) -> bool:
    """Whether the search must stop now: Ctrl-C, or the wall clock at or past ``deadline`` (``time.time()`` s;
    ``None``: no deadline)."""
    return interrupted() or (deadline is not None and time.time() >= deadline)


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (0 once interrupted or past it; ``None`` without a deadline)."""
    if interrupted():
        return 0.0
    return None if deadline is None else max(0.0, deadline - time.time())


@contextmanager
def stop_on_interrupt(message: str = "") -> Iterator[None]:
    """Within the block, the first Ctrl-C (SIGINT) asks the search to stop with what it has (:func:`request_stop`)
    and prints ``message`` on stderr; a second one raises :class:`KeyboardInterrupt`. The previous handler is put back
    on leaving. Only in the main thread (elsewhere signal handlers cannot be set: the block then changes nothing)."""
    clear()
    shared_flag()  # created before any pool starts, so every worker gets the same one
    try:
        previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, _first_interrupt(message))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _first_interrupt(message: str):
    def handle(signum: int, frame: Any) -> None:
        if interrupted():
            raise KeyboardInterrupt
        request_stop()
        if message:
            print(message, file=sys.stderr, flush=True)
    return handle
