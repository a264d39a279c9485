"""Starting the ranks on this host, tying them to the launcher, and reporting how they ended: :func:`run_ranks`.

``executor.run`` re-enters its own module once per rank through :func:`run_ranks`, the one place that knows how. It
is this project's own small supervisor (the part of ``torchrun --standalone`` that one host needs): it starts the
workers, gives each its ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` and a rendezvous file
(:func:`join_world`: a ``FileStore`` in the run's scratch directory, so that no port is picked and raced for), polls
them every :data:`MONITOR_INTERVAL_S`, and stops the others as soon as one fails (a failed training step is not
retried behind the user's back; ``--max-restarts`` starts the whole group afresh instead, :func:`run_ranks`). A
user's own ``torchrun`` still runs the same worker code across hosts (``env://``).

How a worker starts (``start``). ``"fork"``, the default on the CPU: the launcher imports the rank's code once
(``preload``: torch and the executor, about 1.7 s of CPU per process) and forks each worker from itself, so that a
2-rank run imports torch once rather than three times. A fork is only safe from a process with one thread, before
it has run a torch kernel (the intra-op pool) or touched CUDA: the launcher has done neither, and where it has
other threads (it was called inside a larger program) it starts workers the other way. ``"exec"``: each worker is a
fresh interpreter (``python -u -m executor.launch MODULE ARGS``, :func:`worker_command`), which the NCCL backend
needs, since a CUDA driver initialised in the launcher (``torch.cuda.is_available()``) cannot be used in a fork.

Lifecycle. Each worker leads a POSIX session of its own, so neither a terminal's Ctrl-C nor the death of the
launcher reaches it by itself. Before anything else a worker:

- asks Linux to SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_launcher`), then
  checks that its parent is still the launcher that started it (:data:`LAUNCHER_PID_ENV`): a launcher that died
  before the request was made would otherwise go unnoticed. So ``kill -9`` of the launcher takes its workers with
  it. Where there is no ``prctl`` (not Linux) the worker goes without, and outlives a killed launcher;
- gives SIGINT (and the other stop signals) their default action, so that the launcher's stop signal ends the
  worker at once, even inside a blocking gloo call, rather than raising ``KeyboardInterrupt`` whenever the
  interpreter next gets control.

A forked worker is born with the stop signals blocked (the launcher blocks them around ``fork``), restores their
default actions and only then unblocks them: a signal sent in between ends it by the default action, never by the
launcher's Python handler running in the child. An exec'd worker would otherwise meet Python's own handler,
installed while the interpreter starts: a Ctrl-C in the first tenths of a second printed "Fatal Python error:
init_sys_streams" and a traceback (CI saw it once). So on POSIX it starts through ``sh``, which sets SIGINT to
*ignored* and replaces itself with Python (``exec``, :func:`worker_command`); an ignored SIGINT survives ``exec``,
and CPython then leaves it alone instead of installing its handler. A SIGINT in that window is lost, and the
launcher SIGKILLs the worker :data:`SHUTDOWN_TIMEOUT_S` later: silent and certain, if slower.

Ctrl-C or SIGTERM/SIGHUP/SIGQUIT on the launcher: it passes the signal on to every worker and SIGKILLs any still
there after :data:`SHUTDOWN_TIMEOUT_S`; :func:`run_ranks` then prints one line, ``error: interrupted`` for SIGINT
(``error: stopped by SIGTERM`` and so on otherwise), and returns 128 + the signal's number (130 for SIGINT), as a
shell reports a command a signal ended.

Scratch files. Everything a run keeps outside ``--out`` (the failure records and the rendezvous files) lives
in one ``pipedejavu-launch-*`` directory in the system's temporary directory, removed when the run ends, however
it ends: on return, on Ctrl-C and other stop signals, and when the launcher is killed with SIGKILL, by a watcher
started beside it (:func:`_remove_when_gone`: ``sh`` reading a pipe whose only writer is the launcher, which sees
end-of-file when the launcher is gone, whatever killed it; a forked worker closes its inherited copy first).

Failure report. A failing rank records its error, and the launcher prints the one that came first and logs the
rest: :mod:`executor.failures`.
"""

from __future__ import annotations

import importlib
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Literal

from executor.failures import order_failures, read_failures, report_failures, set_aside
from executor.options import FAILURE_DIR_ENV
from sim.core.lifetime import die_with_parent

