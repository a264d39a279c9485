"""How a run's failures are recorded and reported: each failing rank's record (:func:`record_failure`), the one that
came first (:func:`order_failures`), the command's one ``error:`` line and ``errors.log`` (:func:`report_failures`),
and a failed attempt's records set aside before a restart (:func:`set_aside`). The launcher
(:mod:`executor.launch`) calls them; a rank calls :func:`record_failure`.

A failing rank records its error (:func:`record_failure`) as JSON in the directory that
:func:`executor.launch.run_ranks` names in ``FAILURE_DIR_ENV``, and exits; the launcher then stops the other workers
with SIGTERM, prints the failure that came first as the command's one ``error:`` line and writes every rank's story,
tracebacks included, to ``errors.log``. Which came first (:func:`order_failures`): a rank that ended without
a record, by a signal or by an exit that skipped the worker's handler (``rank 1 was killed by signal 9 (SIGKILL)``),
failed on its own, since a peer's failure reaches the survivors as an exception, which they record; otherwise the
record with the earliest time (the others are its echoes: a peer's closed connection). Workers that died of the
launcher's SIGTERM are the last resort: they were stopped, not failing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from executor.options import FAILURE_DIR_ENV

__all__ = ["record_failure", "read_failures", "Failure", "describe_exit", "order_failures", "report_failures",
           "set_aside"]


def record_failure(rank: int, message: str, *, op: str | None, status: int, traceback_text: str) -> bool:
    """Leave a failing rank's report where :func:`run_ranks` looks; returns ``False`` when no launcher listens
    (a rank started by a user's ``torchrun``: it should print its own ``error:`` line then).

    Args:
        rank: the failing rank.
        message: what follows ``error: `` on the command's line, e.g. ``rank 1 failed at op 1B1: KeyError: 'w'``.
        op: the op that raised, or ``None``.
        status: the exit status the rank is about to leave with (2: it rejected its input).
        traceback_text: the formatted traceback, for ``errors.log``.
    """
    from sim.core.fileio import write_json_atomic

    directory = os.environ.get(FAILURE_DIR_ENV)
    if not directory:
        return False
    # Atomic: the launcher may read the directory while a peer that is failing in turn gets stopped.
    record = {"rank": rank, "op": op, "message": message, "status": status, "time": time.time(),
              "traceback": traceback_text}
    write_json_atomic(record, Path(directory, f"rank{rank}.json"))
    return True


def read_failures(directory: str | os.PathLike) -> list[dict]:
    """The failure records in ``directory``, oldest first; a record cut short by a stopped rank is skipped."""
    records = []
    for path in Path(directory).glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and {"rank", "message", "time"} <= record.keys():
            records.append(record)
    return sorted(records, key=lambda r: (r["time"], r["rank"]))


@dataclass(frozen=True)
class Failure:
    """How one rank ended, as the launcher reports it.

    Attributes:
        rank: the rank.
        message: the text after ``error:`` and its space.
        status: its exit status (negative: killed by that signal), or the one its record announced.
        time_s: when it recorded the failure (``time.time()``, s); ``None`` when it left no record.
        traceback: the recorded traceback, or ``""``.
    """

    rank: int
    message: str
    status: int
    time_s: float | None = None
    traceback: str = ""


def describe_exit(rank: int, exitcode: int) -> str:
    """``rank R was killed by signal N (NAME)`` for a negative exit code, else ``rank R exited with status N
    without reporting why``."""
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"rank {rank} was killed by signal {-exitcode}{name}"
    return f"rank {rank} exited with status {exitcode} without reporting why"


def order_failures(exit_codes: Mapping[int, int], records: Sequence[Mapping]) -> list[Failure]:
    """Every failure, the one that came first first.

    Args:
        exit_codes: the exit code of each rank that ended badly, by rank (:class:`WorkersFailed`'s ``exit_codes``;
            negative: killed by that signal).
        records: the ranks' failure records (:func:`read_failures`).

    Order: ranks without a record that did not die of SIGTERM, by rank (a process killed by a signal cannot write a
    record, and a peer's failure reaches a survivor as an exception that it does record, so these failed on their
    own); then the records, earliest first (the first is the cause, the later ones mostly its echoes); then ranks
    without a record that died of SIGTERM (the launcher stops the survivors with it: they did not fail).
    """
    recorded = {int(r["rank"]): r for r in records}
    silent = [Failure(rank, describe_exit(rank, code), code) for rank, code in sorted(exit_codes.items())
              if code != 0 and rank not in recorded]
    reported = sorted((Failure(rank, r["message"], int(r.get("status", exit_codes.get(rank, 1))), float(r["time"]),
                               r.get("traceback", "")) for rank, r in recorded.items()),
                      key=lambda f: (f.time_s, f.rank))
    stopped = -int(signal.SIGTERM)
    return ([f for f in silent if f.status != stopped] + reported + [f for f in silent if f.status == stopped])


def report_failures(failures: Sequence[Failure], exit_codes: Mapping[int, int],
                    errors_log: str | os.PathLike | None) -> int:
    """Print the first of ``failures`` (:func:`order_failures`) as the command's one ``error:`` line on stderr and
    write them all, with each rank's exit code, to ``errors_log`` (if given; a log that cannot be written is
    skipped: the line is the report).

    Returns:
        2 when the first failure is a rank's rejection of its input (status 2), else 1.
    """
    if not failures:  # not seen: WorkersFailed names at least one rank; say so rather than nothing
        failures = [Failure(-1, "a worker failed without reporting why", 1)]
    if errors_log is not None:
        lines = []
        for f in failures:
            if f.time_s is None:
                lines.append(f"{f.message} (it left no report)\n")
            else:
                lines.append(f"rank {f.rank} at {f.time_s:.6f}: {f.message}\n{f.traceback}\n")
        ends = ", ".join(f"rank {rank}: " + (f"signal {-code}" if code < 0 else f"status {code}")
                         for rank, code in sorted(exit_codes.items()))
        lines.append(f"exit codes: {ends or 'none reported'}\n")
        try:
            path = Path(errors_log)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(lines))
        except OSError:
            pass  # the log is a courtesy; the error line below is the report
    print(f"error: {failures[0].message}", file=sys.stderr, flush=True)
    return 2 if failures[0].status == 2 else 1


def set_aside(directory: str, attempt: int, ordered: Sequence[Failure], exit_codes: Mapping[int, int]) -> None:
    """Move a failed attempt's records into ``attempt-N/`` with a summary (its first failure and when the launcher
    saw the attempt end), so that the next attempt's failures are its own."""
    from sim.core.fileio import write_json_atomic

    aside = Path(directory, f"attempt-{attempt}")
    aside.mkdir()
    for path in Path(directory).glob("*rank*.json"):
        path.rename(aside / path.name)
    first = ordered[0] if ordered else None
    write_json_atomic({"attempt": attempt, "message": first.message if first else "a worker failed without reporting "
                       "why", "failed_at": first.time_s if first else None, "ended_at": time.time(),
                       "exit_codes": {str(rank): code for rank, code in exit_codes.items()}},
                      aside / "summary.json")
