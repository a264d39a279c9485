"""All-or-none output sets: the files one command writes are all kept, or none of them is.

A command writes several files (``sim.run``: ``plan.json``, ``schedule.csv``, ``metrics.json``, ``trace.json``,
``gantt.png``). Each file is written atomically (:func:`sim.core.fileio.write_bytes_atomic`: a temporary file, then
a rename), so no single file is ever partial; this module makes the *set* atomic in the same sense. The approach is
"write every file atomically, remove what was written on failure": while an :func:`all_or_none` block is open, every
file written through :mod:`sim.core.fileio` is recorded, and a file it replaces is first kept under a hidden backup
name (a hard link, so the replacement stays a single rename). If the block raises (a :class:`SpecError`, a full disk,
``KeyboardInterrupt``, ``SystemExit`` with a non-zero status), the new files are removed, the replaced ones put back
and the directories :func:`sim.core.fileio.prepare_output_dir` created for the set removed if they are empty; the
directory then looks as it did before the command. If the block completes, the backups are deleted.

:func:`sim.core.errors.run_cli` opens one such block around every command, a *lazy* one: it records nothing until
the command prepares its output directory in it (:func:`sim.core.fileio.prepare_output_dir`), so each command that
does is all or none. Writes are recorded by the innermost recording block; a nested block
(``sim.report.outputs.write_run_outputs``) rolls back its own files when it fails and, when it completes, hands them
to the enclosing recording block, which decides, or keeps them if there is none. Without a recording block the
writes are plain atomic writes.

Only a block that ends can clean up: a process that leaves with ``os._exit`` (the executor's ranks) never ends the
``run_cli`` block, so it must write inside its own ``all_or_none()`` block and not prepare a directory outside one,
or the backups of the files it replaced would stay. A process killed outright (``SIGKILL``, power loss) cannot roll
back either: it can leave complete new files beside old ones and hidden ``.*.bak-*`` backups; no partial file,
still.

This module imports nothing from the project (``sim.core.errors`` and ``sim.core.fileio`` both use it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["OutputSet", "all_or_none", "active_set", "claim_innermost_set", "backup_name"]


def backup_name(target: Path) -> Path:
    """A fresh hidden name next to ``target`` for the file it replaces (kept until the set completes)."""
    return target.with_name(f".{target.name[:64]}.bak-{os.getpid()}-{secrets.token_hex(4)}")


@dataclass
class OutputSet:
    """The files written, and the directories created, since a set was opened; in order.

    Attributes:
        written: ``(file, backup of the file it replaced or None)`` per completed write.
        created: directories made for the set's outputs, outermost first.
        recording: whether writes are recorded here (a lazy set starts without, until an output directory is
            prepared in it).
    """

    written: list[tuple[Path, Path | None]] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)
    recording: bool = True

    def adopt(self, inner: OutputSet) -> None:
        """Take over a completed inner set's records: this set now decides whether they stay."""
        self.written += inner.written
        self.created += inner.created

    def commit(self) -> None:
        """Keep the new files: delete the backups of the files they replaced."""
        for _, backup in self.written:
            if backup is not None:
                with contextlib.suppress(OSError):
                    backup.unlink()
        self.written, self.created = [], []

    def rollback(self) -> None:
        """Undo the set, newest first: remove each new file (putting back the one it replaced), then remove the
        created directories that are empty. Never raises; what cannot be undone is left as it is."""
        for target, backup in reversed(self.written):
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, target)
                else:
                    target.unlink(missing_ok=True)
        for directory in reversed(self.created):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty: a directory holding anything else stays
        self.written, self.created = [], []


_ACTIVE: list[OutputSet] = []


def active_set() -> OutputSet | None:
    """The innermost open set that records writes, or ``None`` (then writes are plain atomic writes)."""
    return next((outputs for outputs in reversed(_ACTIVE) if outputs.recording), None)


def claim_innermost_set() -> OutputSet | None:
    """The innermost open set, made to record from now on (an output directory is being prepared in it), or
    ``None`` outside any set."""
    if not _ACTIVE:
        return None
    _ACTIVE[-1].recording = True
    return _ACTIVE[-1]


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """Ignore Ctrl-C while a rollback runs, so a second one cannot leave it half done (main thread only: Python
    handles signals there and nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def all_or_none(*, lazy: bool = False) -> Iterator[OutputSet]:
    """Keep the files written inside the block only if the block completes (see the module docstring).

    A ``SystemExit`` with status 0 or ``None`` counts as completing; any other exception rolls the set back and
    propagates unchanged.

    Args:
        lazy: record nothing until an output directory is prepared in the block (``run_cli``'s block).
    """
    current = OutputSet(recording=not lazy)
    _ACTIVE.append(current)
    try:
        yield current
    except BaseException as exc:
        _ACTIVE.remove(current)
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            _finish(current)
        else:
            with _no_interrupt():
                current.rollback()
        raise
    _ACTIVE.remove(current)
    _finish(current)


def _finish(completed: OutputSet) -> None:
    outer = active_set()
    if outer is not None:
        outer.adopt(completed)
    else:
        completed.commit()
