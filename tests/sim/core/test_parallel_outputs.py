"""A command's outputs made on two cores: the same bytes as made one after another, a child that fails or dies
replaced by this process's own work, an error raised here, and no child left behind.

Oracles: the process id each product was made in (this process's or another's), the products made one after
another in this process, and ``waitpid`` (no child left, running or unreaped). The forking scenarios run in a fresh
interpreter (``parallel_outputs_probe.py``): this one has pytest-xdist's threads, where forking is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sim.core.parallel_outputs import can_fork_safely, produce_in_parallel

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).with_name("parallel_outputs_probe.py")


def probe(scenario: str) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), scenario], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is forked on Linux only")
def test_the_first_product_is_made_here_and_the_others_in_one_child():
    report = probe("forks")
    first, second, third = report["made_by"]
    assert first == report["parent"]
    assert second == third != report["parent"]  # one child for all the others
    assert report["children_left"] is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is forked on Linux only")
def test_products_far_larger_than_a_pipe_come_back_whole():
    report = probe("large")
    assert report["payload_intact"] == [True, True]
    assert report["made_by"][0] == report["parent"] != report["made_by"][1]


@pytest.mark.parametrize("scenario", ["child_fails", "child_killed"])
def test_a_child_that_fails_or_dies_is_replaced_by_this_process(scenario):
    report = probe(scenario)
    assert report["made_by"] == [report["parent"], report["parent"]]
    assert report["children_left"] is False


def test_an_error_in_the_childs_share_is_raised_here_with_this_process_as_its_maker():
    report = probe("child_error_is_raised_here")
    assert report["error"] == f"made in {report['parent']}"
    assert report["children_left"] is False


def test_an_error_here_kills_and_reaps_the_child():
    report = probe("parent_fails")
    assert report["error"] == f"made in {report['parent']}"
    assert report["children_left"] is False


def test_with_another_thread_running_nothing_is_forked():
    report = probe("another_thread")
    assert report["made_by"] == [report["parent"], report["parent"]]
    assert report["children_left"] is False


def test_in_a_process_with_threads_the_products_are_made_here_in_order():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork_safely()
        assert produce_in_parallel([lambda: b"a", lambda: b"b", lambda: b""]) == [b"a", b"b", b""]
    finally:
        stop.set()
        thread.join()
    assert produce_in_parallel([]) == []
    assert produce_in_parallel([lambda: b"only"]) == [b"only"]
