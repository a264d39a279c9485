"""One experiment run by the package's convention (``experiments/__init__.py``): parse its flags, run it, report,
write its files. ``experiments.run`` prints what this emits; ``experiments.results`` gathers it into a page."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from sim.core.fileio import write_bytes_atomic, write_text_atomic

__all__ = ["Ran", "load", "execute", "wrote_line", "write_csv_png"]


@dataclass(frozen=True)
class Ran:
    """One experiment's run: its module's ``Result``, and the files ``write`` wrote (none without ``--out``)."""

    result: object
    files: tuple[Path, ...]


def load(name: str) -> ModuleType:
    """The module of experiment ``name``, imported now (some import torch, which the others should not pay for)."""
    return importlib.import_module(f"experiments.{name}")


def write_csv_png(out: Path, name: str, table: str, png: bytes) -> list[Path]:
    """The write step most experiments have: ``name.csv`` (``table``) and ``name.png`` in ``out``, in that order;
    the paths written."""
    write_text_atomic(table, out / f"{name}.csv")
    write_bytes_atomic(out / f"{name}.png", png)
    return [out / f"{name}.csv", out / f"{name}.png"]


def wrote_line(module: ModuleType, out: Path, files: Sequence[Path]) -> str:
    """``wrote OUT/{a, b}`` (``wrote OUT/a`` for one file), names relative to ``out``; or the module's own line."""
    own = getattr(module, "wrote", None)
    if own is not None:
        return own(out, files)
    names = [Path(f).relative_to(out).as_posix() for f in files]
    return f"wrote {out}/{names[0]}" if len(names) == 1 else f"wrote {out}/{{{', '.join(names)}}}"


def execute(module: ModuleType, argv: list[str], emit: Callable[[str], None],
            progress: Callable[[str], None] | None = None) -> Ran:
    """Parse ``argv`` with the module's parser, ``run`` it, emit its report, ``write`` its files into ``--out`` (made
    if missing) and emit the ``wrote`` line.

    Args:
        module: an experiment module that follows the convention.
        argv: its flags, ``--out`` included where it has one (passed to ``run`` as ``out`` too where ``run`` takes
            it: an experiment whose computation leaves files of its own, such as real runs' directories).
        emit: given each block of text the command prints (the report, then the ``wrote`` line).
        progress: given progress lines, for an experiment whose ``run`` takes ``progress``.

    Raises:
        SpecError: bad flags or values, from the parser or ``run``.
    """
    options = dict(vars(module.parser().parse_args(argv)))
    out = options.pop("out", None)
    target = None if out is None else Path(out)
    takes = inspect.signature(module.run).parameters
    if progress is not None and "progress" in takes:
        options["progress"] = progress
    if target is not None and "out" in takes:  # its computation writes files of its own there (real runs)
        target.mkdir(parents=True, exist_ok=True)
        options["out"] = target
    result = module.run(**options)
    emit(module.report(result))
    files: list[Path] = []
    if target is not None and hasattr(module, "write"):
        target.mkdir(parents=True, exist_ok=True)
        files = module.write(result, target)
        emit(wrote_line(module, target, files))
    return Ran(result, tuple(files))
