"""A process that has imported torch and ``executor.run`` once and forks a fresh copy of itself for each
``executor.run`` the tests start (:func:`run_executor`), so that a test's run does not pay the interpreter's start and
the imports again (1.6-2 s of CPU a run, about 90 runs in the suite).

Each child is forked from the zygote, which has done nothing but import: it starts as a freshly started
``python -m executor.run`` would after its imports, sets its working directory, environment and argument list, points
its standard output and error at files, runs ``executor.run.main`` and exits with its status. The child then is the
launcher: it forks its ranks (or execs them) exactly as a command typed by a person does. What this cannot show, the
interpreter's own start and a terminal's signals, the lifecycle and terminal tests show with real processes.

The zygote reads one JSON request a line on its standard input and answers two lines: the child's process id when it
starts, its exit status when it ends. It ends at end-of-file (its test process is gone or done) and dies with its
parent (``sim.core.lifetime.die_with_parent``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The zygote's program (run with ``python -c``): import, then serve requests.
_PROGRAM = r"""
import json, os, sys, tempfile
from sim.core.lifetime import die_with_parent
die_with_parent(int(sys.argv[1]))
import executor.run
from executor.run import RANK_MODULES, GRADIENT_BACKWARD_MODULE
import importlib
for name in (*RANK_MODULES, GRADIENT_BACKWARD_MODULE):
    importlib.import_module(name)
replies = os.fdopen(os.dup(1), "w", buffering=1)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            replies.close()
            os.chdir(request["cwd"])
            os.environ.clear(); os.environ.update(request["env"])
            tempfile.tempdir = None  # read TMPDIR again, as a new process would
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                os.dup2(target, fd); os.close(target)
            sys.argv = ["executor.run", *request["argv"]]
            try:
                status = executor.run.main(request["argv"]) or 0
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, wait_status = os.waitpid(pid, 0)
    replies.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n")
"""


class _Zygote:
    """The running zygote of this test process (started on first use, one request at a time)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen([sys.executable, "-c", _PROGRAM, str(os.getpid())], cwd=ROOT,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            atexit.register(self.close)
        return self._process

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()

    def run(self, argv: list[str], env: dict[str, str], out_dir: Path, timeout: float) -> tuple[int, str, str]:
        """Run ``executor.run argv`` in a forked child; its status, standard output and standard error."""
        with self._lock:
            process = self._started()
            stdout, stderr = out_dir / "stdout", out_dir / "stderr"
            request = {"argv": argv, "env": env, "cwd": str(ROOT), "stdout": str(stdout), "stderr": str(stderr)}
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            pid = json.loads(process.stdout.readline())["pid"]
            deadline = time.monotonic() + timeout
            while not select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if time.monotonic() >= deadline:
                    os.kill(pid, signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
                    process.stdout.readline()
                    raise subprocess.TimeoutExpired(["executor.run", *argv], timeout)
            status = json.loads(process.stdout.readline())["status"]
            return status, stdout.read_text(), stderr.read_text()


_ZYGOTE = _Zygote()


def run_executor(argv: list[str], env: dict[str, str], scratch: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m executor.run argv`` with environment ``env``, forked from this test process's zygote; its result as
    :func:`subprocess.run` would give it (``scratch``: a directory for the captured output)."""
    scratch.mkdir(parents=True, exist_ok=True)
    status, stdout, stderr = _ZYGOTE.run(argv, env, scratch, timeout)
    return subprocess.CompletedProcess(["executor.run", *argv], status, stdout, stderr)
