"""experiments.mixed_real: the cluster file, the pipeline-only settings, the prediction of a plan on a cluster other
than its own (against a closed form), the verdicts and table from hand-made runs, bad input, and one real run of a plan
on the mixed cluster with executor.run --slowdown (the full experiment is a benchmark, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import mixed_real
from experiments.mixed_real import (
    PLANS,
    TARGET_ERROR,
    format_table,
    measure,
    pipeline_settings,
    predicted_on,
    summarize,
    write_topology,
)
from sim.core.errors import SpecError
from sim.hw.catalog import get_device, slowed_device
from sim.hw.topology import Topology
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.search.settings import load_settings
from tests.executor.runs import SPEC


@pytest.mark.parametrize(("ranks", "slow", "factor"), [(2, 1, 2.0), (3, 0, 1.5), (4, 2, 3.0)])
def test_the_cluster_file_is_the_ranks_with_one_slowed(tmp_path: Path, ranks: int, slow: int, factor: float) -> None:
    spec = write_topology(tmp_path / "mixed.yaml", ranks, slow, factor)
    cpu = get_device("cpu")
    expected = tuple(slowed_device(cpu, factor) if r == slow else cpu for r in range(ranks))
    assert Topology.parse(spec).devices == expected


def test_the_pipeline_settings_are_every_power_of_two_on_one_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "settings.csv"
    path.write_text(pipeline_settings(2, 16))
    assert load_settings(path, 2) == tuple((1, 1, 2, b) for b in (1, 2, 4, 8, 16))
    path.write_text(pipeline_settings(3, 6))
    assert load_settings(path, 3) == ((1, 1, 3, 1), (1, 1, 3, 2), (1, 1, 3, 4))


def test_a_plan_made_for_the_even_cluster_is_predicted_on_the_mixed_one(tmp_path: Path) -> None:
    # GPipe, one layer per stage, f = 10 ms and b = 20 ms per layer, free links (ideal devices). Even: f + m(f + b)
    # + b. Stage 1 slowed 3x: it is the bottleneck, f + 3m(f + b) + b.
    built = build_plan(PlanInputs("uniform:layers=2,fwd_ms=10,bwd_ms=20", "2xideal", "gpipe", microbatches=4,
                                  partition="1,1"))
    plan = tmp_path / "plan.json"
    plan.write_text(built.plan.dumps())
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("nodes:\n  - {device: ideal, count: 2}\nslowdown: {1: 3}\n")
    assert predicted_on(plan, "2xideal", None) == pytest.approx(0.010 + 4 * 0.030 + 0.020, rel=1e-12)
    assert predicted_on(plan, str(mixed), None) == pytest.approx(0.010 + 3 * 4 * 0.030 + 0.020, rel=1e-12)


def _run(measured: float, predicted: float, busy: float | None = 0.0, calibration_busy: float | None = 0.0) -> dict:
    return {"median_s": measured, "iterations_s": [measured * 0.99, measured, measured * 1.02],
            "predicted_s": predicted, "foreign_cores": busy, "calibration_foreign_cores": calibration_busy}


def _rows(searched: list[dict], homogeneous: list[dict], pipeline: list[dict], *, same: bool = False) -> dict:
    def row(label: str, counts: list[int], runs: list[dict]) -> dict:
        return {"label": label, "layer_counts": counts, "predicted_believed_s": 1.0, "runs": runs}
    return {"searched": row("tp1 dp1 pp2 b2 zb1p none", [7, 3], searched),
            "homogeneous": row("tp1 dp1 pp2 b2 zb1p none" if same else "tp1 dp2 pp1 b1 1f1b none zero1",
                               [7, 3] if same else [10], homogeneous),
            "homogeneous-pipeline": row("tp1 dp1 pp2 b2 zb1p none", [5, 5], pipeline)}


def test_the_verdicts_from_hand_made_runs() -> None:
    rows = _rows([_run(2.0, 1.9), _run(1.5, 1.6)], [_run(3.0, 2.7), _run(1.8, 2.1)], [_run(2.8, 2.9), _run(2.9, 2.8)])
    summary = summarize(rows)
    searched = rows["searched"]
    # Pooled iterations 1.98, 2.0, 2.04, 1.485, 1.5, 1.53: median (1.53 + 1.98) / 2.
    assert searched["measured_s"] == pytest.approx((1.53 + 1.98) / 2)
    assert searched["predicted_s"] == pytest.approx(1.75)
    assert searched["errors"] == pytest.approx([1.9 / 2.0 - 1, 1.6 / 1.5 - 1])
    homogeneous = summary["homogeneous"]
    assert homogeneous["speedup_each_round"] == pytest.approx([1.5, 1.2]) and homogeneous["faster"]
    assert homogeneous["speedup_predicted"] == pytest.approx(2.4 / 1.75) and not homogeneous["same_plan"]
    assert summary["max_abs_error"] == pytest.approx(0.1 / 1.5) and summary["within_target"]
    assert summary["target_met"] and summary["busy_runs"] == 0 and summary["load_changed_runs"] == 0
    table = format_table(rows, summary, "1:2")
    assert "| searched | sim.search on the mixed cluster | tp1 dp1 pp2 b2 zb1p none | 7,3 | 1000 | 1900 / 1600 | " \
           "2000 / 1500 | 1485–2040 | -5.0% / +6.7% | 0.00 (0.00) / 0.00 (0.00) |" in table
    assert "measured speed-up 1.50x / 1.20x (each round)" in table
    assert "in every round: met" in table and "(max |error| 6.7%): met" in table and "warning" not in table


def test_one_slower_round_or_one_error_over_ten_percent_fails_its_target() -> None:
    # Round 2 the searched plan is slower: not faster in every round, whatever the pooled medians say.
    slower = summarize(_rows([_run(1.0, 1.0), _run(2.0, 2.0)], [_run(3.0, 3.0), _run(1.9, 1.9)],
                             [_run(3.0, 3.0), _run(3.0, 3.0)]))
    assert not slower["faster"] and not slower["target_met"] and slower["within_target"]
    # Exactly 10 % is within the target; just above is not.
    at = summarize(_rows([_run(1.0, 0.9)], [_run(2.0, 2.0)], [_run(2.0, 2.0)]))
    assert at["max_abs_error"] == pytest.approx(TARGET_ERROR) and at["within_target"] and at["target_met"]
    rows = _rows([_run(1.0, 0.899)], [_run(2.0, 2.0)], [_run(2.0, 2.0)])
    over = summarize(rows)
    assert not over["within_target"] and not over["target_met"]
    assert "(max |error| 10.1%): NOT met" in format_table(rows, over, "1:2")


def test_the_same_plan_busy_runs_and_a_changed_load_are_said() -> None:
    rows = _rows([_run(1.0, 1.0, busy=0.5, calibration_busy=0.1)], [_run(1.01, 1.0, busy=None)],
                 [_run(1.2, 1.1, busy=0.2, calibration_busy=0.2)], same=True)
    summary = summarize(rows)
    assert summary["homogeneous"]["same_plan"] and not summary["homogeneous-pipeline"]["same_plan"]
    assert summary["busy_runs"] == 1 and summary["load_changed_runs"] == 1
    table = format_table(rows, summary, "1:2")
    assert "searched vs homogeneous (the same plan)" in table and "0.50 (0.10)" in table and "? (0.00)" in table
    assert "during 1 run(s) other processes used more than 0.25" in table
    assert "those errors measure the change in load" in table
    assert set(PLANS) == set(rows)


@pytest.mark.parametrize(("options", "message"), [
    ({"ranks": 5}, "--ranks must be 2 to 4, got 5"),
    ({"slow_rank": 2}, "--slow-rank must be a rank of the 2 (0..1), got 2"),
    ({"factor": 1.0}, "--factor must be a number above 1 and at most 1000, got 1.0"),
    ({"factor": float("nan")}, "got nan"),
    ({"iterations": 0}, "--iterations must be >= 1, got 0"),
    ({"warmup": -1}, "--warmup must be >= 0, got -1"),
    ({"calibrate_iterations": 3}, "--calibrate-iterations must be >= 8"),
    ({"wait_idle": -1.0}, "--wait-idle must be >= 0 seconds"),
])
def test_bad_input_is_refused_before_any_run(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        mixed_real.run(out=tmp_path, **options)
    assert message in str(caught.value) and list(tmp_path.iterdir()) == []


def test_a_plan_on_the_mixed_cluster_runs_slowed_and_the_executor_predicts_what_the_experiment_does(
        tmp_path: Path) -> None:
    mixed = write_topology(tmp_path / "mixed.yaml", 2, 1, 2.0)
    built = build_plan(PlanInputs(SPEC, mixed, "1f1b", microbatches=2, partition="2,2"))
    plan = tmp_path / "plan.json"
    plan.write_text(built.plan.dumps())
    run = measure(plan, tmp_path / "run", slowdown="1:2", iterations=1, warmup=0)
    assert run["executor_predicted_s"] == pytest.approx(predicted_on(plan, mixed, None), rel=1e-12)
    assert run["iterations_s"] == [run["median_s"]] and run["median_s"] > 0
    compare = json.loads((tmp_path / "run" / "compare.json").read_text())
    assert compare["slowdown"]["by_rank"] == {"1": 2.0}
    assert compare["planned_devices"] == ["cpu", "cpu-slowed-2x"] and compare["measured_devices"] == ["cpu"]
