"""experiments.sim_vs_real: its summary and table, its calibration retried while unsteady, and bad input (the full
run is a benchmark, not a test)."""

import pytest

from experiments import sim_vs_real
from experiments.host_load import CpuSnapshot, foreign_cores, snapshot
from experiments.sim_vs_real import (
    BUSY_CORES,
    TARGET_MAX,
    TARGET_MEDIAN,
    UNSTEADY_RANGE,
    format_table,
    spread,
    summarize,
)
from sim.core.errors import SpecError


def _row(schedule, m, predicted, measured):
    return {"schedule": schedule, "microbatches": m, "predicted_s": predicted, "measured_s": measured,
            "relative_error": predicted / measured - 1}


def test_summary_is_median_and_max_of_absolute_errors():
    rows = [_row("gpipe", 4, 0.9, 1.0), _row("gpipe", 8, 2.2, 2.0), _row("1f1b", 4, 1.0, 1.0)]
    summary = summarize(rows)
    assert summary["median_abs_error"] == pytest.approx(0.1)  # |errors| 0.1, 0.1, 0.0
    assert summary["max_abs_error"] == pytest.approx(0.1)
    table = format_table(rows, summary)
    assert "| gpipe | 8 | 2200.0 | 2000.0 | – | +10.0% | – | – |" in table
    assert "target NOT met" in table


def test_the_target_is_the_issues_three_and_eight_percent():
    assert (TARGET_MEDIAN, TARGET_MAX) == (0.03, 0.08)
    # |errors| 2 %, 2.5 %, 7.5 %: median 2.5 %, max 7.5 %: met.
    met = [_row("gpipe", 4, 0.98, 1.0), _row("gpipe", 8, 0.975, 1.0), _row("1f1b", 4, 1.075, 1.0)]
    assert summarize(met)["target_met"] and "target met" in format_table(met, summarize(met))
    # One case at 8.5 %: the median still meets it, the max does not.
    over = met[:2] + [_row("1f1b", 4, 1.085, 1.0)]
    assert not summarize(over)["target_met"]
    # Median 3.5 %: not met although the max is within 8 %.
    median_over = [_row("gpipe", 4, 0.965, 1.0), _row("gpipe", 8, 0.965, 1.0), _row("1f1b", 4, 1.0, 1.0)]
    assert not summarize(median_over)["target_met"]


def test_spread_is_the_range_over_the_median():
    assert UNSTEADY_RANGE == 0.25
    assert spread([0.30, 0.25, 0.20]) == pytest.approx({"min_s": 0.20, "max_s": 0.30, "range": 0.10 / 0.25})


def test_summary_reports_both_calibrations_and_busy_runs():
    rows = [_row("gpipe", 4, 0.98, 1.0), _row("gpipe", 8, 1.96, 2.0)]
    rows[0].update(predicted_2_s=1.00, relative_error_2=0.0, measured_spread=spread([0.9, 1.0, 1.2]),
                   foreign_cores=0.0)
    rows[1].update(predicted_2_s=2.058, relative_error_2=0.029, measured_spread=spread([2.0, 2.0, 2.1]),
                   foreign_cores=BUSY_CORES + 0.5)
    summary = summarize(rows)
    # Predictions moved by 0.02 / 0.98 and 0.098 / 1.96 = 5 %.
    assert summary["calibration_spread"] == pytest.approx(0.05)
    assert summary["max_abs_error_2"] == pytest.approx(0.029)
    assert summary["measured_range"] == pytest.approx((0.3 / 1.0 + 0.1 / 2.0) / 2)
    assert summary["busy_runs"] == 1
    table = format_table(rows, summary)
    assert "| gpipe | 4 | 980.0 | 1000.0 | 900.0–1200.0 | -2.0% | +0.0% | 0.00 |" in table
    assert "moves the predictions by up to 5.0%" in table
    assert "warning: during 1 run(s) other processes" in table
    assert summary["unsteady_runs"] == 1  # the first ranged over 30 % of its median, the second over 5 %
    assert "warning: in 1 run(s) the iterations ranged over more than 25%" in table


def test_foreign_cores_is_host_time_minus_own_time_per_wall_second():
    before = CpuSnapshot(wall_s=100.0, host_busy_s=50.0, own_s=10.0)
    # 10 s later the host spent 15 s busy, 12 of them ours: others kept 0.3 of a core busy.
    assert foreign_cores(before, CpuSnapshot(110.0, 65.0, 22.0)) == pytest.approx(0.3)
    assert foreign_cores(before, CpuSnapshot(110.0, 60.0, 22.0)) == 0.0  # counter rounding cannot go negative
    assert foreign_cores(before, CpuSnapshot(110.0, None, 22.0)) is None
    assert foreign_cores(before, before) is None


