"""``executor.run`` end to end on CPU with gloo: pipeline training equals single-process training, the outputs,
failure handling and input errors. Each case launches real worker processes through torch's elastic launcher."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from executor.reference import train_reference
from executor.run import main as executor_main
from sim.ir import Plan
from sim.run import main as sim_main
from sim.viz.chrome_trace import read_chrome_trace

SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50"  # 4 layers: embed, 2 blocks, head
ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path, schedule, ranks, m=4, model=SPEC):
    out = tmp_path / f"sim-{schedule}-{ranks}"
    assert sim_main(["--topology", f"{ranks}xcpu", "--model", model, "--schedule", schedule, "-m", str(m),
                     "--partition", "uniform", "--no-gantt", "--out", str(out)]) == 0
    return out / "plan.json"


def _execute(plan, out, *extra, env=None, timeout=180):
    command = [sys.executable, "-m", "executor.run", "--plan", str(plan), "--out", str(out), *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# SGD's update is linear in the gradient, so the only difference from single-process training is the order in which
# microbatch gradients are summed (GPipe runs its backwards in another order): ~1e-9 here. Adam divides by the
# root of the second moment, which turns round-off in a gradient that is zero in exact arithmetic (the key bias of
# attention cannot change the softmax) into steps of size lr; its tolerance is therefore a small fraction of lr.
CASES = [("gpipe", 2, "sgd", 1e-7), ("1f1b", 2, "sgd", 1e-7), ("gpipe", 4, "sgd", 1e-7), ("1f1b", 4, "sgd", 1e-7),
         ("1f1b", 2, "adam", 1e-5)]


@pytest.mark.parametrize("schedule,ranks,optimizer,atol", CASES)
def test_pipeline_training_equals_single_process_training(tmp_path, schedule, ranks, optimizer, atol):
    m, warmup, iterations = 4, 1, 2
    plan = _plan(tmp_path, schedule, ranks, m)
    out, state = tmp_path / "real", tmp_path / "state"
    result = _execute(plan, out, "--warmup", str(warmup), "--iterations", str(iterations), "--optimizer", optimizer,
                      "--save-state", str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    reference = train_reference(SPEC, steps=warmup + iterations, num_microbatches=m, microbatch_size=1,
                                optimizer=optimizer)
    merged = {}
    for v in range(ranks):
        merged.update(torch.load(state / f"stage{v}.pt"))
    assert sorted(merged) == sorted(reference.state)
    initial = train_reference(SPEC, steps=0, num_microbatches=m, microbatch_size=1).state
    for key, value in reference.state.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=atol, msg=key)
    moved = max((reference.state[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * atol  # the tolerance is far below how far training moved the weights
    metrics = json.loads((out / "metrics.json").read_text())
    losses = metrics["measurement"]["losses"]
    assert len(losses) == warmup + iterations
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)
    assert losses[-1] != losses[0]  # training moved the weights

    trace = read_chrome_trace(out / "trace.json")  # the simulator's reader
    assert trace.meta["source"] == "executor" and trace.num_ranks == ranks
    plan_obj = Plan.loads(plan.read_text())
    assert sorted(s.op for s in trace.spans) == sorted(op.id for program in plan_obj.programs for op in program)
    compare = json.loads((out / "compare.json").read_text())
    times = metrics["measurement"]["iteration_times_s"]
    assert len(times) == warmup + iterations
    assert compare["measured_iteration_time_s"] == pytest.approx(statistics.median(times[warmup:]))
    assert compare["relative_error"] == pytest.approx(
        (compare["measured_iteration_time_s"] - compare["predicted_iteration_time_s"])
        / compare["measured_iteration_time_s"])
    assert compare["ops"]["F"]["count"] == m * ranks
    assert metrics["iteration_time_s"] == pytest.approx(trace.makespan)


def _worker_processes(marker):
    """PIDs of live processes whose command line mentions ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "executor.run" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_failing_rank_stops_every_rank_with_its_error_and_op(tmp_path):
    plan = _plan(tmp_path, "1f1b", 2, m=4)
    out = tmp_path / "failing-run"
    start = time.monotonic()
    result = _execute(plan, out, "--inject-failure", "1:1B1", "--iterations", "2", "--no-gantt", timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "error: rank 1 failed at op 1B1" in result.stderr and "injected failure" in result.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s to stop"
    assert not (out / "metrics.json").exists() and not (out / "compare.json").exists()
    time.sleep(0.5)
    assert _worker_processes(str(out)) == [], "worker processes outlived the run"


def test_rank_zero_failure_is_reported_too(tmp_path):
    plan = _plan(tmp_path, "gpipe", 2, m=2)
    result = _execute(plan, tmp_path / "r0", "--inject-failure", "0:0F1", "--iterations", "1", "--no-gantt")
    assert result.returncode == 1 and "error: rank 0 failed at op 0F1" in result.stderr


def _run_in_process(capsys, argv):
    """``executor.run`` in this process (no launch happens on these paths): (status, stderr)."""
    with pytest.raises(SystemExit) as info:
        executor_main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--inject-failure", "5:1B0"], "the rank must be 0..1"),
    (["--inject-failure", "1:0B0"], "rank 1 has no op '0B0'"),
    (["--backend", "nccl"], "nccl needs CUDA"),
    (["--backend", "mpi"], "invalid choice"),
])
def test_bad_options_are_rejected_before_launch(tmp_path, capsys, extra, message):
    if extra[:2] == ["--backend", "nccl"] and torch.cuda.is_available():
        pytest.skip("this host has CUDA, so nccl is a valid choice")
    plan = _plan(tmp_path, "1f1b", 2, m=2)
    capsys.readouterr()
    status, err = _run_in_process(capsys, ["--plan", str(plan), "--out", str(tmp_path / "out"), *extra])
    assert status == 2
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_plan_with_a_model_without_torch_modules_is_rejected(tmp_path, capsys):
    plan = _plan(tmp_path, "1f1b", 2, m=2, model="uniform:layers=4")
    capsys.readouterr()
    status, err = _run_in_process(capsys, ["--plan", str(plan), "--out", str(tmp_path / "out")])
    assert status == 2 and "no torch implementation" in err


def test_missing_or_corrupt_plan_is_rejected(tmp_path, capsys):
    status, err = _run_in_process(capsys, ["--plan", str(tmp_path / "nope.json"), "--out", str(tmp_path / "out")])
    assert status == 2 and err.startswith("error: ") and "nope.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, err = _run_in_process(capsys, ["--plan", str(bad), "--out", str(tmp_path / "out")])
    assert status == 2 and "not valid JSON" in err


def test_world_size_that_does_not_fit_the_plan_is_rejected(tmp_path):
    # As if a user's torchrun started 3 processes for a 2-rank plan: each worker refuses before joining the group.
    plan = _plan(tmp_path, "1f1b", 2, m=2)
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}
    result = _execute(plan, tmp_path / "out", env=env, timeout=60)
    assert result.returncode == 2
    assert "has 2 ranks but the launcher started 3" in result.stderr and "Traceback" not in result.stderr
