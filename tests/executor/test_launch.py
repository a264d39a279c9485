"""How the launcher starts its workers (``executor.launch``'s start methods): forked with the preloaded code already
imported, or as fresh interpreters; either way with their rank's variables, in a session of their own, SIGINT at
its default action, and supervised alike (a failing worker's status reported, the others stopped with SIGTERM,
Ctrl-C passed on). The launcher runs in a fresh one-thread process, as ``executor.run`` does; a stand-in worker
(``launch_probe.py``) reports what it found. The end-to-end lifecycle of real runs is in ``test_lifecycle.py``."""

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from executor.launch import WorkersFailed, launch_local
from tests.executor.launch_probe import PRELOADED
from tests.executor.runs import ROOT

PROBE = "tests.executor.launch_probe"
pytestmark = pytest.mark.skipif(os.name != "posix", reason="sessions, signals and fork are POSIX")


def _launcher(start: str, num_ranks: int, *probe_args: str, errors_log: Path | None = None) -> subprocess.Popen:
    """``run_ranks`` of the probe in a fresh Python process (one thread, like ``python -m executor.run``), preloading
    :data:`PRELOADED`; its output piped."""
    log = str(errors_log) if errors_log else None
    # The probe is imported first, as a program calling executor.run.main has imported executor.run: the forked
    # workers still run it as a fresh ``python -m`` would, without runpy's warning about a module already imported.
    code = (f"import sys, {PROBE}; from executor.launch import run_ranks; "
            f"sys.exit(run_ranks({PROBE!r}, sys.argv[1:], {num_ranks}, errors_log={log!r}, start={start!r}, "
            f"preload=({PRELOADED!r},)))")
    return subprocess.Popen([sys.executable, "-c", code, *probe_args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_each_worker_starts_with_its_rank_in_its_own_session_and_sigints_default(tmp_path, start):
    launcher = _launcher(start, 3, "report", str(tmp_path))
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and err == "", err
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [f["rank"] for f in found] == [f["local_rank"] for f in found] == ["0", "1", "2"]
    assert {f["world_size"] for f in found} == {f["local_world_size"] for f in found} == {"3"}
    assert all(f["session_leader"] and f["sigint_default"] and f["argv"] == ["report", str(tmp_path)]
               for f in found), found
    assert all(f["parent"] == launcher.pid for f in found), (launcher.pid, found)  # so that it dies with it
    assert len({f["pid"] for f in found}) == 3
    rendezvous = {f["rendezvous"] for f in found}
    assert len(rendezvous) == 1 and Path(rendezvous.pop()).name == "rendezvous-0"
    # Forked workers find the preloaded module imported; fresh interpreters do not (the negative control).
    assert all(f["preloaded"] == (start == "fork") for f in found), found


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_failing_worker_is_reported_and_the_others_are_stopped(tmp_path, start):
    log = tmp_path / "errors.log"
    began = time.monotonic()
    launcher = _launcher(start, 3, "fail", "1", "3", errors_log=log)
    out, err = launcher.communicate(timeout=120)
    # The others sleep 60 s unless stopped: the run ending long before says they were.
    assert time.monotonic() - began < 30
    assert launcher.returncode == 1, err
    assert err.splitlines() == ["error: rank 1 exited with status 3 without reporting why"], err
    ends = log.read_text().splitlines()[-1]
    assert ends == "exit codes: rank 0: signal 15, rank 1: status 3, rank 2: signal 15", ends


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_ctrl_c_is_passed_on_and_the_launcher_exits_130(start):
    launcher = _launcher(start, 2, "sleep")
    try:
        time.sleep(2.0)  # past the start-up window (test_lifecycle covers a signal inside it)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 130 and err.splitlines() == ["error: interrupted"], (launcher.returncode, err)
    finally:
        launcher.kill()


def test_a_process_running_threads_starts_its_workers_as_fresh_interpreters(tmp_path):
    # A fork copies only the calling thread: locks another thread holds would stay held in the worker forever. So
    # where this process runs a second thread, "fork" falls back to "exec" (seen here: the worker's parent is this
    # process and it has not imported what this one has).
    importlib.import_module(PRELOADED)  # a forked worker would find it imported; a fresh interpreter does not
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    try:
        launch_local(PROBE, ["report", str(tmp_path)], 1, rendezvous=tmp_path / "rendezvous", start="fork")
    finally:
        stop.set()
        helper.join()
    found = json.loads((tmp_path / "rank0.json").read_text())
    assert found["parent"] == os.getpid() and not found["preloaded"] and found["session_leader"]


def test_launch_local_raises_with_every_bad_exit(tmp_path):
    with pytest.raises(WorkersFailed) as failed:
        launch_local(PROBE, ["fail", "0", "4"], 2, rendezvous=tmp_path / "rendezvous", start="exec")
    assert failed.value.exit_codes == {0: 4, 1: -signal.SIGTERM}
