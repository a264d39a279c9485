"""Tying a child process's life to its parent's: a killed command leaves no process behind (DESIGN §8).

Used by ``sim.search``'s evaluation workers and by ``executor.launch``'s ranks. Linux only: elsewhere the child goes
on without, and may outlive a parent killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent dies; returns whether that is armed.

    ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes. The request covers only a parent alive when it is made, so
    if ``expected_parent`` (a process id) is given and the parent is no longer it (it died first and this process
    was handed to init or a subreaper), this process kills itself at once, as the kernel would have. "Parent" is the
    thread that started the process: start children from a thread that lives as long as the parent (the main one).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                           ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):  # no C library to load, or one without prctl
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return armed
