"""Run by ``test_parallel_outputs.py`` in a fresh interpreter (the test process has threads: pytest-xdist's), one
scenario per call: prints a JSON object of what :func:`sim.core.parallel_outputs.produce_in_parallel` did."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from sim.core.parallel_outputs import produce_in_parallel

PARENT = os.getpid()


def pid_bytes() -> bytes:
    """Who made this product: this process's id."""
    return str(os.getpid()).encode()


def fails_in_a_child() -> bytes:
    if os.getpid() != PARENT:
        raise RuntimeError("only in the child")
    return pid_bytes()


def killed_in_a_child() -> bytes:
    if os.getpid() != PARENT:
        os.kill(os.getpid(), signal.SIGKILL)
    return pid_bytes()


def always_fails() -> bytes:
    raise ValueError(f"made in {os.getpid()}")


#: Larger than a pipe's buffer many times over (10 MB), and not the same byte throughout.
PAYLOAD = bytes(range(256)) * 40_000


def large() -> bytes:
    return PAYLOAD + b"|" + pid_bytes()


def children_left() -> bool:
    """Whether this process has a child, running or unreaped."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


def main(scenario: str) -> None:
    report: dict[str, object] = {"parent": PARENT}
    if scenario == "forks":
        report["made_by"] = [int(p) for p in produce_in_parallel([pid_bytes, pid_bytes, pid_bytes])]
    elif scenario == "large":
        products = [p.rpartition(b"|") for p in produce_in_parallel([large, large])]
        report["payload_intact"] = [payload == PAYLOAD for payload, _, _ in products]
        report["made_by"] = [int(pid) for _, _, pid in products]
    elif scenario == "child_fails":
        report["made_by"] = [int(p) for p in produce_in_parallel([pid_bytes, fails_in_a_child])]
    elif scenario == "child_killed":
        report["made_by"] = [int(p) for p in produce_in_parallel([pid_bytes, killed_in_a_child])]
    elif scenario == "child_error_is_raised_here":
        try:
            produce_in_parallel([pid_bytes, always_fails])
        except ValueError as error:
            report["error"] = str(error)
    elif scenario == "parent_fails":
        try:
            produce_in_parallel([always_fails, large])
        except ValueError as error:
            report["error"] = str(error)
    elif scenario == "another_thread":
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        try:
            report["made_by"] = [int(p) for p in produce_in_parallel([pid_bytes, pid_bytes])]
        finally:
            stop.set()
            thread.join()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    report["children_left"] = children_left()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
