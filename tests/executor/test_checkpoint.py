"""Checkpoint and resume (``executor.run --checkpoint-every K --checkpoint-dir DIR``, ``--resume DIR``): a run resumed
from a checkpoint ends with parameters bitwise equal to the run that was never interrupted, across schedules and
DP/ZeRO/EP plans and a PARTIME stream; a checkpoint of another run is refused before launch. (A rank killed while
writing its shard, and the restart from the checkpoint before: ``tests/executor/test_restart.py``.)

Each case runs once uninterrupted with checkpoints after iterations 2 and 4 of 4, then the newest checkpoint is
deleted, as if the run had died after its fourth iteration but before that checkpoint, and a second run resumes
from the one after iteration 2 and runs the rest. The oracle is the uninterrupted run's own final state.
"""

import json
import shutil

import pytest
import torch

from sim.ir.plan import Plan
from sim.run import main as sim_main
from tests.executor.runs import SPEC, execute, merged_state, refused, sim_plan

# The reference and workers use one intra-op thread (a CPU kernel's sums may depend on it).
pytestmark = pytest.mark.usefixtures("one_thread")

MOE = ("moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16,"
       "shared_experts=1")
STREAM_MODEL = "cnn:layers=4,features=4,kernel=3,size=16"

# name, ranks, sim.run flags, model, executor flags
CASES = [
    # FSDP (ZeRO-3), whose parameters are the optimizer's shards; a mixture under EP 2 × DP 2 with ZeRO-1 (dense and
    # expert slices) and a split backward; a PARTIME stream, which updates after every backward and continues its
    # video where the checkpoint left it. (A 1F1B pipeline with Adam resumes in tests/executor/test_restart.py.)
    ("dp2-zero3-adam", 2, ["--dp", "2", "--global-batch", "4", "--zero", "3"], SPEC, ["--optimizer", "adam"]),
    ("moe-dp2-ep2-zero1-zb1p", 2, ["--dp", "2", "--ep", "2", "--zero", "1", "--global-batch", "4", "--schedule",
                                   "zb1p"], MOE, ["--optimizer", "adam"]),
    ("stream", 2, ["-m", "4", "--schedule", "stream"], STREAM_MODEL, ["--optimizer", "sgd", "--lr", "0.05"]),
    # Zeno with a noisy Byzantine replica: the validation batches and the noise continue from the checkpoint's step.
    ("dp2-zeno-byzantine", 2, ["--dp", "2", "--global-batch", "4"], SPEC,
     ["--optimizer", "sgd", "--aggregate", "zeno:1", "--byzantine", "1:noise"]),
]


def _run(plan, out, *flags):
    result = execute(plan, out, "--no-gantt", "--threads", "1", *flags)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("name, ranks, sim_flags, model, flags", CASES, ids=[case[0] for case in CASES])
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(tmp_path, name, ranks, sim_flags, model, flags):
    assert sim_main(["--topology", f"{ranks}xcpu", "--model", model, "--partition", "uniform", "--no-gantt",
                     "--out", str(tmp_path / "sim"), *sim_flags]) == 0
    plan_path = tmp_path / "sim" / "plan.json"
    plan = Plan.loads(plan_path.read_text())
    checkpoints = tmp_path / "checkpoints"
    _run(plan_path, tmp_path / "whole", "--warmup", "1", "--iterations", "3", *flags, "--checkpoint-every", "2",
         "--checkpoint-dir", str(checkpoints), "--save-state", str(tmp_path / "whole-state"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000002", "step-000000004"]
    shutil.rmtree(checkpoints / "step-000000004")  # died before its last checkpoint
    resumed = _run(plan_path, tmp_path / "resumed", "--warmup", "1", "--iterations", "3", *flags, "--resume",
                   str(checkpoints), "--save-state", str(tmp_path / "resumed-state"))
    assert "0 warm-up + 2 measured iterations" in resumed.stdout, resumed.stdout
    whole = merged_state(tmp_path / "whole-state", plan.num_vstages)
    again = merged_state(tmp_path / "resumed-state", plan.num_vstages)
    assert sorted(whole) == sorted(again)
    for key, value in whole.items():
        assert torch.equal(again[key], value), key
    if plan.weight_policy != "stream":  # the last two iterations' losses are the same numbers too
        whole_losses = json.loads((tmp_path / "whole" / "metrics.json").read_text())["measurement"]["losses"]
        resumed_losses = json.loads((tmp_path / "resumed" / "metrics.json").read_text())["measurement"]["losses"]
        assert resumed_losses == whole_losses[-2:]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A 2-rank plan and a complete checkpoint of it after 2 iterations (adam, seeds 0), as executor.run marks one:
    what the refusals read is the marker (executor.checkpoint.latest), so no run is needed to make it."""
    from executor.checkpoint import complete, run_identity

    tmp = tmp_path_factory.mktemp("checkpointed")
    plan_path = sim_plan(tmp / "sim", 2, 2)
    plan = Plan.loads(plan_path.read_text())
    identity = run_identity(plan.dumps(), world_size=2, seed=0, data_seed=0, optimizer="adam", lr=None)
    (tmp / "checkpoints" / "step-000000002").mkdir(parents=True)
    complete(tmp / "checkpoints", 2, identity)
    return plan_path, tmp / "checkpoints"


@pytest.mark.parametrize("extra, message", [
    (["--optimizer", "sgd", "--iterations", "3"], "step-000000002 is of another run (optimizer 'adam' there, 'sgd'"),
    (["--seed", "1", "--iterations", "3"], "(seed 0 there, 1 here)"),
    (["--iterations", "2"], "has done 2 iterations, the run's total is 2"),
    (["--iterations", "3", "--checkpoint-dir", "x"], "--checkpoint-dir x without --checkpoint-every K writes nothing"),
], ids=["optimizer", "seed", "nothing-left", "dir-without-every"])
def test_a_resume_that_would_not_continue_the_same_run_is_refused_before_launch(tmp_path, capsys, checkpointed, extra,
                                                                                message):
    plan_path, checkpoints = checkpointed
    flags = ["--warmup", "0", "--optimizer", "adam", "--resume", str(checkpoints), *extra]
    assert message in refused(capsys, plan_path, tmp_path / "out", *flags)


def test_checkpoint_flags_are_checked_before_launch(tmp_path, capsys, checkpointed):
    plan_path, _ = checkpointed
    assert "--checkpoint-every 2 needs --checkpoint-dir" in refused(capsys, plan_path, tmp_path / "o",
                                                                    "--checkpoint-every", "2")
    assert "no complete checkpoint there" in refused(capsys, plan_path, tmp_path / "o", "--resume",
                                                     str(tmp_path))
    assert "a multiple of --checkpoint-every" in refused(capsys, plan_path, tmp_path / "o", "--checkpoint-every",
                                                         "2", "--checkpoint-dir", str(tmp_path / "c"),
                                                         "--inject-failure", "1:checkpoint@3")
