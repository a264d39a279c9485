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
def naspipe_run():
    """``run(out, *flags) -> metrics``: ``python -m executor.naspipe`` on :data:`CSP_SPEC`, 12 subnets, seed 3, in a
    fresh process (as a user runs it); fails the test with the tool's stderr if it exits non-zero."""
    def run(out: Path, *flags: str) -> dict:
        result = subprocess.run([sys.executable, "-m", "executor.naspipe", "--model", CSP_SPEC, "--subnets", "12",
                                 "--seed", "3", "--out", str(out), *flags], cwd=ROOT, capture_output=True,
                                text=True, timeout=180, env={**os.environ})
        assert result.returncode == 0, result.stderr
        return json.loads((out / "metrics.json").read_text())

    return run
