"""Fixtures shared by the executor tests (``one_thread`` is in ``tests/conftest.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The small supernet of the CSP tests; choices=4 includes the identity candidate, so some stages of some subnets
#: have nothing trainable upstream.
CSP_SPEC = "supernet:blocks=6,choices=4,hidden=32,heads=4,seq=8,vocab=50"


@pytest.fixture(scope="session")
def csp_run():
    """``run(out, stages, *sim_flags, reference=False, run_flags=()) -> metrics``: ``python -m sim.run --schedule
    csp`` on :data:`CSP_SPEC`, 12 subnets, seed 3, a uniform partition over ``stages`` CPU ranks, then ``python -m
    executor.run --plan`` on the plan it wrote (``--reference`` for the one-process oracle; ``run_flags`` added), as
    a user runs them; fails the test with the tool's stderr if either exits non-zero."""
    from sim.run import main as sim_main

    def run(out: Path, stages: int, *sim_flags: str, reference: bool = False, run_flags: tuple = ()) -> dict:
        plan_dir = out.with_name(out.name + "-plan")
        assert sim_main(["--topology", f"{stages}xcpu", "--schedule", "csp", "--model", CSP_SPEC, "--subnets", "12",
                         "--seed", "3", "--partition", "uniform", "--no-gantt", *sim_flags,
                         "--out", str(plan_dir)]) == 0
        command = [sys.executable, "-m", "executor.run", "--plan", str(plan_dir / "plan.json"), "--out", str(out)]
        result = subprocess.run([*command, *(["--reference"] if reference else []), *run_flags], cwd=ROOT,
                                capture_output=True, text=True, timeout=180, env={**os.environ})
        assert result.returncode == 0, result.stderr
        return json.loads((out / "metrics.json").read_text())

    return run


@pytest.fixture(scope="session")
def csp_reference(csp_run, tmp_path_factory) -> dict:
    """``metrics.json`` of ``executor.run --reference`` on :data:`CSP_SPEC`'s 12 subnets (seed 3): the one-process
    oracle a CSP run must equal bitwise, whatever its stages, budget, checkpoints or restarts (the plan's stages and
    budget do not change what the reference trains)."""
    return csp_run(tmp_path_factory.mktemp("csp-reference") / "run", 1, reference=True)
