"""sim.api, the Python API: its results against the commands' own (byte for byte), and its refusals."""

from __future__ import annotations

import ast
import json
import re
import sys

import pytest

from sim import api
from sim.core.errors import SpecError
from sim.run import main as sim_run

MODEL, TOPOLOGY = "gpt:layers=8,hidden=1024,heads=16,seq=512", "4xA100"


def test_a_simulation_writes_what_sim_run_writes_byte_for_byte(tmp_path, capsys):
    """The oracle is the command: the same plan, metrics and trace files from the same settings."""
    built = api.plan(MODEL, TOPOLOGY, schedule="zb1p", microbatches=8, tp=2, pp=2)
    names = api.simulate(built).write(tmp_path / "api")
    assert sim_run(["--model", MODEL, "--topology", TOPOLOGY, "--schedule", "zb1p", "--microbatches", "8",
                    "--tp", "2", "--pp", "2", "--out", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    assert names == ["plan.json", "schedule.csv", "metrics.json", "trace.json", "gantt.png"]
    for name in names:
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name


def test_rows_are_the_metrics_and_the_trace_as_plain_data(tmp_path):
    run = api.simulate(api.plan(MODEL, TOPOLOGY, schedule="1f1b", microbatches=4))
    metrics = run.metrics
    assert run.iteration_time_s == metrics["iteration_time_s"]
    assert run.devices() == metrics["devices"]
    ops = run.ops()
    assert len(ops) == len(run.trace.spans)
    # Every compute op's duration summed per rank is that rank's busy time (metrics.json's own definition).
    for device in run.devices():
        busy = sum(op["duration_s"] for op in ops if op["rank"] == device["rank"] and op["stream"] == "compute")
        assert busy == pytest.approx(device["busy_s"], rel=1e-12)
    assert max(op["end_s"] for op in ops) == pytest.approx(run.iteration_time_s, rel=1e-12)
    json.dumps(ops)  # plain data: serialisable as it is


def test_a_written_plan_simulates_to_the_same_time(tmp_path):
    run = api.simulate(api.plan(MODEL, TOPOLOGY, schedule="gpipe", microbatches=4, pp=4))
    run.write(tmp_path, gantt=False)
    again = api.simulate(tmp_path / "plan.json")
    assert again.iteration_time_s == run.iteration_time_s
    assert api.load_plan(tmp_path / "plan.json") == run.plan


def test_the_gantt_chart_is_a_figure_with_the_title():
    from matplotlib.figure import Figure

    figure = api.simulate(api.plan(MODEL, TOPOLOGY, microbatches=2)).gantt("a title")
    assert isinstance(figure, Figure)
    assert figure.axes[0].title.get_text() == "a title"


def test_a_search_ranks_what_the_search_found_and_builds_its_pick():
    found = api.search(MODEL, TOPOLOGY, 8, strategy="screen", schedules=("1f1b",), zero=(0,))
    rows = found.rows()
    times = [row["iteration_time_s"] for row in rows]
    assert times == sorted(times) and rows[0]["feasible"]
    assert rows[0]["label"] == found.result.best.candidate.label()
    # The pick built again and simulated gives the search's own figure (one prediction path).
    assert api.simulate(found.best_plan()).iteration_time_s == pytest.approx(times[0], rel=1e-12)
    assert len(found.rows(feasible_only=False)) == len(found.result.evaluations)


def test_unknown_settings_are_refused_with_the_closest_names():
    with pytest.raises(SpecError, match="'microbatchs' is not a plan setting; did you mean microbatches"):
        api.plan(MODEL, TOPOLOGY, microbatchs=4)
    with pytest.raises(SpecError, match="'zeros' is not a search space setting; did you mean zero"):
        api.search(MODEL, TOPOLOGY, 8, zeros=(1,))
    with pytest.raises(SpecError, match="strategy must be one of"):
        api.search(MODEL, TOPOLOGY, 8, strategy="best")


def test_a_dataframe_without_pandas_says_how_to_get_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # an import of pandas now fails, installed or not
    run = api.simulate(api.plan(MODEL, TOPOLOGY, microbatches=2))
    with pytest.raises(SpecError, match="needs pandas"):
        run.devices_frame()


def test_no_feasible_plan_says_why():
    found = api.search("llama3.1-8b", "2xV100", 8, strategy="exhaustive", schedules=("1f1b",), zero=(0,),
                       sequence_parallel=(False,), recompute=("none",))
    assert found.result.best is None
    with pytest.raises(SpecError, match="none of the .* plans costed is feasible"):
        found.best_plan()


def test_out_of_memory_names_the_settings_that_fit_as_sim_run_names_its_flags(tmp_path, capsys):
    """The CLI's refusal is the oracle: the same head and the same remedies (their figures), each change spelt as a
    keyword of plan() instead of a flag; the first remedy, passed back to plan(), simulates (the engine decides)."""
    settings = {"schedule": "1f1b", "global_batch": 64, "dp": 8}
    model, topology = "gpt:layers=32,hidden=4096,seq=8192", "8xA100"
    with pytest.raises(api.OutOfMemoryError) as info:
        api.simulate(api.plan(model, topology, **settings))
    message = str(info.value)
    with pytest.raises(SystemExit):
        sim_run(["--topology", topology, "--model", model, "--schedule", "1f1b", "--global-batch", "64", "--dp", "8",
                 "--out", str(tmp_path / "out")])
    cli = capsys.readouterr().err.removeprefix("error: ").strip()
    head, remedies = message.split("; these would fit: ")
    cli_head, cli_remedies = cli.split("; these would fit: ")
    assert head == cli_head and "--" not in remedies
    figures = re.compile(r"\(\d+\.\d\d of \d+\.\d\d GB\)")
    assert figures.findall(remedies) == figures.findall(cli_remedies) != []
    assert remedies.endswith("(check_memory=False simulates it anyway)")
    first = dict((name, ast.literal_eval(value)) for name, value in
                 (change.split("=", 1) for change in remedies.split(" (")[0].split()))
    assert set(first) <= set(api.PLAN_SETTINGS) and first
    fixed = api.simulate(api.plan(model, topology, **{**settings, **first}))
    assert max(row["peak_memory_bytes"] for row in fixed.devices()) <= 80e9


def test_a_read_back_plan_out_of_memory_says_how_to_simulate_it_anyway(tmp_path):
    built = api.plan("gpt:layers=32,hidden=4096,seq=8192", "8xA100", global_batch=64, dp=8)
    api.simulate(built, check_memory=False).write(tmp_path, gantt=False)
    with pytest.raises(api.OutOfMemoryError, match=r"needs .* GB > 80\.00 GB .*check_memory=False simulates it"):
        api.simulate(tmp_path / "plan.json")


def test_settings_are_read_as_the_commands_read_their_flags():
    # sim.run --zero 1 reads "1" as 1; sim.search --zero 0,1 as (0, 1); one choice is a tuple of one.
    assert api.plan(MODEL, TOPOLOGY, microbatches=2, dp=4, zero="1").plan.layout.zero == 1
    assert api.plan(MODEL, TOPOLOGY, microbatches=2, dp=4, zero="1").plan == api.plan(
        MODEL, TOPOLOGY, microbatches=2, dp=4, zero=1).plan
    for given, space in ((1, (1,)), ("1", (1,)), ("0,1", (0, 1)), ([0, 3], (0, 3))):
        found = api.search(MODEL, TOPOLOGY, 8, strategy="screen", schedules="1f1b", zero=given)
        assert found.result.problem.space.zero == space
        assert found.result.problem.space.schedules == ("1f1b",)


@pytest.mark.parametrize("given", [("a",), "x", 1.5, (True,)])
def test_a_choice_of_the_wrong_type_says_a_tuple_is_wanted(given):
    with pytest.raises(SpecError) as info:
        api.search(MODEL, TOPOLOGY, 8, zero=given)
    assert str(info.value).startswith("search space setting zero takes a tuple of int (e.g. zero=(0, 1), or one int)")


def test_reprs_are_a_few_lines_naming_what_matters():
    """The dataclasses' own reprs printed every op (a search's 388 KB, a 16k-GPU plan's 7.1 MB); these are a few
    lines whatever the size, with the figures the results hold."""
    built = api.plan("gpt:layers=8,hidden=1024,heads=16,seq=512", "4x8xA100", schedule="1f1b", microbatches=64,
                     tp=2, dp=2, pp=8)
    ops = sum(len(program) for program in built.plan.programs)
    assert ops > 2000
    text = repr(built)
    assert len(text) < 500 and text.count("\n") == 1
    for needle in ("1f1b L1", "gpt:", "4x8xA100", "TP 2 × DP 2 × PP 8 = 32 devices", "64 microbatches",
                   f"{ops:,} ops on 8 ranks", built.graph.summary()):
        assert needle in text
    assert repr(built.plan) in text
    run = api.simulate(built)
    text = repr(run)
    assert len(text) < 500 and text.count("\n") == 3
    for needle in ("4x8xA100", "TP2×DP2×PP8", f"iteration {run.iteration_time_s * 1e3:.3f} ms",
                   f"{run.throughput_samples_per_s:,.1f} samples/s", f"{len(run.trace.spans):,} ops"):
        assert needle in text
    found = api.search(MODEL, TOPOLOGY, 8, strategy="exhaustive", schedules=("1f1b",), zero=(0,))
    text = repr(found)
    best = found.result.best
    assert len(text) < 500 and text.count("\n") == 2
    for needle in (MODEL, TOPOLOGY, "global batch 8", "strategy exhaustive",
                   f"{len(found.result.evaluations)} of {found.result.space_size} plans costed",
                   f"best: {best.candidate.label()}, {best.iteration_time_s * 1e3:.3f} ms"):
        assert needle in text
