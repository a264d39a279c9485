"""Starting the ranks on this host, tying them to the launcher, and reporting how they ended: :func:`run_ranks`.

``executor.run`` re-enters its own module once per rank through :func:`run_ranks`, the one place that knows how:
PyTorch's elastic launcher (the machinery of ``torchrun --standalone``) with a single-node c10d rendezvous on a free
port, no restarts by the agent (a failed training step is not retried behind the user's back; ``--max-restarts``
starts the whole group afresh instead, :func:`run_ranks`), and a 0.1 s monitor interval so that one failing worker
stops the others promptly.

Lifecycle. torch starts each worker in a POSIX session of its own, so neither a terminal's Ctrl-C nor the death of
the launcher reaches it by itself. A worker therefore starts through this module (``python -m executor.launch
MODULE ARGS``), which before anything else (before torch is even imported):

- asks Linux to SIGKILL the worker when its parent dies (``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_launcher`),
  then checks that its parent is still the launcher that started it (:data:`LAUNCHER_PID_ENV`): a launcher that died
  before the request was made would otherwise go unnoticed. So ``kill -9`` of the launcher takes its workers with it.
  Where there is no ``prctl`` (not Linux) the worker goes without, and outlives a killed launcher;
- restores SIGINT's default action, so that the launcher's stop signal ends the worker at once, even inside a
  blocking gloo call, rather than raising ``KeyboardInterrupt`` whenever the interpreter next gets control.

Until then a SIGINT would find Python's own handler, installed while the interpreter starts: a Ctrl-C in the first
tenths of a second printed "Fatal Python error: init_sys_streams" and a traceback (CI saw it once). So on POSIX the
worker starts through ``sh``, which sets SIGINT to *ignored* and replaces itself with Python (``exec``,
:func:`worker_command`); an ignored SIGINT survives ``exec``, and CPython then leaves it alone instead of installing
its handler. A SIGINT in that window is lost, and the agent SIGKILLs the worker :data:`SHUTDOWN_TIMEOUT_S` later:
silent and certain, if slower.

Ctrl-C or SIGTERM/SIGHUP/SIGQUIT on the launcher: the elastic agent passes the signal on to every worker and
SIGKILLs any still there after :data:`SHUTDOWN_TIMEOUT_S`; :func:`run_ranks` then prints one line, ``error:
interrupted`` for SIGINT (``error: stopped by SIGTERM`` and so on otherwise), and returns 128 + the signal's number
(130 for SIGINT), as a shell reports a command a signal ended.

Scratch files. Everything a run keeps outside ``--out`` (the failure records below, and the per-worker folders
that torch's agent would otherwise make as ``torchelastic_*`` in the system's temporary directory and never remove)
lives in one ``pipedejavu-launch-*`` directory there, removed when the run ends, however it ends: on return, on
Ctrl-C and other stop signals (the agent's exception unwinds through its removal), and when the launcher is killed
with SIGKILL, by a watcher started beside it (:func:`_remove_when_gone`: ``sh`` reading a pipe whose only writer is the
launcher, which sees end-of-file when the launcher is gone, whatever killed it).

Failure report. A failing rank records its error (:func:`record_failure`) as JSON in the directory that
:func:`run_ranks` names in ``FAILURE_DIR_ENV``, and exits; the agent then stops the other workers with SIGTERM.
:func:`run_ranks` prints the failure that came first as the command's one ``error:`` line and writes every rank's
story, tracebacks included, to ``errors.log``. Which came first (:func:`order_failures`): a rank that ended without
a record, by a signal or by an exit that skipped the worker's handler (``rank 1 was killed by signal 9 (SIGKILL)``),
failed on its own, since a peer's failure reaches the survivors as an exception, which they record; otherwise the
record with the earliest time (the others are its echoes: a peer's closed connection). Workers that died of the
agent's SIGTERM are the last resort: they were stopped, not failing.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from executor.options import FAILURE_DIR_ENV
from sim.core.lifetime import die_with_parent

__all__ = ["ATTEMPT_ENV", "run_ranks", "launch_local", "worker_command", "die_with_launcher", "leave_worker",
           "record_failure", "read_failures", "Failure", "order_failures", "report_failures", "describe_exit",
           "LAUNCHER_PID_ENV", "SHUTDOWN_TIMEOUT_S"]

#: Environment variable telling each worker which attempt of the run it belongs to (0 first; ``executor.restart``).
ATTEMPT_ENV = "PIPEDEJAVU_ATTEMPT"

#: Environment variable holding the launcher's process id, so that a worker can tell that its launcher has died.
LAUNCHER_PID_ENV = "PIPEDEJAVU_LAUNCHER_PID"
#: Seconds the agent waits, after passing a stop signal on, before it SIGKILLs a worker that is still there.
SHUTDOWN_TIMEOUT_S = 5
#: The signals torch's agent handles in the launcher (its default ``signals_to_handle``; Windows lacks the last two).
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                      if hasattr(signal, name))


def run_ranks(module: str, argv: Sequence[str], num_ranks: int, *, errors_log: str | os.PathLike | None,
              max_restarts: int = 0) -> int:
    """Run ``python -u -m module argv`` as ``num_ranks`` ranks on this host, wait for them, and report how it went.

    With ``max_restarts`` R the whole group is started again after a rank dies, up to R times, each attempt a fresh
    elastic launch (a new rendezvous, so no store of the failed attempt is reused) whose workers read their attempt
    in :data:`ATTEMPT_ENV` (``executor.restart``); a failed attempt's records are set aside in ``attempt-N/`` of the
    failure directory with a summary, a line says the group restarts, and only a failure of the last attempt is
    reported. Prints nothing when every rank succeeds
    (in the end). Otherwise prints exactly one ``error:`` line on stderr (the failure
    that came first, :func:`order_failures`) and writes every failure to ``errors_log`` (if given; its directory is
    created). Every worker has stopped when it returns.

    Returns:
        The command's exit status: 0; 2 when the first failure is a rank's rejection of its input (its record says
        status 2); 1 for any other failure; 128 + n when the launcher got signal n (130 for Ctrl-C).
    """
    saved_env = {name: os.environ.get(name) for name in (FAILURE_DIR_ENV, LAUNCHER_PID_ENV, ATTEMPT_ENV)}
    saved_handlers = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT)
    watcher: tuple[subprocess.Popen, int] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="pipedejavu-launch-") as scratch:
            watcher = _remove_when_gone(scratch)
            failures, logs = os.path.join(scratch, "failures"), os.path.join(scratch, "torchelastic")
            os.mkdir(failures)
            os.environ[FAILURE_DIR_ENV] = failures
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                for attempt in range(max_restarts + 1):
                    os.environ[ATTEMPT_ENV] = str(attempt)
                    try:
                        launch_local(module, argv, num_ranks, log_dir=logs)
                        break
                    except ChildFailedError as exc:
                        exit_codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
                        ordered = order_failures(exit_codes, read_failures(failures))
                        if attempt == max_restarts:
                            return report_failures(ordered, exit_codes, errors_log)
                        _set_aside(failures, attempt, ordered, exit_codes)
                        print(f"restarting every rank (restart {attempt + 1} of at most {max_restarts}) after: "
                              f"{ordered[0].message if ordered else 'a worker failed without reporting why'}",
                              flush=True)
            finally:
                # The agent leaves its handlers installed; a later signal would raise its exception anywhere.
                for sig, handler in saved_handlers.items():
                    signal.signal(sig, handler)
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return 0
    except SignalException as exc:  # the agent has passed it on to the workers and stopped them
        return _stopped(exc.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the agent's handlers were installed, or after they were restored
        return _stopped(signal.SIGINT)
    finally:
        if watcher is not None:  # the directory is gone by now: let the watcher see end-of-file and leave
            process, pipe = watcher
            os.close(pipe)
            process.wait()


def _remove_when_gone(directory: str) -> tuple[subprocess.Popen, int] | None:
    """Start a watcher that removes ``directory`` once this process has ended, even by SIGKILL; returns it and the
    write end of its pipe (close it when done: the watcher then removes the directory, if still there, and exits).

    The watcher is ``sh`` reading the pipe to its end: only this process holds the write end (``os.pipe`` makes it
    non-inheritable, so neither the watcher nor the workers get it), so end-of-file means this process is gone or
    done. It runs in a session of its own, so a Ctrl-C at the terminal, or a kill of the launcher's process group,
    leaves it to do its work. ``None`` where there is no ``sh`` (the directory is then removed on every end but
    SIGKILL).
    """
    shell = shutil.which("sh") if os.name == "posix" else None
    if shell is None:
        return None
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen([shell, "-c", 'cat >/dev/null; rm -rf -- "$0"', directory], stdin=read_end,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return process, write_end


def _set_aside(directory: str, attempt: int, ordered: Sequence[Failure], exit_codes: Mapping[int, int]) -> None:
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


def launch_local(module: str, argv: Sequence[str], num_ranks: int, *, log_dir: str | os.PathLike) -> None:
    """Start ``num_ranks`` workers ``python -u -m module argv`` (through this module's worker entry) and wait.

    The primitive under :func:`run_ranks`, which adds the failure directory and the report. ``log_dir`` is where
    torch's agent keeps its per-worker folders (created if missing; the caller removes it): without one the agent
    makes a ``torchelastic_*`` folder in the system's temporary directory on every launch and never removes it.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed; every other worker has
            been stopped by then.
        torch.distributed.elastic.multiprocessing.SignalException: the launcher got a stop signal; the workers got
            it too and have stopped.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchelastic logs every worker failure with a long traceback, and every stop signal; the one report of
    # run_ranks says it better. Its modules set their loggers' own levels, so the parent's level alone is not enough.
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=num_ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          shutdown_timeout=SHUTDOWN_TIMEOUT_S, logs_specs=DefaultLogsSpecs(log_dir=os.fspath(log_dir)))
    entrypoint, args = worker_command(module, argv)
    elastic_launch(config, entrypoint)(*args)


