"""Fixtures of the CSP executor tests (the shared ``csp_run`` and ``csp_reference`` are in ``tests/executor``)."""

import pytest


@pytest.fixture(scope="module")
def csp_plan(tmp_path_factory):
    """A 2-stage csp plan of 4 subnets over a small supernet, written by ``sim.run`` (for what is refused before
    launch: nothing runs it)."""
    from sim.run import main as sim_main

    out = tmp_path_factory.mktemp("csp-plan")
    assert sim_main(["--topology", "2xcpu", "--schedule", "csp", "--model", "supernet:blocks=4,choices=2,hidden=32,"
                     "heads=4,seq=8,vocab=50", "--subnets", "4", "--no-gantt", "--out", str(out)]) == 0
    return out / "plan.json"
