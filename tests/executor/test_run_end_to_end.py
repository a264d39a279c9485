"""``executor.run`` end to end, the parts ``test_run`` leaves out: a calibrated profile fed back to the simulator, a
launch by the user's own ``torchrun``, the cnn model, the default thread count, op names in the PyTorch profiler,
and plan errors at the command line."""

import json
import os
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from executor.options import host_cores
from executor.reference import train_reference
from sim.cost.oracle import CostOracle
from sim.cost.profile import load_profile
from sim.hw.catalog import get_device
from sim.ir.plan import SEND_KINDS, OpKind, Plan
from sim.models import build_model
from sim.report.chrome_trace import read_chrome_trace
from sim.run import main as sim_main
from tests.executor.runs import (
    ROOT,
    SPEC,
    assert_state_equals,
    built_plan,
    edited_plan,
    execute,
    merged_state,
    run_single_rank,
    sim_plan,
)

CNN = "cnn:features=4,kernel=3,layers=4,size=8"  # 4 conv layers: 2 per rank
RANKS, M = 2, 4


def _plan(tmp_path, schedule, ranks, m, model=SPEC):
    return sim_plan(tmp_path / f"sim-{schedule}-{ranks}", ranks, m, "--schedule", schedule, model=model)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """One launch by ``executor.run`` itself of a 2-rank 1F1B plan of :data:`SPEC`: one warm-up and one measured
    iteration (so ``trace.json`` is the only measured iteration and the calibration's medians can be recomputed from
    it), SGD, default threads, ``--save-state`` and ``--calibrate-out``."""
    tmp = tmp_path_factory.mktemp("local")
    plan = _plan(tmp, "1f1b", RANKS, M)
    out, state, calibrated = tmp / "real", tmp / "state", tmp / "calibrated.json"
    result = execute(plan, out, "--warmup", "1", "--iterations", "1", "--optimizer", "sgd", "--save-state",
                     str(state), "--calibrate-out", str(calibrated), "--no-gantt")
    assert result.returncode == 0, result.stderr
    return SimpleNamespace(tmp=tmp, plan=plan, out=out, state=state, calibrated=calibrated, stderr=result.stderr,
                           metrics=json.loads((out / "metrics.json").read_text()))


def _durations(trace, kind: str) -> dict[int, list[float]]:
    """vstage → durations in s of the spans of ``kind``."""
    found: dict[int, list[float]] = {}
    for span in trace.spans:
        if span.kind == kind:
            found.setdefault(span.vstage, []).append(span.duration)
    return found


