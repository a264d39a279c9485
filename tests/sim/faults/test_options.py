"""``sim.run --train-hours/--iterations``: the long run's metrics and chart, its time adding up, the interval sweep
against Daly's exact optimum, byte-identical reruns, and one-line refusals."""

import json

import pytest

from sim.faults.interval import expected_wall_time, optimal_interval
from sim.run import main

#: A 70B-class Llama on 64 H100s: an iteration of a few seconds.
PLAN = ["--model", "llama3.1-8b,seq=4096", "--topology", "8x8xH100", "--tp", "8", "--dp", "8", "--pp", "1",
        "--global-batch", "64", "--zero", "1", "--no-gantt"]


def _metrics(path):
    return json.loads((path / "metrics.json").read_text())


def test_a_long_run_reports_its_failures_goodput_and_time_lost(tmp_path, capsys):
    out = tmp_path / "run"
    # A job MTBF of 2 h over 200 h of training: about a hundred failures.
    assert main([*PLAN, "--train-hours", "200", "--mtbf", "2", "--mtbf-scope", "cluster", "--checkpoint-every",
                 "100", "--seed", "3", "--fault-trials", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    faults = _metrics(out)["faults"]
    seeded = faults["seeded_run"]
    assert faults["job_mtbf_s"] == 7200 and faults["checkpoint"]["every_iterations"] == 100
    assert 60 < seeded["failures"] < 150 and len(seeded["failure_times_s"]) == seeded["failures"]
    parts = faults["training_time_s"] + seeded["lost_work_s"] + seeded["checkpoint_s"] + seeded["restart_s"]
    assert parts == pytest.approx(seeded["wall_time_s"], rel=1e-9)
    assert seeded["effective_training_time_ratio"] == pytest.approx(faults["training_time_s"] / seeded["wall_time_s"])
    tokens = _metrics(out)["tokens_per_iteration"] * faults["iterations"]
    assert seeded["goodput_tokens_per_s"] == pytest.approx(tokens / seeded["wall_time_s"])
    assert faults["effective_training_time_ratio"] == seeded["effective_training_time_ratio"]
    assert sum(seeded["restart_s_by_cause"].values()) == pytest.approx(seeded["restart_s"])
    assert "seeded run" in text and f"{seeded['failures']} failures" in text
    assert not (out / "long_run.png").exists()  # --no-gantt: no charts


def test_the_same_seed_gives_byte_identical_outputs_and_a_chart(tmp_path, capsys):
    args = [*PLAN[:-1], "--iterations", "20000", "--mtbf", "4", "--mtbf-scope", "cluster", "--fault-trials", "2"]
    for name in ("a", "b"):
        assert main([*args, "--out", str(tmp_path / name)]) == 0
    assert (tmp_path / "a" / "metrics.json").read_bytes() == (tmp_path / "b" / "metrics.json").read_bytes()
    chart = (tmp_path / "a" / "long_run.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and chart == (tmp_path / "b" / "long_run.png").read_bytes()
    assert main([*args, "--seed", "1", "--out", str(tmp_path / "c")]) == 0
    first, other = _metrics(tmp_path / "a")["faults"], _metrics(tmp_path / "c")["faults"]
    assert first["seeded_run"]["failure_times_s"] != other["seeded_run"]["failure_times_s"]


def test_the_sweeps_interval_costs_what_dalys_exact_optimum_does(tmp_path, capsys):
    # A synchronous checkpoint and one cause without repair: Daly's model exactly. The interval the sweep picks, by
    # the mean of 48 seeded runs, is worth (by Daly's closed form) within 0.5 % of the exact optimum's wall time.
    out = tmp_path / "run"
    mix = tmp_path / "mix.yaml"
    mix.write_text("causes:\n  - {name: any, category: any, count: 1}\n")
    assert main([*PLAN, "--train-hours", "500", "--mtbf", "3", "--mtbf-scope", "cluster", "--failure-mix", str(mix),
                 "--storage-bandwidth", "1", "--fault-trials", "48", "--out", str(out)]) == 0
    faults = _metrics(out)["faults"]
    checkpoint, restart = faults["checkpoint"]["blocking_s"], faults["restart_s"] + faults["checkpoint"]["load_s"]
    mtbf, work = faults["job_mtbf_s"], faults["training_time_s"]
    best = optimal_interval(checkpoint, mtbf)
    assert faults["checkpoint"]["every_iterations"] == faults["best_checkpoint_every"]
    picked = expected_wall_time(work, faults["best_interval_s"], checkpoint, restart, mtbf)
    assert picked <= expected_wall_time(work, best, checkpoint, restart, mtbf) * 1.005
    assert faults["young_interval_s"] > faults["daly_interval_s"] == pytest.approx(best, rel=0.01)


@pytest.mark.parametrize("args, needle", [
    (["--train-hours", "-1"], "--train-hours must be a number of hours > 0, got -1"),
    (["--train-hours", "10", "--iterations", "5"], "give --train-hours or --iterations"),
    (["--checkpoint-every", "10"], "give --train-hours or --iterations"),
    (["--iterations", "100", "--mtbf-scope", "cluster"], "--mtbf-scope cluster needs --mtbf HOURS"),
    (["--iterations", "100", "--mtbf", "0"], "--mtbf must be a finite number > 0, got 0"),
    (["--iterations", "100", "--failure-mix", "/no/such.yaml"], "failure mix /no/such.yaml does not exist"),
    (["--iterations", "100", "--fault-trials", "0"], "--fault-trials must be in 1..1000, got 0"),
    (["--iterations", "100000", "--mtbf", "0.01", "--mtbf-scope", "cluster", "--checkpoint-every", "50000"],
     "failures come too often for this run to finish"),
])
def test_bad_long_run_flags_are_one_error_line(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main([*PLAN, *args, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    err = captured.err
    assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "out" / "metrics.json").exists()
    if "too often" not in needle:  # refused before anything is simulated or printed
        assert captured.out == ""