def test_snapshot_reads_the_busy_fields_of_proc_stat(tmp_path):
    import os

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = user + nice + system + irq + softirq ticks.
    stat.write_text("cpu  100 20 30 5000 40 5 5 7 0 0\ncpu0 50 10 15 2500 20 2 3 3 0 0\n")
    assert snapshot(stat).host_busy_s == pytest.approx(160 / os.sysconf("SC_CLK_TCK"))
    assert snapshot(tmp_path / "missing").host_busy_s is None


@pytest.mark.parametrize("options,message", [
    ({"microbatches": "4,x"}, "comma-separated positive integers"),
    ({"microbatches": "0"}, "comma-separated positive integers"),
    ({"schedules": "gpipe,nope"}, "unknown case(s) ['nope']"),
    ({"iterations": 0}, "--iterations must be >= 1"),
    ({"calibrate_iterations": 0}, "--calibrate-iterations must be >= 1"),
    ({"wait_idle": -1.0}, "--wait-idle must be >= 0 seconds, got -1.0"),
])
def test_bad_options_are_refused_before_any_run(tmp_path, options, message):
    with pytest.raises(SpecError) as caught:
        sim_vs_real.run(out=tmp_path, **options)
    assert message in str(caught.value) and list(tmp_path.iterdir()) == []


class _FakeHost:
    """A host whose other processes use ``cores(t)`` cores at fake time t; sleeping advances the fake clock."""

    def __init__(self, cores):
        self.t, self.busy, self.cores = 0.0, 0.0, cores

    def sleep(self, seconds):
        self.busy += self.cores(self.t) * seconds
        self.t += seconds

    def snapshot(self, stat=None):
        return CpuSnapshot(self.t, self.busy, 0.0)


@pytest.mark.parametrize("cores,limit,expected,elapsed", [
    (lambda t: 0.0, 60.0, 0.0, 2.0),  # idle: one probe
    (lambda t: 1.0 if t < 10 else 0.05, 60.0, 0.05, 12.0),  # busy for 10 s, then quiet: the first quiet probe
    (lambda t: 1.0, 5.0, 1.0, 6.0),  # busy throughout: gives up after the first probe past the limit
])
def test_wait_until_idle_probes_until_quiet_or_the_limit(monkeypatch, cores, limit, expected, elapsed):
    import experiments.host_load as host_load

    host = _FakeHost(cores)
    monkeypatch.setattr(host_load, "snapshot", host.snapshot)
    monkeypatch.setattr(host_load.time, "sleep", host.sleep)
    monkeypatch.setattr(host_load.time, "monotonic", lambda: host.t)
    assert host_load.wait_until_idle(limit, 0.1, probe_s=2.0) == pytest.approx(expected)
    assert host.t == pytest.approx(elapsed)


def test_wait_until_idle_returns_at_once_where_the_host_time_is_unknown(tmp_path):
    from experiments.host_load import wait_until_idle

    assert wait_until_idle(60.0, 0.1, stat=tmp_path / "missing") is None
    with pytest.raises(ValueError):
        wait_until_idle(-1.0, 0.1)


@pytest.mark.parametrize("runs,expected,kept", [
    ([(0.01, 0.01)], 1, 1),  # idle and steady: once
    ([(0.9, 0.01), (0.01, 0.01)], 2, 2),  # shared the host: again
    ([(0.01, 0.2), (0.01, 0.01)], 2, 2),  # stage medians drifted by 20 %: again
    ([(0.01, 0.2), (0.01, 0.05), (0.01, 0.4)], 3, 2),  # never steady: the run that drifted least is kept
    ([(0.01, 0.2), (0.9, 0.01), (0.9, 0.02)], 3, 1),  # ... and one that had the host to itself before any that did not
])
def test_an_unsteady_calibration_is_run_again(tmp_path, monkeypatch, runs, expected, kept):
    import json

    import experiments.sim_vs_real as svr

    assert svr.CALIBRATION_TRIES == 3
    made = iter(enumerate(runs, 1))

    def measure(wait, *args):
        attempt, (busy, drift) = next(made)
        target = args[args.index("--calibrate-out") + 1]
        with open(target, "w") as f:
            json.dump({"run": attempt, "method": {"stability": {"max_half_drift": drift, "max_relative_iqr": 0.05}}}, f)
        return busy

    monkeypatch.setattr(svr, "_simulate", lambda *args: (tmp_path / "plan.json", 0.0))
    monkeypatch.setattr(svr, "_measure", measure)
    said = []
    busy, tries = svr._calibrate(tmp_path, "calibration", "gpt:layers=2", 6, 2, 9, 2, 0.0, said.append)
    assert tries == expected and busy == runs[kept - 1][0]
    assert json.loads((tmp_path / "calibration.json").read_text())["run"] == kept
    assert sum("calibrating again" in line for line in said) == expected - 1
