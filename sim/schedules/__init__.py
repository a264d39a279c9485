"""Schedule generators: pure functions from (stages, microbatches, ...) to L0 compute-only programs.

The registry :data:`SCHEDULES` maps each ``--schedule`` name to its generator and its weight policy; the CLI takes its
``choices`` from it, so a schedule added here is available everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.errors import SpecError
from sim.ir import Op
from sim.schedules.gpipe import gpipe
from sim.schedules.one_f_one_b import one_f_one_b

__all__ = ["ScheduleEntry", "SCHEDULES", "get_schedule"]

Programs = tuple[tuple[Op, ...], ...]


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule: its name, what it is, how weights are updated, and the generator."""

    name: str
    description: str
    weight_policy: str
    build: Callable[[int, int], Programs]


SCHEDULES: dict[str, ScheduleEntry] = {
    entry.name: entry
    for entry in (
        ScheduleEntry("gpipe", "GPipe fill-drain: all forwards, then all backwards, then a flush", "flush", gpipe),
        ScheduleEntry(
            "1f1b", "1F1B / PipeDream-Flush (Megatron order): p−r−1 warm-up forwards, then one F one B", "flush",
            one_f_one_b,
        ),
    )
}


def get_schedule(name: str) -> ScheduleEntry:
    """The registry entry for ``name``; SpecError naming it and the known schedules otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise SpecError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})") from None
