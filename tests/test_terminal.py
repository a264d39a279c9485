"""The commands as a person runs them: in a terminal, where progress bars draw and Ctrl-C reaches every process.

Each command runs in a pseudo-terminal (``os.openpty``: its stdin, stdout and stderr a TTY, as in a shell), in a
session of its own so that a Ctrl-C is what a terminal sends, SIGINT to the whole foreground process group (the
command and any worker it started). A crash that only a terminal shows (the search's progress bar once imported a
package nobody declared) fails here, as it would for the person typing the README's example.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TerminalRun:
    """What a command did in the terminal: its exit status, everything it wrote (stdout and stderr, interleaved as
    on the screen), and how long it took to exit after Ctrl-C (s; ``None`` when not interrupted)."""

    status: int
    output: str
    exit_after_interrupt_s: float | None


def run_in_terminal(argv: list[str], cwd: Path, *, interrupt_on: str | None = None, interrupt_delay_s: float = 0.0,
                    interrupts: int = 1, timeout_s: float = 240.0) -> TerminalRun:
    """Run ``python -m ...`` ``argv`` in a pseudo-terminal; with ``interrupt_on``, send Ctrl-C to its process group
    ``interrupt_delay_s`` after that text first appears (``interrupts`` times, 0.1 s apart; the exit is timed from
    the first). A command still running at ``timeout_s`` is killed (the test then fails on its status)."""
    primary, secondary = os.openpty()
    # A terminal has a size (a fresh pseudo-terminal's is 0 x 0, on which tqdm draws a bar of no width).
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, *argv], stdin=secondary, stdout=secondary, stderr=secondary,
                               cwd=cwd, env=environment, start_new_session=True)
    os.close(secondary)
    chunks: list[bytes] = []
    interrupt_at = interrupted_at = None
    sent = 0
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            now = time.monotonic()
            if now > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                break
            if interrupt_at is not None and sent < interrupts and now >= interrupt_at + 0.1 * sent:
                os.killpg(process.pid, signal.SIGINT)  # what the terminal's Ctrl-C does
                interrupted_at = now if interrupted_at is None else interrupted_at
                sent += 1
            ready, _, _ = select.select([primary], [], [], 0.05)
            if not ready:
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
            if interrupt_on is not None and interrupt_at is None and interrupt_on.encode() in b"".join(chunks):
                interrupt_at = time.monotonic() + interrupt_delay_s
        status = process.wait(timeout=30)
        exited = time.monotonic()
    finally:
        os.close(primary)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = b"".join(chunks).decode(errors="replace")
    return TerminalRun(status, output, None if interrupted_at is None else exited - interrupted_at)


SEARCH = ["-m", "sim.search", "--topology", "8xA100", "--model", "gpt:layers=24,hidden=2048,heads=16,seq=1024",
          "--global-batch", "64", "--strategy", "exhaustive", "--workers", "2"]


def test_sim_run_in_a_terminal(tmp_path):
    run = run_in_terminal(["-m", "sim.run", "--topology", "4xV100", "--model", "gpt:layers=8", "--schedule", "1f1b",
                           "--microbatches", "8", "--out", "runs/a"], tmp_path)
    assert run.status == 0, run.output
    assert "iteration time" in run.output and "wrote runs/a/" in run.output
    assert (tmp_path / "runs/a/plan.json").is_file()


def test_sim_search_draws_its_progress_bar_and_answers(tmp_path):
    run = run_in_terminal(["-m", "sim.search", "--topology", "4xA100", "--model",
                           "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1000", "--global-batch", "8", "--out", "s"],
                          tmp_path)
    assert run.status == 0, run.output
    # tqdm's bar: the plans costed of the space, with the best time so far.
    assert "plan/s" in run.output and "best=" in run.output, run.output
    assert "--strategy auto chose exhaustive" in run.output and (tmp_path / "s/search.json").is_file()


def test_ctrl_c_stops_a_search_within_a_second_and_writes_what_was_found(tmp_path):
    # A search of 1,413 plans that takes most of a minute; Ctrl-C a second after its first plan is costed (the bar's
    # "best=" appears then: the workers are running).
    run = run_in_terminal([*SEARCH, "--out", "s"], tmp_path, interrupt_on="best=", interrupt_delay_s=1.0)
    assert run.status == 130, run.output
    assert "stopping: ranking and writing what was found" in run.output
    assert "stopped by Ctrl-C" in run.output and "Traceback" not in run.output, run.output
    for name in ("search.json", "candidates.csv", "pareto.png"):
        assert (tmp_path / "s" / name).is_file(), name
    # The target is 1 s on an idle machine (the changelog's figure); the bound here leaves room for a shared one.
    assert run.exit_after_interrupt_s is not None and run.exit_after_interrupt_s < 5.0, run.exit_after_interrupt_s


@pytest.mark.slow
def test_executor_run_in_a_terminal(tmp_path):
    built = run_in_terminal(["-m", "sim.run", "--topology", "2xcpu", "--model", "gpt:layers=2,hidden=64,seq=32,"
                             "vocab=100", "--schedule", "gpipe", "--microbatches", "2", "--out", "p"], tmp_path)
    assert built.status == 0, built.output
    run = run_in_terminal(["-m", "executor.run", "--plan", "p/plan.json", "--iterations", "2", "--out", "r"],
                          tmp_path)
    assert run.status == 0, run.output
    assert "predicted" in run.output and "measured" in run.output and (tmp_path / "r/compare.json").is_file()


def test_experiments_run_in_a_terminal(tmp_path):
    run = run_in_terminal(["-m", "experiments.run", "zero_bubble", "--quick"], tmp_path)
    assert run.status == 0, run.output
    assert "1f1b" in run.output.lower() and "Traceback" not in run.output
