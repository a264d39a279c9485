"""What the schedule-against-schedule experiments share (``megatron_interleaved``, ``zero_bubble``): a case (a model
on a family of ``{p}x<device>`` topologies), the GPT they both run, the ``--cases`` flag that picks cases, their
command line (:func:`grid_parser`) and their result, the grid of rows of the cases asked for (:class:`GridResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.core.cli import CliParser
from sim.core.errors import SpecError

__all__ = ["Case", "GPT", "GridResult", "add_cases_flag", "chosen_cases", "grid_parser"]

#: A GPT of 1.8 billion parameters (32 blocks, hidden 2048, sequence 1024, fp16): 32 blocks split into p·v ≤ 32
#: vstages for every p and v the experiments use, and it fits a V100 at p = 4.
GPT = "gpt:layers=32,hidden=2048"


@dataclass(frozen=True)
class Case:
    """A model on a family of ``{p}x<device>`` topologies; ``exact``: uniform stages on free links, where the closed
    forms hold."""

    key: str
    model: str
    device: str
    exact: bool


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k for k in text.split(",") if k)


def add_cases_flag(parser: CliParser, cases: Sequence[Case]) -> None:
    """``--cases KEY,KEY``, parsed to a tuple of keys (default: every case); :func:`chosen_cases` checks them."""
    keys = ", ".join(c.key for c in cases)
    parser.add_argument("--cases", type=_keys, default=tuple(c.key for c in cases),
                        help=f"comma-separated, of {keys} (default all)")


def chosen_cases(keys: Sequence[str], cases: Sequence[Case]) -> tuple[Case, ...]:
    """The cases ``keys`` names, in the experiment's order.

    Raises:
        SpecError: an unknown key, or none (the message names ``--cases``, the flag that gives the keys).
    """
    known = {c.key: c for c in cases}
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        raise SpecError(f"--cases: unknown {', '.join(map(repr, unknown)) or 'empty list'} (known: "
                        f"{', '.join(known)})")
    return tuple(c for c in cases if c.key in keys)


@dataclass(frozen=True)
class GridResult:
    """The cases asked for and every simulated row of the grid, in its order (case, p, m, then the schedules)."""

    cases: tuple[Case, ...]
    rows: tuple[Any, ...]


def grid_parser(name: str, description: str, cases: Sequence[Case], quick: str) -> CliParser:
    """``python -m experiments.run NAME [--quick] [--cases ...] [--out DIR]``, ``--out`` defaulting to
    ``runs/NAME``; ``quick`` says what ``--quick`` keeps."""
    parser = CliParser(prog=f"python -m experiments.run {name}", description=description)
    parser.add_argument("--out", default=f"runs/{name}", help=f"output directory (default runs/{name})")
    parser.add_argument("--quick", action="store_true", help=quick)
    add_cases_flag(parser, cases)
    return parser
