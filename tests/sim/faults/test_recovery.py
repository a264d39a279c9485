"""Recovery policies: a continuing policy loses only the iteration a failure interrupts and runs degraded until the
capacity returns (an exact scripted run), restarts from the checkpoint beyond what it tolerates, its time adds up,
and the policies' slowdowns are their closed forms."""

import numpy as np
import pytest

from sim.faults.checkpoint import CheckpointCost
from sim.faults.failure_mix import FailureCause, FailureMix, builtin_mix
from sim.faults.long_run import LongRun, ScriptedFailures, simulate_long_run
from sim.faults.recovery import RESTART, Recovery, drop_replica, oobleck, recycle, simulate_recovery

ONE_CAUSE = FailureMix("test", (FailureCause("any", "test", 1),))


def test_a_continuing_policy_loses_the_interrupted_iteration_and_runs_degraded_until_repaired():
    # 10 iterations of 1 s, a 0.5 s checkpoint after every 5; a failure 2.5 s in: iteration 3 (0.5 s of it) is lost,
    # 1 s to reconfigure, then iterations at 2 s each until the capacity returns 4 s later (at t = 7.5).
    run = LongRun(1.0, 10, 5, CheckpointCost(1, 0.5, 0.0, 0.0), 1e9, 3.0, ONE_CAUSE)
    policy = Recovery("drop-replica", (2.0,), reconfigure_s=1.0, repair_s=4.0)
    result = simulate_recovery(run, policy, ScriptedFailures([2.5]))
    # t = 3.5: iterations 3 and 4 at 2 s end at 7.5; the 5th completes at 8.5 (back to 1 s: capacity returned at 7.5),
    # then its checkpoint (0.5), iterations 6-10 (5 s) and their checkpoint (0.5): 14.5 s.
    assert result.wall_s == pytest.approx(2.5 + 1.0 + 4.0 + 1.0 + 0.5 + 5.0 + 0.5)
    assert (result.lost_work_s, result.degraded_s, result.restart_s) == pytest.approx((0.5, 2.0, 1.0))
    parts = result.productive_s + result.lost_work_s + result.checkpoint_s + result.restart_s + result.degraded_s
    assert parts == pytest.approx(result.wall_s)


def test_beyond_what_it_tolerates_it_restarts_from_the_checkpoint():
    run = LongRun(1.0, 10, 5, CheckpointCost(1, 0.5, 0.0, 0.25), 1e9, 3.0, ONE_CAUSE)
    one = Recovery("drop-replica", (2.0,), reconfigure_s=1.0, repair_s=100.0)
    # First failure at 6.0 (after the checkpoint at 5.5): absorbed, degraded from 7.0. Second 1.0 later: restart from
    # iteration 5 (3 s + 0.25 s load), the degraded iteration in flight lost with nothing else.
    result = simulate_recovery(run, one, ScriptedFailures([6.0, 1.0]))
    assert [f.down_s for f in result.failures] == [1.0, 3.25]
    assert result.checkpoints == 2 and result.productive_s == 10.0


def test_restart_is_the_baseline_simulation():
    run = LongRun(5.0, 5000, 50, CheckpointCost(1, 4.0, 0.0, 4.0), 3600.0, 120.0, builtin_mix())
    assert simulate_recovery(run, RESTART, np.random.default_rng(3)) == simulate_long_run(run, np.random.default_rng(3))


def test_the_policies_slowdowns_are_their_closed_forms():
    assert drop_replica(4, reconfigure_s=1.0).slowdowns == (4 / 3, 2.0, 4.0)
    assert oobleck(64, 8, reconfigure_s=1.0).slowdowns == (64 / 56, 64 / 48, 64 / 40, 64 / 32)
    assert recycle(1.1, 3, reconfigure_s=1.0).slowdowns == pytest.approx((1.1, 1.21))


@pytest.mark.parametrize("policy", [drop_replica(16, reconfigure_s=60.0), oobleck(128, 8, reconfigure_s=60.0)])
def test_a_seeded_run_under_a_continuing_policy_adds_up_and_beats_restarting(policy):
    run = LongRun(10.0, 20_000, 100, CheckpointCost(1, 5.0, 0.0, 5.0), 2 * 3600.0, 600.0, builtin_mix())
    continuing = simulate_recovery(run, policy, np.random.default_rng(1))
    restarting = simulate_recovery(run, RESTART, np.random.default_rng(1))
    parts = (continuing.productive_s + continuing.lost_work_s + continuing.checkpoint_s + continuing.restart_s
             + continuing.degraded_s)
    assert parts == pytest.approx(continuing.wall_s, rel=1e-12)
    assert continuing.failure_count > 10 and continuing.wall_s < restarting.wall_s
