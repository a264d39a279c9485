"""``executor.run`` end to end on CPU with gloo: pipeline training equals single-process training, the outputs and
input errors (failures and the processes' lifecycle: ``test_lifecycle.py``). Most cases launch real worker processes
through the project's launcher; the input errors are caught before any launch."""

import json
import re

import pytest
import torch

from executor.backend import choose_backend
from executor.compare import median_iteration
from executor.reference import train_reference
from executor.run import check_output_path, load_checked_plan
from executor.run import main as executor_main
from sim.core.errors import SpecError
from sim.ir.plan import Plan
from sim.ir.schedule_csv import dumps_schedule_csv
from sim.report.chrome_trace import read_chrome_trace
from sim.run import main as sim_main
from sim.schedules import get_schedule
from tests.executor.runs import SPEC, assert_state_equals, edited_plan, execute, merged_state, sim_plan


def _plan(tmp_path, schedule, ranks, m=4, model=SPEC):
    return sim_plan(tmp_path / f"sim-{schedule}-{ranks}", ranks, m, "--schedule", schedule, model=model)


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
    result = execute(plan, out, "--warmup", str(warmup), "--iterations", str(iterations), "--optimizer", optimizer,
                      "--save-state", str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    reference = train_reference(SPEC, steps=warmup + iterations, num_microbatches=m, microbatch_size=1,
                                optimizer=optimizer)
    assert_state_equals(merged_state(state, ranks), reference.state, atol=atol)
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
    # An even number of measured iterations: one median everywhere, the lower middle one, a real iteration.
    index = metrics["measurement"]["iteration"]
    assert iterations % 2 == 0 and index >= warmup and times[index] == min(times[warmup:])
    median = compare["measured_iteration_time_s"]
    assert (index, median) == median_iteration(times, warmup)
    assert median == pytest.approx(times[index], rel=1e-12)
    assert metrics["measurement"]["median_iteration_time_s"] == median
    assert metrics["iteration_time_s"] == pytest.approx(median, rel=1e-12)
    assert compare["measured_statistic"] == metrics["measurement"]["statistic"]
    # The printed summary shows the same number (the spacing and wording around it are free to change).
    assert re.search(rf"iteration time\s+{median * 1e3:.3f} ms", result.stdout)
    assert re.search(rf"measured {median * 1e3:.2f} ms", result.stdout)
    assert compare["relative_error"] == pytest.approx(
        compare["predicted_iteration_time_s"] / compare["measured_iteration_time_s"] - 1)
    assert compare["ops"]["F"]["count"] == m * ranks
    assert metrics["iteration_time_s"] == pytest.approx(trace.makespan)


def _run_in_process(capsys, argv):
    """``executor.run`` in this process (no launch happens on these paths): (status, stderr)."""
    with pytest.raises(SystemExit) as info:
        executor_main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--inject-failure", "5:1B0"], "the rank must be 0..1"),
    (["--inject-failure", "1:0B0"], "rank 1 has no op '0B0'"),
    (["--backend", "nccl"], "--backend nccl: the plan puts every rank on cpu"),  # whether or not CUDA is here
    (["--backend", "mpi"], "invalid choice"),
    (["--calibrate-out", "{tmp}"], "--calibrate-out '{tmp}' is a directory"),
    (["--calibrate-out", "{tmp}/plan-file/cal.json"], "'{tmp}/plan-file' is not a directory"),
    # A calibrated profile written over the plan, or over a file the run writes into --out, would lose one of them.
    (["--calibrate-out", "{tmp}/sim-1f1b-2/plan.json"], "is the --plan file"),
    (["--calibrate-out", "{tmp}/out/plan.json"], "is the plan.json this run writes into --out"),
    (["--calibrate-out", "{tmp}/out/../out/compare.json"], "is the compare.json this run writes into --out"),
    (["--save-state", "{tmp}/plan-file"], "--save-state '{tmp}/plan-file' exists and is not a directory"),
    # Permission bits do not stop root; creating a file does (procfs takes none), so this fails for everyone.
    (["--save-state", "/proc/pipedejavu-state"], "--save-state '/proc/pipedejavu-state': cannot write in '/proc'"),
    (["--out", "/proc/pipedejavu-out"], "--out '/proc/pipedejavu-out': cannot write in '/proc'"),
    (["--out", ""], "--out is empty ('')"),  # was: the run's files written into the current directory
    (["--out", "/dev/null"], "--out '/dev/null' exists and is not a directory"),
    (["--out", "o" * 300], "a file name may have at most 255"),
])
def test_bad_options_are_rejected_before_launch(tmp_path, capsys, extra, message):
    plan = _plan(tmp_path, "1f1b", 2, m=2)
    (tmp_path / "plan-file").write_text("a file, not a directory")
    extra = [arg.format(tmp=tmp_path) for arg in extra]
    capsys.readouterr()
    status, err = _run_in_process(capsys, ["--plan", str(plan), "--out", str(tmp_path / "out"), *extra])
    assert status == 2
    assert err.startswith("error: ") and message.format(tmp=tmp_path) in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_out_path_that_is_a_file_is_rejected_before_launch(tmp_path, capsys):
    plan = _plan(tmp_path, "1f1b", 2, m=2)
    capsys.readouterr()
    status, err = _run_in_process(capsys, ["--plan", str(plan), "--out", str(plan)])
    assert status == 2 and err == f"error: --out {str(plan)!r} exists and is not a directory\n"


