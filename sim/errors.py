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
    """Run a CLI body, turning :class:`SpecError` (and unreadable files) into one ``error:`` line and exit 2."""
    try:
        return main()
    except SpecError as exc:
        fail(str(exc))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        fail(f"cannot read {exc.filename!r}: {exc.strerror}")