__all__ = ["ATTEMPT_ENV", "run_ranks", "launch_local", "worker_command", "die_with_launcher", "leave_worker",
           "join_world", "WorkersFailed", "LauncherStopped", "StartMethod", "LAUNCHER_PID_ENV", "RENDEZVOUS_ENV",
           "SHUTDOWN_TIMEOUT_S", "MONITOR_INTERVAL_S"]

#: Environment variable telling each worker which attempt of the run it belongs to (0 first; ``executor.restart``).
ATTEMPT_ENV = "PIPEDEJAVU_ATTEMPT"

#: Environment variable holding the launcher's process id, so that a worker can tell that its launcher has died.
LAUNCHER_PID_ENV = "PIPEDEJAVU_LAUNCHER_PID"
#: Environment variable naming the file of an attempt's rendezvous (a ``FileStore``; absent under ``torchrun``).
RENDEZVOUS_ENV = "PIPEDEJAVU_RENDEZVOUS"
#: Seconds the launcher waits, after passing a stop signal on, before it SIGKILLs a worker that is still there.
SHUTDOWN_TIMEOUT_S = 5
#: Seconds between two looks at the workers: how soon a failure or a finished run is seen.
MONITOR_INTERVAL_S = 0.05
#: The signals the launcher passes on to its workers (Windows lacks the last two).
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                      if hasattr(signal, name))

#: How a worker starts: forked from the launcher, which has imported its code (``"fork"``), or as a fresh
#: interpreter (``"exec"``); see the module docstring.
StartMethod = Literal["fork", "exec"]


class WorkersFailed(Exception):
    """A worker ended badly; every other worker has been stopped.

    Attributes:
        exit_codes: how each rank that ended badly ended, by rank (negative: killed by that signal), those the
            launcher stopped with SIGTERM after the first failure included; a rank that had to be SIGKILLed after
            :data:`SHUTDOWN_TIMEOUT_S` is left out (it was stopped, and its signal would read as its own failure).
    """

    def __init__(self, exit_codes: Mapping[int, int]):
        super().__init__(f"workers failed: {dict(exit_codes)}")
        self.exit_codes = dict(exit_codes)


class LauncherStopped(Exception):
    """The launcher got a stop signal (``signal``); its workers got it too and have ended."""

    def __init__(self, sig: signal.Signals):
        super().__init__(f"stopped by {sig.name}")
        self.signal = sig


def run_ranks(module: str, argv: Sequence[str], num_ranks: int, *, errors_log: str | os.PathLike | None,
              max_restarts: int = 0, start: StartMethod = "fork", preload: Sequence[str] = ()) -> int:
    """Run ``python -u -m module argv`` as ``num_ranks`` ranks on this host, wait for them, and report how it went.

    With ``max_restarts`` R the whole group is started again after a rank dies, up to R times, each attempt a fresh
    launch (a new rendezvous file, so no store of the failed attempt is reused) whose workers read their attempt
    in :data:`ATTEMPT_ENV` (``executor.restart``); a failed attempt's records are set aside in ``attempt-N/`` of the
    failure directory with a summary, a line says the group restarts, and only a failure of the last attempt is
    reported. Prints nothing when every rank succeeds (in the end). Otherwise prints exactly one ``error:`` line on
    stderr (the failure that came first, :func:`order_failures`) and writes every failure to ``errors_log`` (if
    given; its directory is created). Every worker has stopped when it returns.

    Args:
        start: how workers start (:data:`StartMethod`); ``"fork"`` falls back to ``"exec"`` where forking is not
            safe (:func:`launch_local`).
        preload: modules imported here before workers are forked, so that no worker imports them again (the
            worker's own code; ignored when workers are exec'd).

    Returns:
        The command's exit status: 0; 2 when the first failure is a rank's rejection of its input (its record says
        status 2); 1 for any other failure; 128 + n when the launcher got signal n (130 for Ctrl-C).
    """
    saved_env = {name: os.environ.get(name) for name in (FAILURE_DIR_ENV, LAUNCHER_PID_ENV, ATTEMPT_ENV)}
    watcher: tuple[subprocess.Popen, int] | None = None
    try:
        if start == "fork":
            for name in preload:
                importlib.import_module(name)
        with tempfile.TemporaryDirectory(prefix="pipedejavu-launch-") as scratch:
            watcher = _remove_when_gone(scratch)
            failures = os.path.join(scratch, "failures")
            os.mkdir(failures)
            os.environ[FAILURE_DIR_ENV] = failures
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                for attempt in range(max_restarts + 1):
                    os.environ[ATTEMPT_ENV] = str(attempt)
                    try:
                        launch_local(module, argv, num_ranks, rendezvous=os.path.join(scratch, f"rendezvous-{attempt}"),
                                     start=start, close_in_workers=() if watcher is None else (watcher[1],))
                        break
                    except WorkersFailed as exc:
                        ordered = order_failures(exc.exit_codes, read_failures(failures))
                        if attempt == max_restarts:
                            return report_failures(ordered, exc.exit_codes, errors_log)
                        set_aside(failures, attempt, ordered, exc.exit_codes)
                        print(f"restarting every rank (restart {attempt + 1} of at most {max_restarts}) after: "
                              f"{ordered[0].message if ordered else 'a worker failed without reporting why'}",
                              flush=True)
            finally:
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return 0
    except LauncherStopped as exc:  # passed on to the workers, which have ended
        return _stopped(exc.signal)
    except KeyboardInterrupt:  # Ctrl-C before the launcher's handlers were installed, or after they were restored
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