def test_checking_an_output_path_leaves_nothing_behind(tmp_path):
    check_output_path("--out", str(tmp_path / "a" / "b"), directory=True)
    check_output_path("--calibrate-out", str(tmp_path / "cal.json"), directory=False)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone, and no directory was made


@pytest.mark.parametrize("requested,devices,cuda,count,expected", [
    (None, ["cpu", "cpu"], False, 0, ("gloo", None)),
    (None, ["cpu", "cpu"], True, 8, ("gloo", None)),  # a cpu plan stays on the CPU on a CUDA host
    ("gloo", ["cpu", "cpu"], True, 8, ("gloo", None)),
    (None, ["v100-sxm2-32gb"] * 2, True, 2, ("nccl", None)),
    ("nccl", ["v100-sxm2-32gb"] * 2, True, 4, ("nccl", None)),
    (None, ["v100-sxm2-32gb"] * 2, True, None, ("nccl", None)),  # torchrun over hosts: no count here
    (None, ["v100-sxm2-32gb"] * 2, False, 0, ("gloo", "torch sees no CUDA device here")),
    ("gloo", ["v100-sxm2-32gb"] * 2, True, 2, ("gloo", "--backend gloo")),
    (None, ["cpu", "v100-sxm2-32gb"], True, 2, ("gloo", "rank(s) 0 are planned on cpu")),
])
def test_backend_follows_the_plans_devices(requested, devices, cuda, count, expected):
    backend, warning = choose_backend(requested, devices, cuda_available=cuda, cuda_devices=count)
    assert backend == expected[0]
    if expected[1] is None:
        assert warning is None
    else:
        assert warning.startswith("warning: the plan puts ranks on v100-sxm2-32gb, but every rank will run on this "
                                  "host's CPU with gloo") and expected[1] in warning


def test_a_plan_on_a_slowed_cpu_runs_on_the_cpu(tmp_path):
    # A topology file's slowdown: makes rank 1 a slowed copy of cpu; the executor runs it on the cpu (and
    # --slowdown emulates the rest), not as a GPU plan that would ask for CUDA or warn.
    from executor.backend import planned_devices
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    topology = tmp_path / "mixed.yaml"
    topology.write_text("nodes:\n  - {device: cpu, count: 2}\nslowdown: {1: 2}\n")
    built = build_plan(PlanInputs(SPEC, str(topology), "1f1b", microbatches=2))
    assert built.topology.devices[1].name == "cpu-slowed-2x"
    planned = planned_devices(built.plan, built.topology)
    assert planned == ["cpu", "cpu"]
    assert choose_backend(None, planned, cuda_available=True, cuda_devices=8) == ("gloo", None)


