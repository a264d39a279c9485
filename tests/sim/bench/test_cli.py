"""``python -m sim.bench``: the engine's baseline replays the same ops; ``--partition``'s baseline is the balanced
partition's reference DP; each reports."""

import re

import pytest

from sim.bench.cli import main
from sim.bench.reference_partition import reference_balanced_counts
from sim.cost.oracle import CostOracle
from sim.hw.topology import Topology
from sim.models import build_model
from sim.plan.partition import balanced_counts

_SMALL = ["--partition", "--baseline-layers", "12", "--baseline-stages", "3", "--partition-layers", "40",
          "--partition-stages", "4", "--partition-topology", "4xV100", "--repeats", "1"]


@pytest.mark.parametrize("model, topology, stages", [
    ("uniform:layers=30", "6xideal", 6), ("gpt:layers=20,hidden=1024", "2x2xA100", 4), ("cnn:layers=12", "3xT4", 3),
])
def test_the_baseline_returns_the_balanced_partition(model, topology, stages):
    oracle = CostOracle(build_model(model), 2, None, Topology.parse(topology))
    assert reference_balanced_counts(oracle, stages) == balanced_counts(oracle, stages)


def test_partition_bench_prints_the_baseline_ratio_and_both_large_cases(capsys):
    assert main(_SMALL) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("uniform:layers=40 on 4xideal, 4 stages: model ")
    assert lines[1].startswith("gpt:layers=40 on 4xV100, 4 stages: model ")
    assert lines[2].startswith("baseline uniform:layers=12 on 3xideal, 3 stages: reference DP ")
    assert lines[2].endswith("same partition: yes")
    assert re.fullmatch(r"ratio: \d+", lines[3])
    assert len(lines) == 4


@pytest.mark.parametrize("flag, value, message", [
    ("--partition-stages", "0", "--partition-stages must be >= 1, got 0"),
    ("--repeats", "0", "--repeats must be >= 1, got 0"),
    ("--partition-topology", "2xV100", "4 stages need 4 devices, topology 2xV100 has 2"),
])
def test_bad_partition_bench_arguments_are_one_error_line(capsys, flag, value, message):
    argv = list(_SMALL)
    argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_3d_bench_times_the_plan_and_checks_the_symmetry(capsys):
    from argparse import Namespace

    from sim.bench.cli import _run_3d
    from sim.plan.inputs import PlanInputs

    small = PlanInputs(model="gpt:layers=8,hidden=512,heads=8,seq=128,vocab=1024", topology="2x8xA100",
                       schedule="1f1b", microbatch_size=2, recompute=True, tp=2, dp=2, pp=4, global_batch=32)
    assert _run_3d(Namespace(repeats=2), small) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("TP 2 × DP 2 × PP 4 = 16 devices (order tp-dp-pp), gpt:")
    assert re.fullmatch(r"build \d+\.\d\d s, predict \d+\.\d\d s, total \d+\.\d\d s \(median of 2; spread .*\); "
                        r"iteration \d+\.\d+ s", lines[1])
    assert lines[2].endswith("same as by symmetry: yes")
    assert re.fullmatch(r"ratio: \d+\.\d", lines[3])


def test_search_rates_are_measured_on_agreeing_evaluators():
    from sim.bench.rate import measure_rates

    report = measure_rates(engine_candidates=2, fast_candidates=3, batch=20)
    assert report.agreed and report.ops > 1000
    assert report.engine_per_s > 0 and report.fast_per_s > 0 and report.batched_per_s > 0
    assert (report.engine_candidates, report.fast_candidates, report.batched_candidates) == (2, 3, 20)


@pytest.mark.parametrize("model, topology, schedule", [
    ("uniform:layers=4", "2xideal", "gpipe"), ("uniform:layers=8", "4xideal", "1f1b"),
    ("uniform:layers=8", "4xideal", "zb1p"),
])
def test_the_bare_replay_replays_the_engines_ops(model, topology, schedule):
    # On ideal devices every transfer has a link of its own at a time, so nothing the bare replay leaves out (links,
    # memory) changes a time: replaying the same ops and deps with the engine's durations ends when the engine does.
    from sim.bench.cli import bare_replay
    from sim.engine.simpy_engine import simulate
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    built = build_plan(PlanInputs(model, topology, schedule, 6))
    trace = simulate(built.plan, built.costs, built.topology).trace
    durations = {span.op: 0.0 if span.stream == "recv" else span.duration for span in trace.spans}
    streams = {span.op: span.stream for span in trace.spans}
    assert len(durations) == sum(len(program) for program in built.plan.programs)
    assert bare_replay(built.plan, durations, streams) == trace.makespan


def test_engine_bench_prints_cpu_and_wall_times_and_the_cpu_ratio(capsys):
    assert main(["--topology", "2xideal", "--model", "uniform:layers=4", "--microbatches", "4", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Each of the 2 ranks: 4 F, 4 B, 4 SENDs and 4 RECVs, an optimizer step.
    assert lines[0].startswith("plan: 1f1b on 2xideal, uniform:") and lines[0].endswith(f", m=4: {2 * 17} ops")
    for line, name in zip(lines[1:3], ("engine    ", "bare SimPy")):
        assert re.match(rf"{name}\s+\d+\.\d ms CPU \(\d+\.\d ms wall\)\s+\d+ ops/s\s+makespan \d+\.\d{{3}} ms", line)
    assert re.fullmatch(r"wall-time ratio: \d+\.\d\d \(on a shared machine, read the CPU time's\)", lines[3])
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[4])
    assert len(lines) == 5


def test_an_unknown_flag_is_one_error_line_not_argparse_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--parition"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --parition; did you mean --partition, "
                                       "--partition-stages, --partition-layers?\n")
