"""How busy other processes kept this host's cores while a measurement ran (Linux ``/proc/stat``).

A fidelity measurement on a shared machine is only as good as the machine was quiet: on the 2-core development box
another process using one core makes every op of a 2-rank run 30–40 % slower, which no profile taken at another time
can predict. The 1-minute load average cannot tell, since it counts the measurement's own processes (two busy ranks
read as a load of about 2) and lags by a minute. This module counts instead, over the measurement's own interval,
the CPU time of the whole host minus that of the measurement's processes (this process and its waited-for
descendants, :func:`resource.getrusage`): what is left was used by someone else.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuSnapshot", "snapshot", "foreign_cores", "wait_until_idle", "PROC_STAT"]

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuSnapshot:
    """A point in time for :func:`foreign_cores`.

    Attributes:
        wall_s: ``time.monotonic()`` in s.
        host_busy_s: CPU time the whole host has spent busy since boot (all cores, user + nice + system + irq +
            softirq), in s; ``None`` where ``/proc/stat`` is not readable.
        own_s: user + system CPU time of this process and its terminated, waited-for descendants, in s.
    """

    wall_s: float
    host_busy_s: float | None
    own_s: float


def _host_busy_s(stat: Path) -> float | None:
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu" or len(first) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in first[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def snapshot(stat: Path = PROC_STAT) -> CpuSnapshot:
    """The host's and this process tree's CPU time now (``stat``: the ``/proc/stat`` to read, for tests)."""
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    own = mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime
    return CpuSnapshot(time.monotonic(), _host_busy_s(stat), own)


def foreign_cores(before: CpuSnapshot, after: CpuSnapshot) -> float | None:
    """Average number of cores that other processes kept busy between two snapshots (>= 0), or ``None`` when the
    host's CPU time is unknown or no time passed.

    Exact when the measured processes have all ended and been waited for by ``after`` (``subprocess.run`` does);
    the host's counters tick at ``SC_CLK_TCK`` (10 ms), so intervals of a few seconds or more are meaningful.
    """
    if before.host_busy_s is None or after.host_busy_s is None or after.wall_s <= before.wall_s:
        return None
    others = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / (after.wall_s - before.wall_s))


def wait_until_idle(limit_s: float, threshold_cores: float, *, probe_s: float = 2.0,
                    stat: Path = PROC_STAT) -> float | None:
    """Wait until other processes use at most ``threshold_cores`` over a ``probe_s``-second probe, for at most
    ``limit_s`` s in all; the last probe's :func:`foreign_cores` (``None`` where the host's CPU time is unknown, at
    once). Nothing of ours runs during a probe, so all the busy time it sees is someone else's.

    Raises:
        ValueError: ``limit_s`` < 0 or ``probe_s`` <= 0.
    """
    if limit_s < 0 or probe_s <= 0:
        raise ValueError(f"need limit_s >= 0 and probe_s > 0, got {limit_s} and {probe_s}")
    deadline = time.monotonic() + limit_s
    while True:
        before = snapshot(stat)
        if before.host_busy_s is None:
            return None
        time.sleep(probe_s)
        cores = foreign_cores(before, snapshot(stat))
        if cores is None or cores <= threshold_cores or time.monotonic() >= deadline:
            return cores