def test_a_calibrated_profile_is_the_runs_stage_medians_and_drives_the_simulator(local_run):
    graph = build_model(SPEC)
    plan = Plan.loads(local_run.plan.read_text())
    profile = load_profile(local_run.calibrated)  # the simulator's reader accepts it
    data = json.loads(local_run.calibrated.read_text())
    assert profile.model == graph.spec and profile.device == "cpu" and profile.microbatch_size == 1
    assert [t.name for t in profile.layers] == [layer.name for layer in graph.layers]
    assert all(t.fwd_s > 0 and t.bwd_s > 0 and t.opt_s > 0 for t in profile.layers)
    assert data["software"]["torch"] == torch.__version__ and data["software"]["python"]
    assert data["machine"]["cores"] == host_cores()
    assert data["date"].endswith("Z") and data["date"][:2] == "20"
    fitted = "latency_s" in data.get("p2p", {})  # finish.py keeps the sweep but no fit when it is too noisy
    if fitted:
        assert data["p2p"]["latency_s"] >= 0 and data["p2p"]["bandwidth_bytes_per_s"] > 0
        assert (profile.p2p_latency_s, profile.p2p_bandwidth) == (data["p2p"]["latency_s"],
                                                                  data["p2p"]["bandwidth_bytes_per_s"])
    else:  # ... and says so; the simulator then keeps the link model
        assert "no point-to-point fit" in local_run.stderr
        assert profile.p2p_latency_s is None and profile.p2p_bandwidth is None

    # The oracle is the run's own trace: with one measured iteration, trace.json holds every span the calibration
    # saw, so each stage's layer times must add up to that stage's median F and B and its one OPT_STEP.
    measured = read_chrome_trace(local_run.out / "trace.json")
    # ... plus the executor's time between two ops of a rank that did not wait for a receive in between: the median
    # of those gaps (calibration.dispatch_time), recomputed here from the trace.
    gaps = []
    for rank in range(RANKS):
        ops = sorted((s for s in measured.spans if s.rank == rank and s.stream == "compute"), key=lambda s: s.start)
        received = [s.end for s in measured.spans if s.rank == rank and s.kind.startswith("RECV")]
        gaps += [b.start - a.end for a, b in zip(ops, ops[1:]) if not any(a.end < e <= b.start for e in received)]
    dispatch = statistics.median(gaps)
    assert data["method"]["dispatch_s"] == pytest.approx(dispatch, rel=1e-6, abs=1e-9)
    prior = CostOracle(graph, 1).layer_costs(get_device("cpu"))  # the plan was simulated with roofline costs
    for kind, field, prior_times in (("F", "fwd_s", prior.fwd), ("B", "bwd_s", prior.bwd),
                                     ("OPT_STEP", "opt_s", prior.opt)):
        spans = _durations(measured, kind)
        for v, (start, end) in enumerate(plan.placement.vstage_layers):
            layer_times = [getattr(t, field) for t in profile.layers[start:end]]
            assert sum(layer_times) == pytest.approx(statistics.median(spans[v]) + dispatch, rel=1e-6), (kind, v)
            # ... split over the stage's layers in proportion to the prior (calibration.calibrated_profile).
            shares = [t / sum(layer_times) for t in layer_times]
            assert shares == pytest.approx([p / sum(prior_times[start:end]) for p in prior_times[start:end]])
    compare = json.loads((local_run.out / "compare.json").read_text())
    all_f = [d for durations in _durations(measured, "F").values() for d in durations]
    assert compare["ops"]["F"]["measured_mean_s"] == pytest.approx(statistics.fmean(all_f), rel=1e-9)

    # sim.run with the profile: the plan records it, and every simulated F and B lasts what the profile says.
    sim_out = local_run.tmp / "sim-calibrated"
    assert sim_main(["--topology", f"{RANKS}xcpu", "--model", SPEC, "--schedule", "1f1b", "-m", str(M),
                     "--partition", "uniform", "--profile", str(local_run.calibrated), "--no-gantt",
                     "--out", str(sim_out)]) == 0
    assert Plan.loads((sim_out / "plan.json").read_text()).option("profile") == str(local_run.calibrated)
    simulated = read_chrome_trace(sim_out / "trace.json")
    for kind, field in (("F", "fwd_s"), ("B", "bwd_s")):
        for v, durations in _durations(simulated, kind).items():
            start, end = plan.placement.vstage_layers[v]
            stage = sum(getattr(t, field) for t in profile.layers[start:end])
            assert durations == pytest.approx([stage] * len(durations), rel=1e-9), (kind, v)
    if fitted:  # the first activation sent meets an idle link: latency + bytes / bandwidth exactly
        first_send = min((s for s in simulated.spans if s.kind == "SEND_F"), key=lambda s: s.start)
        nbytes = graph.boundary_bytes(plan.placement.vstage_layers[0][1])
        assert first_send.duration == pytest.approx(profile.p2p_latency_s + nbytes / profile.p2p_bandwidth)


