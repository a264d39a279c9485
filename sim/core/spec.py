"""Parsing of compact ``name:key=value,...`` specs (models, and anything else given as one string on the CLI).

Every parse error raises :class:`sim.core.errors.SpecError` naming the offending text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from sim.core.errors import SpecError, did_you_mean

__all__ = ["parse_spec", "SpecParams"]


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """Split ``"gpt:layers=48,hidden=2048"`` into ``("gpt", {"layers": "48", "hidden": "2048"})``.

    Raises:
        SpecError: empty name, a pair without ``=``, an empty key, or a key given twice.
    """
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"empty spec ({text!r})")
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise SpecError(f"spec has no name ({text!r})")
    params: dict[str, str] = {}
    if rest.strip():
        for pair in rest.split(","):
            key, eq, value = pair.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise SpecError(f"expected key=value in spec {text!r}, got {pair!r}")
            if key in params:
                raise SpecError(f"key {key!r} given twice in spec {text!r}")
            params[key] = value
    return name, params


class SpecParams:
    """Typed, checked access to the ``key=value`` parameters of one spec.

    Use :meth:`int` / :meth:`float` to read each known key with its default, then :meth:`finish` to reject keys
    nobody read (a typo such as ``layer=4`` must not be silently ignored).
    """

    def __init__(self, spec: str, params: Mapping[str, str]) -> None:
        self._spec = spec
        self._params = dict(params)
        self._read: set[str] = set()

    def int(self, key: str, default: int, *, minimum: int = 1) -> int:
        """The integer value of ``key`` (``default`` when absent); must be ≥ ``minimum``."""
        self._read.add(key)
        raw = self._params.get(key)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise SpecError(f"{key} must be an integer in spec {self._spec!r}, got {raw!r}") from None
        if value < minimum:
            raise SpecError(f"{key} must be >= {minimum} in spec {self._spec!r}, got {value}")
        return value

    def float(self, key: str, default: float, *, minimum: float = 0.0, strict: bool = False) -> float:
        """The finite float value of ``key``; must be ≥ ``minimum`` (``>`` when ``strict``)."""
        self._read.add(key)
        raw = self._params.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise SpecError(f"{key} must be a number in spec {self._spec!r}, got {raw!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = ">" if strict else ">="
            raise SpecError(f"{key} must be {bound} {minimum} in spec {self._spec!r}, got {raw!r}")
        return value

    def finish(self) -> None:
        """Raise if the spec had keys that were never read."""
        unknown = sorted(set(self._params) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            close = did_you_mean(unknown[0], self._read) if len(unknown) == 1 else ""
            raise SpecError(f"unknown key(s) {', '.join(unknown)} in spec {self._spec!r}{close} (known: {known})")
