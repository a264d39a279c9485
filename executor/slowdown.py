"""Emulating a slower device: ``executor.run --slowdown RANK:FACTOR``, so that a plan searched for a mixed cluster can
be run for real on identical CPU ranks (``experiments.run mixed_real``).

A slowed rank stretches each of its compute ops to FACTOR times its measured duration: once the op's work is done
(on CUDA, once the device has caught up), the rank sleeps for (FACTOR − 1) × that duration, and the op's span ends
when the sleep does. The rest of the pipeline sees the op take FACTOR times as long: the sends that carry its result
are posted, and the rank's next op starts, that much later, as on a device FACTOR times slower.

Which ops (:data:`STRETCHED_KINDS`): F, B, I, W, R and OPT_STEP, everything that runs on the device's own compute.
They are the ops whose simulated cost depends on the device (``sim.cost.oracle`` costs each per device, the
optimizer step included), so a stretched run is what a mixed topology with a slower device there predicts. Not
stretched: transfers (SEND/RECV), data-parallel collectives (REDUCE_GRAD, GATHER_PARAMS), and the part of F, B, I
or R spent inside its tensor-parallel collectives (the TP_* span): their time is set by the links and by the peers,
not by how fast this device computes.

Why a sleep and not a busy-wait. The ranks of a CPU run share the host's cores (on a 2-core machine, two ranks
share both). A busy-waiting rank would keep a core to itself for the whole stretch, so the other ranks, which
would have used it, would run slower too: the emulation would slow the whole pipeline rather than one device, and
the run would no longer be the mixed cluster it claims to be. A sleeping rank gives its core back, as a slower
device leaves the others' alone. The cost: a sleep wakes late, by about 0.1 ms on Linux, and by milliseconds when
other programs hold every core, as on the shared 2-core machine where 32 of 36 ops of 5 to 20 ms in one run were
stretched 2.00-2.05 × for FACTOR 2 and the worst 2.78 ×. The span records the real wake-up, so the trace shows the
stretch that happened.

A run with a slowdown says so: ``compare.json`` and ``metrics.json`` carry :func:`slowdown_record` (``null`` for a
run without), and so does ``trace.json``'s metadata when there is one; the printed summary has a line
(:func:`describe_slowdown`) and the Gantt chart's title the factors, so an emulated run is never mistaken for a real
one. The prediction stays the plan's own: the simulator is not told.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from sim.core.errors import SpecError
from sim.ir.ops import COMPUTE_KINDS, OpKind

__all__ = ["STRETCHED_KINDS", "MAX_FACTOR", "parse_slowdown", "stretch", "slowdown_record", "describe_slowdown"]

#: The op kinds a slowed rank stretches (module docstring: why these).
STRETCHED_KINDS = COMPUTE_KINDS  # device compute: sim.ir.ops.OP_SEMANTICS, action COMPUTE
#: The largest factor accepted: a 5 ms op stretched 1000 times already takes 5 s, and a larger factor would leave
#: the peers waiting into the communication timeout (``--timeout``) rather than emulate a device.
MAX_FACTOR = 1000.0
#: How the stretch is done, for the record in compare.json.
METHOD = ("after each op of STRETCHED_KINDS on a slowed rank, the rank sleeps (factor - 1) x the op's measured "
          "duration (less the time inside tensor-parallel collectives); the span ends when it wakes")


def parse_slowdown(values: Sequence[str], world_size: int) -> tuple[tuple[int, float], ...]:
    """``--slowdown`` values (each ``RANK:FACTOR``, or several joined by commas) → ``(rank, factor)`` pairs by rank.

    Args:
        values: the flag's values, in the order given (the flag may be repeated).
        world_size: the plan's process count; ranks are its global ranks, as in ``--inject-failure``.

    Raises:
        SpecError: an entry that is not ``RANK:FACTOR``, a rank outside ``0..world_size - 1`` or given twice, or a
            factor that is not a finite number in ``[1, MAX_FACTOR]``; the message names the entry.
    """
    factors: dict[int, float] = {}
    for value in values:
        for entry in value.split(","):
            rank_text, colon, factor_text = entry.strip().partition(":")
            if not colon or not rank_text.strip().isdigit():
                raise SpecError(f"{{slowdown}} {entry!r}: expected RANK:FACTOR, e.g. 1:2 or 0:1.5,3:2", "slowdown")
            rank = int(rank_text)
            if rank >= world_size:
                raise SpecError(f"{{slowdown}} {entry!r}: the rank must be 0..{world_size - 1} (the plan has "
                                f"{world_size} processes)", "slowdown")
            try:
                factor = float(factor_text)
            except ValueError:
                raise SpecError(f"{{slowdown}} {entry!r}: the factor {factor_text!r} is not a number",
                                "slowdown") from None
            if not (math.isfinite(factor) and 1.0 <= factor <= MAX_FACTOR):
                raise SpecError(f"{{slowdown}} {entry!r}: the factor must be a finite number from 1 (no slowdown; "
                                f"a device cannot be made faster) to {MAX_FACTOR:g}, got {factor_text!r}", "slowdown")
            if rank in factors:
                raise SpecError(f"{{slowdown}} {entry!r}: rank {rank} is given twice", "slowdown")
            factors[rank] = factor
    return tuple(sorted(factors.items()))


def stretch(kind: OpKind, factor: float, start: float, end: float, collective_s: float = 0.0) -> float:
    """Stretch one op that ran from ``start`` to ``end`` (``time.perf_counter``, s) by ``factor``; returns its new end.

    Sleeps ``(factor - 1) × (end - start - collective_s)`` s for an op of :data:`STRETCHED_KINDS` and returns the
    clock when the sleep ended (never earlier than asked: the OS wakes a sleeper late, not early). Any other kind,
    or ``factor == 1``, returns ``end`` at once.

    Args:
        collective_s: seconds the op spent inside tensor-parallel collectives, which are not stretched.
    """
    if factor == 1.0 or kind not in STRETCHED_KINDS:
        return end
    extra = (factor - 1.0) * max(0.0, end - start - collective_s)
    # A sleep, not a busy-wait: the core goes back to the other ranks (module docstring).
    time.sleep(extra)
    return time.perf_counter()


def slowdown_record(slowdown: Sequence[tuple[int, float]]) -> dict[str, Any] | None:
    """What ``compare.json`` and ``metrics.json`` say of a slowdown: ``None`` for a run without one, else the factor
    of each slowed rank (``by_rank``, keys are ranks as strings), the op kinds stretched, the method, and that the
    prediction ignores it."""
    if not slowdown:
        return None
    return {
        "emulated": True,
        "by_rank": {str(rank): factor for rank, factor in slowdown},
        "stretched_kinds": sorted(kind.value for kind in STRETCHED_KINDS),
        "method": METHOD,
        "prediction": "the plan's own, for its planned devices; the simulator is not told of the slowdown",
    }


def describe_slowdown(slowdown: Sequence[tuple[int, float]]) -> str:
    """``rank 1 ×2, rank 3 ×1.5`` (empty for no slowdown)."""
    return ", ".join(f"rank {rank} ×{factor:g}" for rank, factor in slowdown)
