"""Atomic file writes: a reader (or a crash) sees either the old file or the complete new one, never a partial one.

Every output of a run (plan, schedule, metrics, trace, chart) is written through here, which is how "never a partial
output file presented as complete" holds. Input text files (plans, profiles, schedule CSVs, topology YAML) are read
through :func:`read_text`, so a binary or mis-encoded file is a :class:`SpecError` naming it, not a traceback.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from sim.core.errors import SpecError

__all__ = ["read_text", "write_bytes_atomic", "write_text_atomic", "write_json_atomic"]


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of an input file.

    Args:
        path: the file.
        what: what the file is, for the message (``"profile"``, ``"plan"``, ``"schedule file"``).

    Raises:
        SpecError: the file is not UTF-8 text; the message names ``what``, the file and the first bad byte.
        OSError: the file cannot be read (the CLIs report it as ``cannot read ...``).
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{what} {os.fspath(path)} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start})") from None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one.

    The bytes go to a temporary file in the same directory (same filesystem, so the rename is atomic), are flushed
    to disk, and the temporary file is then renamed over ``path``. On any error the temporary file is removed.

    Args:
        path: the destination file; its directory must exist.
        data: the complete file content.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with mode 0o666 lets the umask decide the final permissions, like a plain open() would.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(data: Any, path: str | os.PathLike) -> None:
    """Write canonical JSON (sorted keys, one-space indent, trailing newline) to ``path`` atomically."""
    write_text_atomic(json.dumps(data, sort_keys=True, indent=1) + "\n", path)