def launch_local(module: str, argv: Sequence[str], num_ranks: int, *, rendezvous: str | os.PathLike,
                 start: StartMethod = "fork", close_in_workers: Sequence[int] = ()) -> None:
    """Start ``num_ranks`` workers running ``python -m module argv`` on this host and wait for them all.

    The primitive under :func:`run_ranks`, which adds the failure directory, restarts and the report. Worker r gets
    ``RANK`` = ``LOCAL_RANK`` = r, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = ``num_ranks`` and :data:`RENDEZVOUS_ENV` =
    ``rendezvous`` (a path that must not exist yet; :func:`join_world`). Call it from the main thread: it installs
    handlers for the stop signals (restored on return) to pass them on.

    Args:
        start: ``"fork"`` forks each worker from this process (the caller has imported the worker's code); it falls
            back to ``"exec"`` where this process runs other threads, whose locks a fork could copy held.
        close_in_workers: file descriptors a forked worker closes first (the scratch watcher's pipe: see the module
            docstring); an exec'd worker inherits none.

    Raises:
        WorkersFailed: a worker ended badly; every other worker has been stopped by then.
        LauncherStopped: this process got a stop signal; every worker got it too and has ended.
    """
    if start == "fork" and not _can_fork():
        start = "exec"
    received: list[int] = []
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in _STOP_SIGNALS} if in_main_thread else {}
    workers: dict[int, _Worker] = {}
    try:
        for rank in range(num_ranks):
            if received:
                break
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_ranks),
                   "LOCAL_WORLD_SIZE": str(num_ranks), RENDEZVOUS_ENV: os.fspath(rendezvous)}
            workers[rank] = (_fork_worker(module, argv, env, close_in_workers) if start == "fork"
                             else _exec_worker(module, argv, env))
        _watch(workers, received)
    finally:
        # Whatever ended the watch (a bug in it included), no worker outlives this call.
        for worker in workers.values():
            if worker.poll() is None:
                worker.send(signal.SIGKILL)
                worker.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _can_fork() -> bool:
    """Whether a worker may be forked from this process: POSIX, and no thread but this one (the main thread)."""
    return (hasattr(os, "fork") and threading.active_count() == 1
            and threading.current_thread() is threading.main_thread())


class _Worker:
    """One started worker: its process id (it leads a session of its own) and how it ended, once it has."""

    def __init__(self, pid: int, process: subprocess.Popen | None = None):
        self.pid = pid
        self._process = process  # an exec'd worker's Popen, which must do the reaping; None for a forked one
        self._exit_code: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once the worker has ended, else ``None``; never blocks."""
        if self._exit_code is None:
            if self._process is not None:
                self._exit_code = self._process.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._exit_code = os.waitstatus_to_exitcode(status)
        return self._exit_code

    def wait(self) -> int:
        """Block until the worker has ended; its exit code."""
        if self._exit_code is None:
            if self._process is not None:
                self._exit_code = self._process.wait()
            else:
                self._exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self._exit_code

    def send(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (its session), unless it has ended."""
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _watch(workers: Mapping[int, _Worker], received: list[int]) -> None:
    """Poll the workers until every one has ended well, one has ended badly, or a stop signal came (``received``,
    filled by the handlers); stop the others in the last two cases and raise."""
    ended: dict[int, int] = {}
    while True:
        if received:
            sig = signal.Signals(received[0])
            _stop(workers, ended, sig)
            raise LauncherStopped(sig)
        for rank, worker in workers.items():
            if rank not in ended and (code := worker.poll()) is not None:
                ended[rank] = code
        if any(code != 0 for code in ended.values()):
            killed = _stop(workers, ended, signal.SIGTERM)
            raise WorkersFailed({rank: code for rank, code in ended.items() if code != 0 and rank not in killed})
        if len(ended) == len(workers):
            return
        time.sleep(MONITOR_INTERVAL_S)


