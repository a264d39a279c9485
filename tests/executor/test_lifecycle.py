"""The executor's process lifecycle: workers die with their launcher, a failure is blamed on the rank that failed
first (and says how it ended), Ctrl-C is one line and stops everything (the failure report's ordering rules:
``test_failures.py``).

The end-to-end cases start a real ``python -m executor.run`` on two CPU ranks; each polls with deadlines (the machine
may be loaded) and kills whatever it started in ``finally``. Workers run in POSIX sessions of their own, so they are
found by their command line (which names the test's own output directory) rather than by process group.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.interpreter import OpFailure
from executor.launch import LAUNCHER_PID_ENV, worker_command
from executor.rank_process import INJECT_SIGNAL_ENV, failure_message
from sim.core.errors import SpecError
from tests.executor.runs import ROOT, execute, sim_plan

#: A run long enough never to finish within a test (it is stopped long before).
ENDLESS = ("--iterations", "100000", "--warmup", "0", "--no-gantt", "--threads", "1")


def _worker_processes(marker: str, exclude: int | None = None) -> list[int]:
    """PIDs of live ``executor.run`` processes whose command line mentions ``marker`` (zombies have none)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != exclude:
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "executor.run" in cmdline:
                pids.append(int(entry.name))
    return pids


def _wait_for(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def _python_with_default_sigint(pid: int) -> bool:
    """Whether the process is Python (no longer the ``sh`` that starts it) and SIGINT has its default action there:
    neither caught (``SigCgt``) nor ignored (``SigIgn`` in ``/proc/PID/status``); gone counts as so."""
    try:
        program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigCgt:", "SigIgn:"))}
    bit = 1 << (signal.SIGINT - 1)
    return "python" in Path(os.fsdecode(program)).name and not (masks["SigCgt"] | masks["SigIgn"]) & bit


def _start(plan: Path, out: Path, logs: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m executor.run`` in a session of its own, output to files (workers inherit pipes, which a dead
    launcher's reader would wait on); ``env`` adds to the environment."""
    logs.mkdir(exist_ok=True)
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "executor.run", "--plan", str(plan), "--out", str(out),
                                 *extra], cwd=ROOT, stdout=stdout, stderr=stderr, start_new_session=True,
                                env={**os.environ, **(env or {})})


def _own_tmp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty directory of the test's own and the environment that makes it the run's temporary directory
    (``tempfile`` reads ``TMPDIR``): what a run leaves there, it would leave in ``/tmp``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {"TMPDIR": str(tmp)}


def _left_in(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir())


def _kill_everything(launcher: subprocess.Popen, marker: str) -> None:
    """SIGKILL the launcher's process group and every worker's (each leads a session of its own)."""
    for pid in [launcher.pid, *_worker_processes(marker, exclude=launcher.pid)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    launcher.wait(timeout=30)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    return sim_plan(tmp_path_factory.mktemp("lifecycle") / "sim", 2, 4, "--schedule", "1f1b")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dying with the launcher needs Linux's prctl")
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path, plan):
    out, (tmp, env) = tmp_path / "real", _own_tmp(tmp_path)
    launcher = _start(plan, out, tmp_path / "logs", *ENDLESS, env=env)
    try:
        assert _wait_for(lambda: len(_worker_processes(str(out), exclude=launcher.pid)) == 2, 60), \
            (tmp_path / "logs" / "stderr").read_text()
        launcher.kill()
        launcher.wait(timeout=10)
        gone = _wait_for(lambda: not _worker_processes(str(out), exclude=launcher.pid), 5)
        assert gone, f"workers outlived their launcher: {_worker_processes(str(out), exclude=launcher.pid)}"
        assert not (out / "metrics.json").exists()
        # Nor does a folder: the launcher's scratch directory (failure records, torch's worker folders) goes too.
        assert _wait_for(lambda: not _left_in(tmp), 5), _left_in(tmp)
    finally:
        _kill_everything(launcher, str(out))


def test_a_rank_killed_by_a_signal_is_blamed_and_says_so(tmp_path, plan):
    # Rank 1 dies of SIGKILL at op 1B1 (no record can be written); rank 0 then fails on the closed connection, or is
    # stopped by the launcher: either way the line names rank 1 and the signal, and rank 0's story is in the log.
    out = tmp_path / "real"
    try:
        result = execute(plan, out, "--inject-failure", "1:1B1", "--iterations", "1", "--warmup", "0",
                         "--no-gantt", "--threads", "1", env={INJECT_SIGNAL_ENV: "SIGKILL"}, timeout=120)
        assert result.returncode == 1, result.stderr
        assert _error_lines(result.stderr) == ["error: rank 1 was killed by signal 9 (SIGKILL)"], result.stderr
        assert "Traceback" not in result.stderr and "Connection" not in result.stderr, result.stderr
        log = (out / "errors.log").read_text().splitlines()
        assert log[0].startswith("rank 1 was killed by signal 9 (SIGKILL)"), log
        assert any(line.startswith("rank 0") for line in log[1:]), log  # the echo or the stop, kept for the log
        assert log[-1].startswith("exit codes: ") and "rank 1: signal 9" in log[-1], log
        assert not (out / "metrics.json").exists()
        assert _wait_for(lambda: not _worker_processes(str(out)), 5), "worker processes outlived the run"
    finally:
        for pid in _worker_processes(str(out)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_prints_one_line_stops_every_worker_and_exits_130(tmp_path, plan):
    out, logs, (tmp, env) = tmp_path / "real", tmp_path / "logs", _own_tmp(tmp_path)
    launcher = _start(plan, out, logs, *ENDLESS, env=env)
    try:
        assert _wait_for(lambda: len(_worker_processes(str(out), exclude=launcher.pid)) == 2, 60), \
            (logs / "stderr").read_text()
        # Best effort, not asserted: let the workers get past their first instructions (which give SIGINT back its
        # default action), so that the signal finds them as it would a few seconds into a run (one sent earlier is
        # lost and the agent's SIGKILL comes 5 s later: the next test covers that window).
        _wait_for(lambda: all(_python_with_default_sigint(p)
                              for p in _worker_processes(str(out), exclude=launcher.pid)), 10)
        os.kill(launcher.pid, signal.SIGINT)
        status = launcher.wait(timeout=30)
        stderr = (logs / "stderr").read_text()
        assert status == 130, stderr
        assert stderr.strip().splitlines() == ["error: interrupted"], stderr
        assert _wait_for(lambda: not _worker_processes(str(out), exclude=launcher.pid), 5), "workers outlived Ctrl-C"
        assert not (out / "metrics.json").exists()
        assert _left_in(tmp) == []  # removed before the launcher exits
    finally:
        _kill_everything(launcher, str(out))


@pytest.mark.skipif(os.name != "posix", reason="the start-up guard is sh's trap")
def test_ctrl_c_while_a_worker_starts_prints_nothing_and_after_start_up_stops_it():
    # Before the guard, SIGINT 10-60 ms into a worker's start printed "Fatal Python error: init_import_site" or a
    # KeyboardInterrupt traceback (CI caught one). Sent on a grid of delays across start-up, it now either stops the
    # worker (-SIGINT) or is lost in the ignored window (the nap ends, status 0); never a word on stderr.
    program, args = worker_command("tests.executor.sigint_probe", [])
    for delay_ms in range(0, 90, 10):
        worker = subprocess.Popen([program, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay_ms / 1000)
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=30)
        assert err == "" and worker.returncode in (0, -signal.SIGINT), (delay_ms, worker.returncode, err)
        assert out in ("", f"up {int(signal.SIG_DFL)}\n"), out  # the worker runs with SIGINT's default action
    # Once the worker is up, Ctrl-C ends it at once.
    worker = subprocess.Popen([program, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == f"up {int(signal.SIG_DFL)}\n"
    worker.send_signal(signal.SIGINT)
    assert worker.wait(timeout=30) == -signal.SIGINT and worker.stderr.read() == ""


def test_a_failing_rank_stops_every_rank_with_its_error_and_op(tmp_path, plan):
    out, (tmp, env) = tmp_path / "failing-run", _own_tmp(tmp_path)
    result = execute(plan, out, "--inject-failure", "1:1B1", "--iterations", "1", "--warmup", "0", "--no-gantt",
                     "--threads", "1", env=env, timeout=120)
    assert _left_in(tmp) == []  # neither the failure records' folder nor the rendezvous file
    ended = time.time()
    assert result.returncode == 1
    # One line: the failing rank, its op and the op's own exception; rank 0's echo (a closed connection) is not one.
    assert _error_lines(result.stderr) == [
        "error: rank 1 failed at op 1B1: RuntimeError: injected failure at 1B1 (--inject-failure)"], result.stderr
    assert "Traceback" not in result.stderr and "Connection" not in result.stderr, result.stderr
    assert not (out / "metrics.json").exists() and not (out / "compare.json").exists()
    log = (out / "errors.log").read_text()  # the full story, tracebacks included, for whoever debugs it
    assert log.startswith("rank 1 at ") and "Traceback" in log
    # Stopped promptly after the failure (a rank left waiting on its peer would take the 300 s timeout); timed from
    # the failure's own record, so that a slow start on a loaded machine does not count.
    failed_at = float(log.split(":", 1)[0].removeprefix("rank 1 at "))
    assert ended - failed_at < 20, f"took {ended - failed_at:.1f} s to stop after the failure"
    assert _wait_for(lambda: not _worker_processes(str(out)), 5), "worker processes outlived the run"


def test_rank_zero_failure_is_reported_too(tmp_path):
    plan = sim_plan(tmp_path / "sim", 2, 2, "--schedule", "gpipe")
    result = execute(plan, tmp_path / "r0", "--inject-failure", "0:0F1", "--iterations", "1", "--warmup", "0",
                     "--no-gantt", "--threads", "1")
    assert result.returncode == 1
    assert _error_lines(result.stderr) == [
        "error: rank 0 failed at op 0F1: RuntimeError: injected failure at 0F1 (--inject-failure)"], result.stderr


def test_failure_message_names_the_op_once_with_its_own_exception():
    cause = KeyError("w")
    wrapped = OpFailure("1B1", cause)
    wrapped.__cause__ = cause  # as the interpreter raises it: raise OpFailure(...) from exc
    assert failure_message(1, wrapped) == "rank 1 failed at op 1B1: KeyError: 'w'"
    assert failure_message(0, SpecError("plan x has 2 ranks")) == "rank 0: plan x has 2 ranks"
    assert failure_message(2, RuntimeError()) == "rank 2 failed: RuntimeError"


_CHILD = """
import os, sys, time
from executor.launch import die_with_launcher
print(int(die_with_launcher()), os.getpid(), flush=True)
time.sleep(60)
"""
_PARENT = """
import os, subprocess, sys, time
env = dict(os.environ, {env_name}=str(os.getpid()) if {honest} else "1")
child = subprocess.Popen([sys.executable, "-c", {child!r}], env=env, stdout=sys.stdout)
child.wait()
print("child status", child.returncode, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_that_asked_to_die_with_its_parent_does(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(env_name=LAUNCHER_PID_ENV, honest=True,
                                                                     child=_CHILD)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        armed, child = parent.stdout.readline().split()
        assert armed == "1"
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_for(lambda: not _alive(int(child)), 5), "the child outlived its parent"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_whose_launcher_is_already_gone_kills_itself():
    # The launcher named in the environment is not the parent (as if it died before the worker asked): at once.
    result = subprocess.run([sys.executable, "-c", _PARENT.format(env_name=LAUNCHER_PID_ENV, honest=False,
                                                                   child=_CHILD)],
                            cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == f"child status {-signal.SIGKILL}", result


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
