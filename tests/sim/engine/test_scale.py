"""The engine's bookkeeping is proportional to what is in flight, not to the plan.

An op's done event exists from when something waits for it (or it finishes) until SimPy has processed it, and a
RECV's "issued" event until its transfer has seen it. In the steady state of the 1F1B family every rank repeats
the same pattern, so the most such events alive at once must not depend on the number of microbatches; an engine
that made an event per op up front would hold one for every op of the plan.
"""

from __future__ import annotations

import pytest

from sim.engine import simpy_engine
from sim.engine.simpy_engine import simulate
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


def _most_live_events(monkeypatch, schedule: str, microbatches: int) -> int:
    most = 0
    done_event, finish = simpy_engine._Run._done_event, simpy_engine._Run._finish

    def count(run) -> None:
        nonlocal most
        most = max(most, len(run.events) + len(run.comm.issued))

    def counting_done_event(self, op_id):
        event = done_event(self, op_id)
        count(self)
        return event

    def counting_finish(self, op, rank, start):
        finish(self, op, rank, start)
        count(self)

    monkeypatch.setattr(simpy_engine._Run, "_done_event", counting_done_event)
    monkeypatch.setattr(simpy_engine._Run, "_finish", counting_finish)
    built = build_plan(PlanInputs("uniform:layers=8", "4xV100", schedule, microbatches))
    simulate(built.plan, built.costs, built.topology)
    return most


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p", "pipedream"])
def test_live_events_do_not_grow_with_the_microbatches(monkeypatch, schedule):
    few, many = (_most_live_events(monkeypatch, schedule, m) for m in (16, 160))
    assert few == many  # with an event per op up front: 324 and 3,204 (1F1B)


def test_the_run_keeps_no_event_after_it_ends(monkeypatch):
    runs = []
    init = simpy_engine._Run.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(simpy_engine._Run, "__init__", keep)
    built = build_plan(PlanInputs("uniform:layers=4", "4xV100", "1f1b", 8))
    simulate(built.plan, built.costs, built.topology)
    (run,) = runs
    assert run.env is None and run.events is None and run.spans == [] and not run.finished
    assert run.comm.env is None and run.comm.issued is None and run.comm.links is None
