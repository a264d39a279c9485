"""What every command of the project shares: the argument parser with the house error format and the byte-size
syntax of options such as ``--device-param-budget`` (DESIGN §8).

``sim.run``, ``sim.bench``, ``executor.run``, ``profiles.measure`` and ``experiments.run`` all build their parsers
from :class:`CliParser`, so a bad flag reads the same everywhere: one ``error: ...`` line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn, TypeVar

from sim.core.errors import did_you_mean, fail

_T = TypeVar("_T")

__all__ = ["CliParser", "parse_byte_size", "argument_type", "BYTE_UNITS"]

#: Byte-size suffixes: SI for KB/MB/GB/TB, binary for KiB/MiB/GiB/TiB (upper-cased before lookup).
BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


class CliParser(argparse.ArgumentParser):
    """argparse with the house error format: one ``error: ...`` line, exit status 2 (never argparse's usage dump)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """One ``error:`` line, status 2; an unknown flag names the command's closest flags."""
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = [option for option in self._option_string_actions if option.startswith("--")]
            unknown = [word.split("=")[0] for word in message.removeprefix(prefix).split() if word.startswith("-")]
            if len(unknown) == 1:
                message += did_you_mean(unknown[0], flags, prefix="--", cutoff=0.6)
        fail(message)

    def _check_value(self, action: argparse.Action, value: object) -> None:
        """argparse's check of a ``choices`` option, its message naming the closest choices too. (argparse has no
        public hook for this message; the method has kept its name and signature since Python 3.2.)"""
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(c) for c in choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{did_you_mean(value, names)} (choose "
                                                 f"from {', '.join(names)})")


def parse_byte_size(text: str) -> int:
    """``2GB``, ``1.5GiB``, ``300MB``, ``3e8`` → bytes (SI for KB/MB/GB, binary for KiB/MiB/GiB).

    Raises:
        argparse.ArgumentTypeError: not a number with a known unit, negative, or not finite.
    """
    value = text.strip().upper()
    unit = next((u for u in sorted(BYTE_UNITS, key=len, reverse=True) if u and value.endswith(u)), "")
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GB, 512MiB, 300000000)") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"a byte size must be finite and >= 0, got {text!r}")
    return int(number * BYTE_UNITS[unit])


def argument_type(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """An argparse ``type`` from a library parser that raises ValueError: its message becomes the flag's one
    ``error:`` line (argparse itself would replace it with "invalid ... value")."""
    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert
