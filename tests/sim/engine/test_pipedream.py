"""Async PipeDream with weight stashing: lowering, weight versions, steady state and stashed-version memory.

Oracles (PipeDream, Narayanan et al. SOSP'19 §3.2–3.3, in closed form for the 1F1B order used here):

* Stage r runs ``w = p − r − 1`` warm-up forwards, then alternates F and B+update, so F of minibatch k comes after
  ``max(0, k − w)`` of its own updates: that is the version it (and its backward) runs on. With vertical sync every
  stage uses stage 0's version for k: ``max(0, k − (p − 1))``.
* In the steady state no rank idles; with uniform costs the plan takes (m + p − 1)(t_f + t_b), so the bubble
  (p − 1)/(m + p − 1) goes to 0 as minibatches grow.
* Stage r holds ``p − r`` weight versions at once (PipeDream's ``num_versions = warmup + 1``); with vertical sync a
  version is also kept from its creation until stage 0's minibatch reaches the stage, r more: ``p`` on every stage.
"""

import pytest

from sim.engine.simpy_engine import simulate
from sim.ir.plan import OpKind
from sim.ir.weight_versions import weight_versions
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.run import main as sim_main

T_F, T_B = 1e-3, 2e-3
PARAM = 10e6  # uniform:param_mb=10 -> bytes of one stage's weights (one layer per stage)


def _built(p, m, vertical_sync=False):
    return build_plan(PlanInputs(f"uniform:layers={p},fwd_ms=1,bwd_ms=2,param_mb=10", f"{p}xideal", "pipedream",
                                 m, partition="uniform", vertical_sync=vertical_sync))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_weight_versions_follow_the_closed_form(p, m, vertical_sync):
    plan = _built(p, m, vertical_sync).plan
    expected = {(r, k): max(0, k - (p - 1 - (0 if vertical_sync else r))) for r in range(p) for k in range(m)}
    assert weight_versions(plan) == expected


def test_one_update_per_minibatch_right_after_its_backward():
    plan = _built(3, 5).plan
    for program in plan.programs:
        steps = [op for op in program if op.kind is OpKind.OPT_STEP]
        assert sorted(op.mb for op in steps) == list(range(5))
        ids = [op.id for op in program]
        for op in steps:
            before = [i for i in ids[: ids.index(op.id)] if not i[1:].startswith("SEND_B")]
            assert before[-1] == f"{op.vstage}B{op.mb}"
    assert plan.weight_policy == "stash"


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 64)])
def test_steady_state_keeps_every_rank_busy(p, m):
    built = _built(p, m)
    trace = simulate(built.plan, built.costs, built.topology).trace
    assert trace.makespan == pytest.approx((m + p - 1) * (T_F + T_B))
    for rank in range(p):
        compute = [s for s in trace.on_rank(rank, "compute") if s.kind in ("F", "B")]
        first_b = min(s.start for s in compute if s.kind == "B")
        last_f = max(s.end for s in compute if s.kind == "F")
        window = [s for s in compute if s.start >= first_b and s.end <= last_f]
        gaps = [b.start - a.end for a, b in zip(window, window[1:])]
        assert all(gap == pytest.approx(0, abs=1e-12) for gap in gaps), (rank, gaps)
    bubble = 1 - sum(s.duration for s in trace.spans if s.stream == "compute") / (p * trace.makespan)
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    if m == 64:
        assert bubble < 0.05


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_stashed_versions_memory(vertical_sync):
    p, m = 4, 12
    built = _built(p, m, vertical_sync)
    result = simulate(built.plan, built.costs, built.topology)
    flush = build_plan(PlanInputs(f"uniform:layers={p},fwd_ms=1,bwd_ms=2,param_mb=10", f"{p}xideal", "1f1b", m,
                                  partition="uniform"))
    baseline = simulate(flush.plan, flush.costs, flush.topology)
    for rank in range(p):
        versions = p if vertical_sync else p - rank
        extra = result.peak_memory_bytes[rank] - baseline.peak_memory_bytes[rank]
        assert extra == pytest.approx(versions * PARAM), rank


def test_vertical_sync_needs_pipedream(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        sim_main(["--topology", "2xideal", "--model", "uniform:layers=2", "--schedule", "1f1b", "--vertical-sync",
                  "--out", str(tmp_path)])
    assert info.value.code == 2 and "--vertical-sync applies to weight stashing" in capsys.readouterr().err
    assert sim_main(["--topology", "2xideal", "--model", "uniform:layers=2", "--schedule", "pipedream",
                     "--vertical-sync", "--no-gantt", "--out", str(tmp_path / "ok")]) == 0
    assert '"vertical_sync": true' in (tmp_path / "ok" / "plan.json").read_text()