def _stop(workers: Mapping[int, _Worker], ended: dict[int, int], sig: int) -> set[int]:
    """Send ``sig`` to every worker still running, wait up to :data:`SHUTDOWN_TIMEOUT_S` for them, SIGKILL those
    still there; records every exit code in ``ended`` and returns the ranks that had to be SIGKILLed."""
    running = {rank: worker for rank, worker in workers.items() if rank not in ended}
    for worker in running.values():
        worker.send(sig)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    while running and time.monotonic() < deadline:
        for rank, worker in list(running.items()):
            if (code := worker.poll()) is not None:
                ended[rank] = code
                del running[rank]
        if running:
            time.sleep(MONITOR_INTERVAL_S)
    for rank, worker in running.items():
        worker.send(signal.SIGKILL)
        ended[rank] = worker.wait()
    return set(running)


def _fork_worker(module: str, argv: Sequence[str], env: Mapping[str, str], close_fds: Sequence[int]) -> _Worker:
    """Fork a worker that runs ``module`` as ``__main__`` with ``argv`` (:func:`_forked_worker_main`)."""
    sys.stdout.flush()  # or what is buffered here would be written again by the worker
    sys.stderr.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # the worker unblocks them once they are its own
    try:
        pid = os.fork()
        if pid == 0:
            _forked_worker_main(module, argv, env, close_fds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return _Worker(pid)


def _forked_worker_main(module: str, argv: Sequence[str], env: Mapping[str, str], close_fds: Sequence[int]) -> None:
    """A forked worker's whole life: its first steps (see the module docstring), ``python -m module argv`` in this
    process, and the exit with its status; never returns into the launcher's code that forked it."""
    status = 1
    try:
        os.setsid()
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        os.environ.update(env)
        die_with_launcher()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        for stream in (sys.stdout, sys.stderr):  # as ``python -u``: a worker's lines reach the terminal as printed
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        sys.argv[1:] = list(argv)
        # As ``python -m`` finds it: not imported yet. A launcher that imported the module by name (a program calling
        # executor.run.main) would otherwise have runpy warn in every rank that it runs a module already imported.
        sys.modules.pop(module, None)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exc:
            status = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - whatever it is, it ends this worker, never the launcher's stack
        traceback.print_exc()
        status = 1
    finally:
        leave_worker(status)


def _exit_status(code: object) -> int:
    """The status a ``SystemExit(code)`` gives, as the interpreter computes it (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exec_worker(module: str, argv: Sequence[str], env: Mapping[str, str]) -> _Worker:
    """Start a worker as a fresh interpreter in a session of its own (:func:`worker_command`)."""
    program, args = worker_command(module, argv)
    process = subprocess.Popen([program, *args], env={**os.environ, **env}, start_new_session=True)
    return _Worker(process.pid, process)


def join_world(backend: str, timeout_s: float) -> None:
    """Initialise ``torch.distributed``'s default process group for this worker.

    Under :func:`run_ranks` through the launcher's rendezvous file (:data:`RENDEZVOUS_ENV`, a ``FileStore``); under
    a user's ``torchrun`` through ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    rendezvous = os.environ.get(RENDEZVOUS_ENV)
    if rendezvous:
        world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=dist.FileStore(rendezvous, world_size), rank=int(os.environ["RANK"]),
                                world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def worker_command(module: str, argv: Sequence[str]) -> tuple[str, list[str]]:
    """The program and arguments that start one worker: ``python -u -m executor.launch module argv`` (through
    :func:`_worker_entry`), from ``sh`` with SIGINT ignored where there is one (see the module docstring).

    """
    python = [sys.executable, "-u", "-m", "executor.launch", module, *argv]
    shell = shutil.which("sh") if os.name == "posix" else None
    if shell is None:
        return python[0], python[1:]
    return shell, ["-c", 'trap "" INT; exec "$0" "$@"', *python]


def die_with_launcher() -> bool:
    """Have the kernel SIGKILL this worker when its launcher dies; returns whether that is armed
    (:func:`sim.core.lifetime.die_with_parent`, checked against the launcher named by :data:`LAUNCHER_PID_ENV`).

    Linux only; elsewhere it returns ``False`` and the worker goes on without. :func:`launch_local` starts workers
    from the launcher's main thread, which lives as long as the launcher.
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