def worker_command(module: str, argv: Sequence[str]) -> tuple[str, list[str]]:
    """The program and arguments that start one worker: ``python -u -m executor.launch module argv`` (through
    :func:`_worker_entry`), from ``sh`` with SIGINT ignored where there is one (see the module docstring).

    torch's agent runs ``string.Template.safe_substitute`` over every argument; the script's ``$0`` and ``$@`` are not
    identifiers, so they pass unchanged.
    """
    python = [sys.executable, "-u", "-m", "executor.launch", module, *argv]
    shell = shutil.which("sh") if os.name == "posix" else None
    if shell is None:
        return python[0], python[1:]
    return shell, ["-c", 'trap "" INT; exec "$0" "$@"', *python]


def die_with_launcher() -> bool:
    """Have the kernel SIGKILL this worker when its launcher dies; returns whether that is armed
    (:func:`sim.core.lifetime.die_with_parent`, checked against the launcher named by :data:`LAUNCHER_PID_ENV`).

    Linux only; elsewhere it returns ``False`` and the worker goes on without. torch's agent starts workers from the
    launcher's main thread, which lives as long as the launcher.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    return die_with_parent(int(launcher) if launcher.isdigit() else None)


def leave_worker(status: int) -> None:
    """End a worker process at once with ``status``, after flushing its output; never returns.

    A worker that has finished (process groups destroyed, outputs written atomically) skips the interpreter's
    finalization on purpose. There, gloo's C++ threads may still drop the last reference to a tensor; that needs the
    GIL, which a finalizing CPython refuses by ending the thread, and the forced unwind through a ``noexcept`` frame
    aborts the process ("terminate called without an active exception", SIGABRT). We saw it in about 1 in 25
    two-rank CSP runs on a loaded 2-core machine, always with no Python frame on the stack; PyTorch discusses the
    same race in its pull request 179291 (an atexit hook destroying process groups, abandoned).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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
        exit_codes: the exit code of each rank that ended badly, by rank (torch's ``ChildFailedError.failures``;
            negative: killed by that signal).
        records: the ranks' failure records (:func:`read_failures`).

    Order: ranks without a record that did not die of SIGTERM, by rank (a process killed by a signal cannot write a
    record, and a peer's failure reaches a survivor as an exception that it does record, so these failed on their
    own); then the records, earliest first (the first is the cause, the later ones mostly its echoes); then ranks
    without a record that died of SIGTERM (the agent stops the survivors with it: they did not fail).
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
    if not failures:  # not seen: torch raises ChildFailedError for a failed rank; say so rather than nothing
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


def _stopped(sig: signal.Signals) -> int:
    """Report that the launcher was stopped by ``sig``; the shell's status for it (128 + its number)."""
    print("error: interrupted" if sig == signal.SIGINT else f"error: stopped by {sig.name}", file=sys.stderr,
          flush=True)
    return 128 + int(sig)


def _worker_entry(args: list[str]) -> None:
    """A worker's first steps (see the module docstring), then ``python -m args[0] args[1:]`` in this process."""
    die_with_launcher()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not args:
        raise SystemExit("usage: python -m executor.launch MODULE [ARG ...] (a worker started by run_ranks)")
    sys.argv[1:] = args[1:]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _worker_entry(sys.argv[1:])