def test_default_threads_are_the_hosts_cores_shared_by_its_ranks(local_run):
    # executor.rank_process: without --threads, each rank gets host_cores() // ranks on the host, at least one.
    expected = max(1, host_cores() // RANKS)
    assert local_run.metrics["measurement"]["threads_per_rank"] == [expected] * RANKS


def test_a_launch_by_torchrun_itself_trains_like_the_local_launch(local_run):
    out, state = local_run.tmp / "torchrun", local_run.tmp / "torchrun-state"
    # No warm-up and two measured iterations train on the same two batches as the local run's 1 + 1.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "-m", "executor.run", "--plan", str(local_run.plan), "--out", str(out), "--iterations", "2",
               "--warmup", "0", "--optimizer", "sgd", "--save-state", str(state), "--no-gantt"]
    # torchrun's own agent keeps its per-worker folders in the temporary directory and leaves them there (our
    # launcher gives it one it removes): a temporary directory of the test's own keeps the machine's clean.
    scratch = local_run.tmp / "torchrun-tmp"
    scratch.mkdir()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stderr
    for name in ("trace.json", "metrics.json", "compare.json"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["measurement"]["losses"] == local_run.metrics["measurement"]["losses"]
    assert metrics["measurement"]["threads_per_rank"] == local_run.metrics["measurement"]["threads_per_rank"]
    theirs, ours = merged_state(state, RANKS), merged_state(local_run.state, RANKS)
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key  # same ops in the same order: bit for bit
    assert read_chrome_trace(out / "trace.json").meta["source"] == "executor"


def test_ranks_started_as_fresh_interpreters_train_like_forked_ones(local_run):
    # The NCCL backend starts its ranks as fresh interpreters (executor.launch's "exec": CUDA cannot live in a fork);
    # on gloo the same start, through the launcher's rendezvous file, trains bit for bit as the forked ranks did.
    out, state = local_run.tmp / "exec", local_run.tmp / "exec-state"
    launcher = ("import sys; from executor.launch import run_ranks; "
                f"sys.exit(run_ranks('executor.run', sys.argv[1:], {RANKS}, errors_log=None, start='exec'))")
    command = [sys.executable, "-c", launcher, "--plan", str(local_run.plan), "--out", str(out), "--iterations", "2",
               "--warmup", "0", "--optimizer", "sgd", "--save-state", str(state), "--no-gantt", "--backend", "gloo"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["measurement"]["losses"] == local_run.metrics["measurement"]["losses"]
    theirs, ours = merged_state(state, RANKS), merged_state(local_run.state, RANKS)
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key


def test_cnn_pipeline_training_equals_single_process_training(tmp_path):
    plan = _plan(tmp_path, "1f1b", RANKS, M, model=CNN)
    out, state = tmp_path / "real", tmp_path / "state"
    result = execute(plan, out, "--warmup", "1", "--iterations", "1", "--optimizer", "sgd", "--save-state",
                     str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    # SGD is linear in the gradient: only the order of the microbatch sums differs from one process (see test_run).
    atol = 1e-7
    reference = train_reference(CNN, steps=2, num_microbatches=M, microbatch_size=1, optimizer="sgd")
    assert_state_equals(merged_state(state, RANKS), reference.state, spec=CNN, atol=atol)
    losses = json.loads((out / "metrics.json").read_text())["measurement"]["losses"]
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)


def test_every_op_is_a_profiler_event_named_by_its_op_id(tmp_path, one_thread):
    # One rank in a one-process gloo group, as a worker runs it; the program has only compute ops and OPT_STEP.
    plan = built_plan(m=3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            run_single_rank(plan, steps=1, optimizer="sgd")
    finally:
        dist.destroy_process_group()
    names = [event.name for event in profiler.events()]
    op_ids = [op.id for op in plan.programs[0]]
    assert {OpKind(op.kind) for op in plan.programs[0]} >= {OpKind.F, OpKind.B, OpKind.OPT_STEP}
    assert not any(op.kind in SEND_KINDS for op in plan.programs[0])
    for op_id in op_ids:
        assert names.count(op_id) == 1, op_id  # one record_function range per op per iteration


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["ranks"][0][0].update(op="0ZZZ0"), "0ZZZ0"),  # an op kind that does not exist
    (lambda d: d.update(model="nosuch:layers=4"), "nosuch"),  # a model that does not exist
], ids=["unknown-op-kind", "unknown-model"])
def test_a_plan_with_an_unknown_op_kind_or_model_is_one_error_line_and_status_2(tmp_path, edit, message):
    plan = edited_plan(_plan(tmp_path, "1f1b", RANKS, 2), tmp_path / "edited.json", edit)
    out = tmp_path / "out"
    result = execute(plan, out, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not out.exists()