@pytest.mark.parametrize("requested,devices,cuda,count,message", [
    ("nccl", ["cpu", "cpu"], True, 8, "the plan puts every rank on cpu"),
    ("nccl", ["cpu", "v100-sxm2-32gb"], True, 8, "the plan puts rank(s) 0 on cpu"),
    ("nccl", ["v100-sxm2-32gb"] * 2, False, 0, "nccl needs CUDA"),
    (None, ["v100-sxm2-32gb"] * 4, True, 2, "the plan has 4 ranks but this host has 2 CUDA device(s)"),
])
def test_backend_that_cannot_run_the_plan_is_refused(requested, devices, cuda, count, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        choose_backend(requested, devices, cuda_available=cuda, cuda_devices=count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU plan on a host without CUDA")
def test_a_gpu_plan_without_cuda_runs_on_the_cpu_and_calibrates_a_cpu_profile(tmp_path):
    out, calibrated = tmp_path / "sim", tmp_path / "cal.json"
    assert sim_main(["--topology", "2xV100", "--model", SPEC, "--schedule", "1f1b", "-m", "2", "--partition",
                     "uniform", "--no-gantt", "--out", str(out)]) == 0
    result = execute(out / "plan.json", tmp_path / "real", "--warmup", "0", "--iterations", "1", "--no-gantt",
                      "--calibrate-out", str(calibrated))
    assert result.returncode == 0, result.stderr
    # One warning about the devices, then the calibration's own: one iteration is too few to trust; a
    # loaded machine may add its "no point-to-point fit" and drift warnings.
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert "torch sees no CUDA device here" in warnings[0], result.stderr
    assert any("calibrated over 1 iteration(s)" in line for line in warnings), result.stderr
    assert all("no CUDA" in line or "calibrat" in line or "point-to-point" in line or "drift" in line
               for line in warnings), result.stderr
    assert "backend gloo" in result.stdout
    profile = json.loads(calibrated.read_text())
    assert profile["device"] == "cpu"  # where it was measured, not the plan's v100-sxm2-32gb
    assert profile["machine"]["gpu"] is None and "cpu" in profile["machine"]
    assert profile["software"]["cuda"] == torch.version.cuda and profile["software"]["torch"] == torch.__version__
    compare = json.loads((tmp_path / "real" / "compare.json").read_text())
    assert (compare["planned_devices"], compare["measured_devices"]) == (["v100-sxm2-32gb"], ["cpu"])


def test_plan_with_more_ranks_than_its_topology_has_devices_is_rejected(tmp_path, capsys):
    plan = edited_plan(_plan(tmp_path, "1f1b", 2, m=2), tmp_path / "plan-1xcpu.json",
                       lambda data: data.update(topology="1xcpu"))
    capsys.readouterr()
    status, err = _run_in_process(capsys, ["--plan", str(plan), "--out", str(tmp_path / "out")])
    assert status == 2
    assert err == "error: plan has 2 rank programs but its topology '1xcpu' has 1 device(s)\n"
    assert not (tmp_path / "out").exists()


def test_plan_with_fewer_ranks_than_its_topology_is_accepted(tmp_path):
    # sim.run writes such plans: a 2-rank schedule file on a 4-device topology leaves devices 2 and 3 idle.
    schedule = tmp_path / "two-ranks.csv"
    schedule.write_text(dumps_schedule_csv(get_schedule("1f1b").build(2, 2, 1)))
    out = tmp_path / "sim4"
    assert sim_main(["--topology", "4xcpu", "--model", SPEC, "--schedule-file", str(schedule), "--partition",
                     "uniform", "--no-gantt", "--out", str(out)]) == 0
    plan, topology = load_checked_plan(str(out / "plan.json"))
    assert (plan.num_ranks, plan.topology) == (2, "4xcpu")
    assert str(topology) == "4xcpu" and topology.num_ranks == 4  # the topology, parsed once with the plan


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
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x1f\x8b\x08\x00 gzip, not a plan")
    status, err = _run_in_process(capsys, ["--plan", str(binary), "--out", str(tmp_path / "out")])
    assert status == 2 and err == f"error: plan {binary} is not UTF-8 text (byte 0x8b at offset 1)\n", err


def test_world_size_that_does_not_fit_the_plan_is_rejected(tmp_path):
    # As if a user's torchrun started 3 processes for a 2-rank plan: each worker refuses before joining the group.
    plan = _plan(tmp_path, "1f1b", 2, m=2)
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}
    result = execute(plan, tmp_path / "out", env=env, timeout=60)
    assert result.returncode == 2
    assert "has 2 ranks but the launcher started 3" in result.stderr and "Traceback" not in result.stderr


def test_the_launcher_preloads_sympy_only_where_two_ranks_would_import_it():
    # Every rank running a virtual stage other than the last calls backward with its output's gradient, which imports
    # torch's symbolic shapes (sympy): preloaded once for all where that is two or more ranks.
    from executor.run import GRADIENT_BACKWARD_MODULE, RANK_MODULES, _rank_modules
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs
    from tests.executor.runs import SPEC, built_plan

    def preloads(plan):
        return GRADIENT_BACKWARD_MODULE in _rank_modules(plan)

    assert _rank_modules(built_plan("1f1b", "2xcpu", 4))[: len(RANK_MODULES)] == RANK_MODULES
    assert not preloads(built_plan("1f1b", "2xcpu", 4))  # only rank 0: its own import costs the same
    assert preloads(built_plan("1f1b", "4xcpu", 4))  # ranks 0-2
    interleaved = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="interleaved", chunks=2,
                                        microbatches=4, partition="uniform")).plan
    assert preloads(interleaved)  # both ranks hold a vstage before the last
    replicated = build_plan(PlanInputs(model=SPEC, topology="4xcpu", schedule="1f1b", pp=2, dp=2, microbatch_size=1,
                                       global_batch=4, partition="uniform")).plan
    assert preloads(replicated)  # stage 0 on two replicas
    data_parallel = build_plan(PlanInputs(model=SPEC, topology="2xcpu", schedule="1f1b", pp=1, dp=2,
                                          microbatch_size=1, global_batch=4)).plan
    assert not preloads(data_parallel)  # one stage: every backward starts from the loss
