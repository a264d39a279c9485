"""DualPipeV (``dualpipev``) against PyTorch's own order, a hand-written schedule, the engine tests' independent
oracle and its closed forms.

Units: ``uniform:fwd_ms=1,bwd_ms=2`` with one layer per vstage gives F = 1 ms and, the backward split in halves,
I = W = 1 ms (B = 2 ms): one time unit is 1 ms. ``Nxideal`` links are free.

This module imports torch (PyTorch's ``ScheduleDualPipeV`` is the oracle of the order); ``sim`` itself never does.
"""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV

from sim.core.errors import SpecError
from sim.engine.simpy_engine import simulate
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.validate import validate
from sim.schedules import SCHEDULES
from sim.schedules.dualpipev import dualpipev, v_placement
from tests.sim.engine.test_simpy_engine import _uncontended_times

SIZES = [(p, m) for p in range(1, 7) for m in range(2 * p, 4 * p + 3)]


def _rows(programs):
    return [" ".join(op.id for op in program) for program in programs]


def _pytorch_order(p, m, rank):
    """PyTorch's per-rank compute order of ``ScheduleDualPipeV`` (its pure function of p, m and the rank, called
    without stages or a process group), an ``OVERLAP_F_B`` as its forward then its backward."""
    actions = ScheduleDualPipeV._calculate_single_rank_operations(
        SimpleNamespace(pp_group_size=p, _n_microbatches=m), rank)
    return [str(sub) for action in actions for sub in (action.sub_actions or (action,))]


@pytest.mark.parametrize("p, m", SIZES)
def test_order_is_pytorchs_dualpipev(p, m):
    assert [[op.id for op in program] for program in dualpipev(p, m)] == [_pytorch_order(p, m, r) for r in range(p)]


def test_order_p2_m4_by_hand():
    # The module docstring's diagram: phases 1-8 on rank 0, phases 2, 4, 6 and 8 on rank 1 (the others are empty).
    assert _rows(SCHEDULES["dualpipev"].build(2, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


def test_v_placement():
    assert v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert SCHEDULES["dualpipev"].vstage_to_rank(3) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError):
        v_placement(4, 3)


def _build(p, m, **kw):
    return build_plan(PlanInputs(f"uniform:layers={2 * p},fwd_ms=1,bwd_ms=2", f"{p}xideal", "dualpipev", m,
                                 partition="uniform", **kw))


@pytest.mark.parametrize("p, m", SIZES)
def test_makespan_is_6m_plus_p_minus_1_units(p, m):
    # Every rank computes 2 stages x m microbatches x (F + I + W) = 6m units and idles p − 1 units: half of ZB-H1's
    # p − 1 in units of a stage twice as long (ZB-H1's 3m + p − 1 on stages of F = I = W = 2 units is 6m + 2(p − 1)).
    # The engine's time and the engine tests' independent oracle (every op's end with free links, pure Python) are
    # both the closed form.
    built = _build(p, m)
    validate(built.plan)
    result = simulate(built.plan, built.costs, built.topology)
    expected = (6 * m + p - 1) * 1e-3
    assert result.trace.makespan == pytest.approx(expected, rel=1e-12)
    oracle = _uncontended_times(built.plan, built.costs, built.topology)
    assert max(oracle.values()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_each_rank_holds_at_most_2p_plus_1_chunk_activations(p):
    # The DualPipe README's "PP + 1" activations, PP = 2p stages here: a chunk's activations live from its F to its B
    # or W (the engine's convention), and every rank reaches 2p + 1 of them at once.
    for program in dualpipev(p, 3 * p):
        live = peak = 0
        for op in program:
            live += {"F": 1, "B": -1, "W": -1}.get(op.kind.value, 0)
            peak = max(peak, live)
        assert peak == 2 * p + 1


def test_too_few_microbatches_are_refused_with_the_values():
    with pytest.raises(SpecError, match=r"--microbatches 7 with 4 ranks"):
        SCHEDULES["dualpipev"].build(4, 7)
    with pytest.raises(SpecError, match=r"2 stages per rank"):
        SCHEDULES["dualpipev"].check(4, 8, 2)
