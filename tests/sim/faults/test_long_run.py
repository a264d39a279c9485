"""The long run with failures: exact small runs with scripted failure times, its time adding up, Daly's expected
wall time as the oracle of its mean, closed forms without failures, seeds, and a run that cannot finish."""

import math

import numpy as np
import pytest

from sim.core.errors import SpecError
from sim.faults.checkpoint import CheckpointCost
from sim.faults.failure_mix import FailureCause, FailureMix
from sim.faults.interval import expected_wall_time
from sim.faults.long_run import LongRun, ScriptedFailures, expected_long_run, simulate_long_run

ONE_CAUSE = FailureMix("test", (FailureCause("any", "test", 1),))


def _sync(blocking, load=0.0):
    return CheckpointCost(1, blocking, 0.0, load)


def test_a_scripted_run_loses_the_work_since_the_last_checkpoint_and_restarts():
    # 10 iterations of 1 s, a checkpoint of 1 s after every 5, restart 2 s + load 0.5 s.
    run = LongRun(1.0, 10, 5, _sync(1.0, load=0.5), 100.0, 2.0, ONE_CAUSE)
    # Segment 1 (6 s) survives a draw of 8 (2 s left); segment 2 fails 2 s in, at t = 8: 2 s of work lost; the restart
    # (2.5 s) survives a draw of 50; segment 2 again survives a draw of 7.
    result = simulate_long_run(run, ScriptedFailures([8.0, 50.0, 7.0]))
    assert [f.time_s for f in result.failures] == [8.0] and result.failures[0].lost_s == 2.0
    assert result.wall_s == 6.0 + 2.0 + 2.5 + 6.0
    assert (result.productive_s, result.lost_work_s, result.checkpoint_s, result.restart_s) == (10.0, 2.0, 2.0, 2.5)
    assert result.checkpoints == 2


def test_a_failure_during_a_restart_starts_it_over_and_one_during_a_checkpoint_loses_the_segment():
    run = LongRun(1.0, 4, 2, _sync(1.0), 100.0, 3.0, ONE_CAUSE)
    # Segment 1 (3 s) fails 2.5 s in, inside its checkpoint: 2 s of work and 0.5 s of checkpoint lost. The restart
    # (3 s) fails 1 s in and starts over (draw 9 survives). Then two segments survive.
    result = simulate_long_run(run, ScriptedFailures([2.5, 1.0, 9.0, 10.0, 10.0]))
    assert [(f.time_s, f.during_restart, f.down_s) for f in result.failures] == [(2.5, False, 1.0), (3.5, True, 3.0)]
    assert result.wall_s == 2.5 + 1.0 + 3.0 + 3.0 + 3.0
    assert (result.lost_work_s, result.checkpoint_s, result.restart_s) == (2.0, 2.5, 4.0)


def test_an_asynchronous_checkpoint_is_lost_when_a_failure_strikes_before_it_is_durable():
    # Checkpoints stall 0.5 s and are durable 3 s later; 2 iterations of 1 s between them.
    run = LongRun(1.0, 4, 2, CheckpointCost(1, 0.5, 3.0, 0.0), 100.0, 1.0, ONE_CAUSE)
    # The first failure is drawn 4 s away. Segment 1 ends at 2.5 (its checkpoint durable at 5.5); segment 2 would
    # stall until 5.5 before its snapshot, but the failure strikes at 4: checkpoint 1 was not durable yet, so the
    # 2 s of segment 1 are lost with the 1.5 s of segment 2. Nothing fails afterwards.
    result = simulate_long_run(run, ScriptedFailures([4.0, 50.0, 50.0]))
    assert result.failures[0].time_s == 4.0 and result.failures[0].lost_s == 2.0 + 1.5
    assert result.checkpoints == 2 and result.productive_s == 4.0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_parts_add_up_to_the_wall_time(asynchronous):
    cost = CheckpointCost(1, 2.0, 30.0 if asynchronous else 0.0, 5.0)
    mix = FailureMix("two", (FailureCause("a", "x", 3), FailureCause("b", "y", 1, repair_s=120.0)))
    run = LongRun(10.0, 5000, 20, cost, 3 * 3600.0, 300.0, mix)
    result = simulate_long_run(run, np.random.default_rng(7))
    assert len(result.failures) > 5
    parts = result.productive_s + result.lost_work_s + result.checkpoint_s + result.restart_s
    assert parts == pytest.approx(result.wall_s, rel=1e-12)
    assert result.productive_s == 5000 * 10.0 and result.lost_work_s > 0
    # cause b's failures each cost the restart, its repair and the load (the last one's may be cut by another failure)
    b_down = [f.down_s for f in result.failures if f.cause == 1]
    assert b_down and max(b_down) == pytest.approx(300.0 + 120.0 + 5.0)


@pytest.mark.parametrize("interval_min", [20, 57, 150])
def test_the_mean_of_seeded_runs_is_dalys_expected_wall_time(interval_min):
    # Daly's model: checkpoint 5 min, restart 10 min (load included), MTBF 6 h; 160 segments per run.
    mtbf, checkpoint, restart, step = 6 * 3600.0, 300.0, 600.0, 60.0
    every = interval_min
    run = LongRun(step, 160 * every, every, _sync(checkpoint), mtbf, restart, ONE_CAUSE)
    walls = [simulate_long_run(run, np.random.default_rng([3, t])).wall_s for t in range(300)]
    exact = expected_wall_time(run.iterations * step, every * step, checkpoint, restart, mtbf)
    error = np.std(walls) / math.sqrt(len(walls))
    assert abs(np.mean(walls) - exact) < 4 * error, (np.mean(walls), exact, error)
    mean = expected_long_run(run, trials=300, seed=3)
    assert mean.wall_s == pytest.approx(np.mean(walls), rel=1e-12)


def test_without_failures_the_run_is_its_iterations_and_checkpoints():
    never = 1e18
    sync = LongRun(2.0, 100, 10, _sync(3.0), never, 60.0, ONE_CAUSE)
    assert simulate_long_run(sync, np.random.default_rng(0)).wall_s == 100 * 2.0 + 10 * 3.0
    # Asynchronous, the persist (25 s) longer than a batch (20 s): every snapshot after the first waits for the
    # previous persist, and the run ends when the last one is durable: (20 + 1) + 9 (25 + 1) + 25.
    slow = LongRun(2.0, 100, 10, CheckpointCost(1, 1.0, 25.0, 0.0), never, 60.0, ONE_CAUSE)
    result = simulate_long_run(slow, np.random.default_rng(0))
    assert result.wall_s == pytest.approx(21.0 + 9 * 26.0 + 25.0)
    assert result.checkpoints == 10


def test_the_same_seed_gives_the_same_run():
    run = LongRun(5.0, 20_000, 50, _sync(4.0), 3600.0, 120.0, ONE_CAUSE)
    first, again = (simulate_long_run(run, np.random.default_rng([1, 0])) for _ in range(2))
    assert first == again
    assert simulate_long_run(run, np.random.default_rng([2, 0])) != first


def test_a_run_whose_failures_outpace_its_checkpoints_is_refused():
    run = LongRun(10.0, 1000, 0, _sync(1.0), 60.0, 5.0, ONE_CAUSE)  # no checkpoint, a failure every minute
    with pytest.raises(SpecError, match="failures come too often"):
        simulate_long_run(run, np.random.default_rng(0))
