"""Crash and come back: a run whose rank dies restarts on its own and continues from its newest checkpoint
(``executor.run --max-restarts R``), and the injected crash that tests it (``--fail RANK@ITERATION``).

The launcher (``executor.launch.run_ranks``) starts the ranks; when one dies, it stops the others, and with
``--max-restarts`` R it starts the whole group again, up to R times, each attempt a fresh launch (a new rendezvous
file: nothing of the failed attempt's store is reused) whose workers
see their attempt in ``PIPEDEJAVU_ATTEMPT``. A restarted worker (:func:`after_restart`) finds the newest complete
checkpoint in ``--checkpoint-dir`` (``executor.checkpoint``; none: the run's own start) and continues from it to the
run's end, so the run ends with the parameters of one that never failed. Iterations before the original warm-up's
end stay unmeasured.

What the output says (``metrics.json``'s ``restarts``, rank 0's summary): how many restarts, the failures the
earlier attempts left on record (a rank that raised records its error; ``--fail`` records its kill, iteration and
time before it dies; a rank killed from outside leaves none), the iteration the run resumed after, the iterations
computed again, and the restart's cost: from the failure until training is back at speed (detection, stopping and
starting the group, rendezvous, building the model, reading the checkpoint, the new processes' slower first
iteration; :func:`restart_record`), and the run's wall time. The launcher sets each
failed attempt's records aside (``attempt-N/`` of its failure directory, with a summary), so that a later failure is
reported as its own.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from executor.options import FAILURE_DIR_ENV, RunOptions
from sim.core.errors import SpecError

__all__ = ["restart_count", "after_restart", "die_if_failing", "note_start", "restart_record"]


def restart_count() -> int:
    """This worker's attempt: 0 for the first, k after the k-th restart (``executor.launch.ATTEMPT_ENV``)."""
    from executor.launch import ATTEMPT_ENV

    return int(os.environ.get(ATTEMPT_ENV, "0") or 0)


def after_restart(options: RunOptions, attempt: int) -> RunOptions:
    """The options of attempt ``attempt``: unchanged for the first; afterwards resuming from the newest complete
    checkpoint in ``--checkpoint-dir`` (else where the run itself started), its warm-up and measured iterations what
    is left of the run's.

    Raises:
        SpecError: the run had already ended at its newest checkpoint.
    """
    if attempt == 0:
        return options
    from executor.checkpoint import latest

    end = options.first_iteration + options.warmup + options.iterations
    warmup_end = options.first_iteration + options.warmup
    checkpoint = latest(options.checkpoint_dir) if options.checkpoint_dir and Path(options.checkpoint_dir).is_dir() \
        else None
    first, resume_from = ((checkpoint.iteration, str(checkpoint.path)) if checkpoint is not None
                          else (options.first_iteration, options.resume_from))
    if first >= end:
        raise SpecError(f"restart {attempt}: the newest checkpoint, after iteration {first}, is the run's end ({end})")
    return replace(options, first_iteration=first, resume_from=resume_from, warmup=max(0, warmup_end - first),
                   iterations=end - max(first, warmup_end), attempt=attempt)


def die_if_failing(options: RunOptions, rank: int, iteration: int, unit: str = "iteration") -> None:
    """``--fail RANK@ITERATION``: on the first attempt only, rank RANK records its death and kills itself (SIGKILL)
    before running iteration ITERATION (0-based; ``unit``: what the run's iterations are, a csp run's subnets), as a
    crashed host would."""
    if options.fail != (rank, iteration) or options.attempt != 0:
        return
    from sim.core.fileio import write_json_atomic

    directory = os.environ.get(FAILURE_DIR_ENV)
    if directory:
        write_json_atomic({"rank": rank, "iteration": iteration, "time": time.time(), "signal": "SIGKILL",
                           "message": f"rank {rank} was killed (SIGKILL, --fail {rank}@{iteration}) before {unit} "
                                      f"{iteration}"}, Path(directory, f"killed-rank{rank}.json"))
    os.kill(os.getpid(), signal.SIGKILL)


def note_start(options: RunOptions, rank: int, first: tuple[float, float]) -> None:
    """Rank 0 of the first attempt notes when its first iteration began and ended (``time.time()``), for a
    restarted run's wall time."""
    directory = os.environ.get(FAILURE_DIR_ENV)
    if rank != 0 or options.attempt != 0 or not directory:
        return
    from sim.core.fileio import write_json_atomic

    write_json_atomic({"first_start": first[0], "first_end": first[1]}, Path(directory, "started.json"))


def restart_record(options: RunOptions, iterations: list[tuple[float, float]], finished_at: float,
                   checkpoint_s: list[float]) -> dict[str, Any] | None:
    """On rank 0 of a restarted attempt: what ``metrics.json`` says of the restarts (module docstring), from the
    summaries and records the launcher set aside; ``None`` on the first attempt.

    ``iterations`` are the attempt's iterations' (start, end), ``finished_at`` when its last checkpoint ended
    (``time.time()``), ``checkpoint_s`` what each of its checkpoints took (s). A new process's first iteration is
    slower than the rest (start-up, not training), so the restart is counted from the failure until the first
    iteration after it has ended, less the attempt's median iteration (the time until training is back at speed),
    and the run's wall time from its first iteration as if that had taken the median too.
    """
    if options.attempt == 0:
        return None
    directory = os.environ.get(FAILURE_DIR_ENV)
    failures: list[dict[str, Any]] = []
    for attempt in range(options.attempt):
        aside = Path(directory, f"attempt-{attempt}") if directory else None
        if aside is None or not aside.is_dir():
            continue
        summary = _json(aside / "summary.json") or {}
        killed = [record for path in sorted(aside.glob("killed-rank*.json")) if (record := _json(path))]
        failed_at = next((record["time"] for record in killed), summary.get("failed_at")) or summary.get("ended_at")
        failures.append({"attempt": attempt, "message": killed[0]["message"] if killed else summary.get("message"),
                         "time": failed_at, "iteration": next((record["iteration"] for record in killed), None)})
    last = failures[-1] if failures else {}
    durations = sorted(end - start for start, end in iterations)
    median = durations[(len(durations) - 1) // 2] if durations else 0.0
    started = _json(Path(directory, "started.json")) if directory else None
    return {
        "count": options.attempt,
        "resumed_after_iteration": options.first_iteration,
        "failures": failures,
        "restart_s": iterations[0][1] - median - last["time"] if last.get("time") and iterations else None,
        "iterations_computed_again": (last["iteration"] - options.first_iteration
                                      if last.get("iteration") is not None else None),
        "median_iteration_s": median,
        "checkpoint_mean_s": sum(checkpoint_s) / len(checkpoint_s) if checkpoint_s else None,
        "run_wall_s": finished_at - (started["first_end"] - median) if started else None,
    }


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
