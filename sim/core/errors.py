"""The one exception type for bad user input, and how the CLIs report it.

Library code raises :class:`SpecError` (a ``ValueError``) with the offending value in the message. The command-line
entry points catch it and print ``error: <message>`` with exit status 2, never a traceback (DESIGN §8).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

__all__ = ["SpecError", "fail", "run_cli"]

T = TypeVar("T")


class SpecError(ValueError):
    """A user-supplied value (spec string, file, flag) is invalid; the message names the value."""


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_cli(main: Callable[[], T]) -> T:
    """Run a CLI body, turning :class:`SpecError` (and unreadable or non-UTF-8 files) into one ``error:`` line and exit
    2."""
    try:
        return main()
    except SpecError as exc:
        fail(str(exc))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        fail(f"cannot read {exc.filename!r}: {exc.strerror}")
    except UnicodeDecodeError as exc:
        # Input files are read through sim.core.fileio.read_text, which names the file; this is the backstop for a read
        # that is not, where the exception knows the bytes but not the file.
        fail(f"an input file is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})")
