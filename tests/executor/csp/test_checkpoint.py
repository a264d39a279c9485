"""Checkpoints of a CSP run (``executor.run --checkpoint-every K`` on a csp plan: K subnets, the pipeline drained at
each): a run whose rank is killed between checkpoints comes back on its own (``--max-restarts``) and a run resumed
by hand (``--resume``) from an older checkpoint both end bitwise where the one-process reference does, with context
switching under a device budget that forces write-backs. Oracle: ``executor.run --reference`` (the same 12 subnets
trained one by one)."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.executor.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_restarted_and_a_resumed_csp_run_end_bitwise_at_the_reference(tmp_path, csp_run, csp_reference):
    checkpoints = tmp_path / "checkpoints"
    # Rank 1 dies before its forward of subnet 9; the checkpoint after subnet 8 is the newest complete one.
    run = csp_run(tmp_path / "restarted", 2, "--device-param-budget", "60KB", "--prefetch", "predict",
                  run_flags=("--no-gantt", "--checkpoint-every", "4", "--checkpoint-dir", str(checkpoints),
                             "--max-restarts", "1", "--fail", "1@9"))
    assert run["final_params_sha256"] == csp_reference["final_params_sha256"]
    assert run["losses"] == csp_reference["losses"]  # all 12: the first 8 come from the checkpoint
    restarts = run["restarts"]
    assert restarts["count"] == 1 and restarts["resumed_after_iteration"] == 8
    assert restarts["iterations_computed_again"] == 1 and restarts["restart_s"] > 0
    assert "before subnet 9" in restarts["failures"][0]["message"]
    assert run["resumed_at_subnet"] == 8 and run["checkpoints"]["every_subnets"] == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000008", "step-000000012"]
    assert sorted(run["forward_order_per_stage"][1]) == [8, 9, 10, 11]  # the second attempt's forwards

    # As if the run had died before its last checkpoint: continue from subnet 8 by hand, checkpointing no more.
    shutil.rmtree(checkpoints / "step-000000012")
    plan = tmp_path / "restarted-plan" / "plan.json"
    resumed = subprocess.run([sys.executable, "-m", "executor.run", "--plan", str(plan), "--out",
                              str(tmp_path / "resumed"), "--no-gantt", "--resume", str(checkpoints)], cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after subnet 8" in resumed.stdout
    again = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert again["final_params_sha256"] == csp_reference["final_params_sha256"]
    assert again["losses"] == csp_reference["losses"]


@pytest.mark.parametrize("flags, message", [
    (["--fail", "0@4", "--max-restarts", "1"], "--fail 0@4: the run starts subnets 0 to 3"),
    (["--checkpoint-every", "2", "--checkpoint-dir", "c", "--inject-failure", "1:checkpoint@3"],
     "SUBNET must be one after which a checkpoint is written"),
    (["--inject-failure", "1:1F0"], "RANK:checkpoint@SUBNET applies"),
], ids=["fail-past-the-end", "torn-at-no-checkpoint", "fixed-op"])
def test_csp_fault_flags_are_checked_in_subnets_before_launch(tmp_path, capsys, csp_plan, flags, message):
    from executor.run import main as executor_main

    with pytest.raises(SystemExit) as info:
        executor_main(["--plan", str(csp_plan), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert not (tmp_path / "o").exists()
