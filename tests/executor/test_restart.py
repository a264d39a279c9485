"""Crash and come back (``executor.run --max-restarts R``, ``--fail RANK@ITERATION``): a rank killed while writing a
checkpoint (``--inject-failure RANK:checkpoint@ITERATION``) leaves it torn; the whole group restarts from the
checkpoint before, the run ends bitwise where an uninterrupted one does, and the outputs say which rank died and what
the restart cost; without restarts a kill (``--fail``) is the run's error."""

import json

import pytest
import torch

from sim.ir.plan import Plan
from tests.executor.runs import execute, merged_state, refused, sim_plan

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--no-gantt", "--threads", "1", "--warmup", "1", "--iterations", "4", "--optimizer", "adam"]


def test_a_rank_killed_while_writing_a_checkpoint_comes_back_from_the_one_before(tmp_path):
    plan_path = sim_plan(tmp_path / "sim", 2, 2)
    plan = Plan.loads(plan_path.read_text())
    (tmp_path / "tmp").mkdir()
    whole = execute(plan_path, tmp_path / "whole", *RUN, "--save-state", str(tmp_path / "whole-state"))
    assert whole.returncode == 0, whole.stderr
    # A 1F1B pipeline with Adam, a checkpoint after iterations 2 and 4 of 5; rank 1 kills itself (SIGKILL) halfway
    # through writing its shard of the second: that checkpoint is torn (no marker), the one after 2 is whole, and the
    # group comes back from it.
    crashed = execute(plan_path, tmp_path / "crashed", *RUN, "--checkpoint-every", "2", "--checkpoint-dir",
                      str(tmp_path / "checkpoints"), "--max-restarts", "1", "--inject-failure", "1:checkpoint@4",
                      "--save-state", str(tmp_path / "crashed-state"), env={"TMPDIR": str(tmp_path / "tmp")})
    assert crashed.returncode == 0, crashed.stderr
    # Both attempts' scratch (failure records, torch's per-worker folders) is gone with the run, not left in /tmp.
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "restarting every rank (restart 1 of at most 1) after: rank 1 was killed by signal 9" in crashed.stdout
    restarts = json.loads((tmp_path / "crashed" / "metrics.json").read_text())["restarts"]
    assert restarts["count"] == 1 and restarts["resumed_after_iteration"] == 2 and restarts["restart_s"] > 0
    assert restarts["checkpoint_mean_s"] > 0 and restarts["run_wall_s"] > restarts["restart_s"]
    assert "restarted 1 time(s): rank 1 was killed by signal 9 (SIGKILL); resumed after iteration 2" in crashed.stdout
    first = merged_state(tmp_path / "whole-state", plan.num_vstages)
    again = merged_state(tmp_path / "crashed-state", plan.num_vstages)
    assert sorted(first) == sorted(again) and all(torch.equal(again[k], v) for k, v in first.items())


def test_without_restarts_the_kill_is_the_runs_error(tmp_path):
    plan_path = sim_plan(tmp_path / "sim", 2, 2)
    died = execute(plan_path, tmp_path / "died", *RUN, "--fail", "0@1")
    assert died.returncode == 1 and died.stderr.strip() == "error: rank 0 was killed by signal 9 (SIGKILL)", \
        died.stderr


@pytest.mark.parametrize("extra, message", [
    (["--fail", "1@9"], "the run starts iterations 0 to 4; name one of them"),
    (["--fail", "7@1"], "the rank must be 0..1"),
    (["--fail", "x"], "--fail takes RANK@ITERATION"),
    (["--max-restarts", "11"], "--max-restarts must be 0 to 10"),
])
def test_bad_restart_flags_are_refused_before_launch(tmp_path, capsys, extra, message):
    plan_path = sim_plan(tmp_path / "sim", 2, 2)
    assert message in refused(capsys, plan_path, tmp_path / "out", "--warmup", "1", "--iterations", "4", *extra)


def test_a_fresh_run_with_restarts_refuses_a_folder_of_old_checkpoints(tmp_path, capsys):
    from executor.checkpoint import complete

    plan_path = sim_plan(tmp_path / "sim", 2, 2)
    (tmp_path / "checkpoints" / "step-000000001").mkdir(parents=True)
    complete(tmp_path / "checkpoints", 1, {"plan_sha256": "another run's"})  # a complete checkpoint, as written
    message = refused(capsys, plan_path, tmp_path / "out", "--checkpoint-every", "1", "--checkpoint-dir",
                      str(tmp_path / "checkpoints"), "--max-restarts", "1")
    assert "already holds a complete checkpoint" in message
