"""Producing a command's output files on two cores at once: the bytes of some in a forked child while this process
produces the others.

A screened search ends by encoding tens of thousands of records and drawing a chart, single-threaded work of about
0.7 s on the 2-core machine (2026-12-07) that also stands between a Ctrl-C and the exit (its promise: a second). Its
worker pools have stopped by then, so a core is idle: :func:`produce_in_parallel` runs the first producer here and
the rest in one child forked from this process, which inherits the finished result and so needs nothing sent to it.
The child only *produces* bytes and hands them back through a pipe; this process writes every file itself, so that
the command's output set (:mod:`sim.core.output_set`) records them all and the files are the same whichever way the
bytes were made.

The child is a convenience, never a second source of truth: where forking is not safe (not Linux, or other threads
running, whose locks a child would inherit held) the producers run here one after another, and where the child fails
(an exception, a signal, a short hand-back) its producers run again here, so that a real error is raised in this
process with its own traceback. A child never outlives the call: Ctrl-C (its default action in the child) or any
exception here kills and reaps it, and the kernel kills it if this process dies (:func:`die_with_parent`).
"""

from __future__ import annotations

import gc
import os
import signal
import struct
import sys
import threading
from collections.abc import Callable, Sequence

from sim.core.lifetime import die_with_parent

__all__ = ["produce_in_parallel", "can_fork_safely"]

#: Signals blocked across the fork, so that none reaches the child before it has its own handlers (the default
#: actions) and never runs this process's Python handlers, which would unwind into the caller's code.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: The hand-back's framing: each product as its length (8 bytes, big-endian) and its bytes, in the producers' order.
_LENGTH = struct.Struct(">Q")


def can_fork_safely() -> bool:
    """Whether a child forked now can run Python safely: Linux, and no thread but this one (a fork copies only the
    calling thread; a lock another thread holds, in the allocator, logging or an import, stays held in the child)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def produce_in_parallel(producers: Sequence[Callable[[], bytes]]) -> list[bytes]:
    """Every producer's bytes, in order: the first made in this process while one forked child makes the others
    (module docstring); one after another here where that is not safe or the child fails. Each producer must be a
    pure function of state this process already holds (the child sees it as it was at the fork)."""
    if len(producers) < 2 or not can_fork_safely():
        return [produce() for produce in producers]
    read_end, write_end = os.pipe()
    sys.stdout.flush()  # or what is buffered here could be written twice (the child exits with os._exit: it is not)
    sys.stderr.flush()
    parent = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:
            _child(producers[1:], read_end, write_end, parent)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(write_end)
    reaped = False
    try:
        first = producers[0]()
        handed = _read_products(read_end, len(producers) - 1)
        _, status = os.waitpid(pid, 0)
        reaped = True
    finally:
        os.close(read_end)
        if not reaped:  # an exception or Ctrl-C here: the child's work is no longer wanted
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if handed is None or status != 0:  # the child failed: make its products here, where an error is the caller's
        return [first, *(produce() for produce in producers[1:])]
    return [first, *handed]


def _child(producers: Sequence[Callable[[], bytes]], read_end: int, write_end: int, parent: int) -> None:
    """The forked child's whole life: make the products, hand them back, exit; never returns into the caller."""
    status = 1
    # Every object inherited from the parent out of the collector's view: a collection would otherwise walk them all
    # and, by touching each one's header, copy every page of the parent's heap into this child (CPython's own advice
    # for forked children; their memory is the parent's as it was, and none of it is freed here).
    gc.freeze()
    try:
        for sig in _STOP_SIGNALS:  # Ctrl-C ends the child at once; the parent sees the signal and makes its share
            signal.signal(sig, signal.SIG_DFL)
        os.close(read_end)
        die_with_parent(parent)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        # All made before any is sent: a pipe holds 64 KiB, and a send blocks until the parent, busy making its own
        # product, reads; the next product would wait for that too.
        products = [produce() for produce in producers]
        with os.fdopen(write_end, "wb") as pipe:
            for data in products:
                pipe.write(_LENGTH.pack(len(data)))
                pipe.write(data)
        status = 0
    except BaseException:  # noqa: BLE001 - any failure is reported by the status; the parent makes it again
        pass
    finally:
        os._exit(status)


def _read_products(read_end: int, count: int) -> list[bytes] | None:
    """The ``count`` products the child hands back, or ``None`` if the pipe closes before they are all there."""
    with os.fdopen(read_end, "rb", closefd=False) as pipe:
        products = []
        for _ in range(count):
            head = pipe.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return None
            (length,) = _LENGTH.unpack(head)
            data = pipe.read(length)
            if len(data) < length:
                return None
            products.append(data)
        return products
