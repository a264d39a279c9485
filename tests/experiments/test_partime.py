"""``experiments.partime``: its simulated points are sim.run's own step times (one prediction path), one stage
is speed-up 1, the claims are read from the table as stated (a claim not simulated says so), the quick run writes
its files with a real round, and bad input is refused."""

from __future__ import annotations

import csv
import json

import pytest

from experiments import partime
from experiments.partime import CLAIMS, Point, check_claims, model_of, sweep
from sim.core.errors import SpecError
from sim.run import main as sim_main


def test_a_point_is_the_step_time_sim_run_reports(tmp_path):
    (point,) = [p for p in sweep(("basic",), (256,), (1, 4)) if p.stages == 4 and p.cuda_graphs]
    assert sim_main(["--topology", "8xV100", "--model", model_of("basic", 256), "--schedule", "stream", "--frames",
                     "32", "--pp", "4", "--cuda-graphs", "--no-gantt", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["stream"]["step_time_s"] == point.step_s


def test_one_stage_is_speed_up_one_and_speed_up_is_the_step_time_ratio():
    points = sweep(("kernel x3",), (256,), (1, 2))
    for captured in (False, True):
        one, two = [p for p in points if p.cuda_graphs == captured]
        assert one.speedup == 1.0 and two.speedup == one.step_s / two.step_s


def test_the_claims_are_read_as_stated():
    def point(config, size, n, captured, speedup):
        return Point(config, size, n, captured, 1.0 / speedup, 0.0, speedup)

    # A table where every claim holds by construction, and the same with the plateau broken.
    rows = []
    for config, base in (("basic", 2.0), ("layers x3", 6.0), ("features x3", 3.0), ("kernel x3", 5.0)):
        for size, bonus in ((256, 0.0), (1024, 1.0)):
            rows.append(point(config, size, 8, True, base + bonus + 1.0))
            rows.append(point(config, size, 8, False, (base + bonus) * (0.4 if config == "basic" else 1.0)))
            rows.append(point(config, size, 4, False, (base + bonus) * (0.4 if config == "basic" else 1.0) / 1.1))
    verdicts = check_claims(rows)
    assert [v[0] for v in verdicts] == [claim for claim, _ in CLAIMS]
    assert [v[2] for v in verdicts] == [True, True, True, True, True]
    broken = [Point(p.config, p.size, p.stages, p.cuda_graphs, p.step_s, p.latency_s,
                    p.speedup / 2 if (p.config, p.size, p.stages, p.cuda_graphs) == ("basic", 256, 4, False)
                    else p.speedup) for p in rows]
    assert check_claims(broken)[4][2] is False
    assert all(v[2] is None for v in check_claims([point("basic", 256, 1, False, 1.0)]))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("partime")
    result = partime.run(out=out, quick=True)
    assert partime.write(result, out) == [out / "partime.csv", out / "partime.png", out / "partime_real.csv"]
    return result, out


def test_the_quick_run_holds_the_table_and_a_real_round_and_writes_them(quick):
    result, out = quick
    assert len(result.points) == 1 * 2 * 3 * 2  # basic, two resolutions, N = 1, 2, 4, eager and captured
    assert {p.stages for p in result.points} == {1, 2, 4} and result.stage_counts == (1, 2, 4)
    (real,) = result.real
    predicted, measured = real["predicted_step_s"], real["measured_step_s"]
    assert predicted > 0 and measured > 0
    assert real["error"] == (predicted - measured) / measured
    with open(out / "partime.csv", newline="") as handle:
        assert [(r["config"], int(r["stages"]), float(r["speedup"])) for r in csv.DictReader(handle)] == [
            (p.config, p.stages, pytest.approx(p.speedup, abs=1e-6)) for p in result.points]
    with open(out / "partime_real.csv", newline="") as handle:
        (written,) = list(csv.DictReader(handle))
    assert float(written["measured_step_s"]) == measured
    assert (out / "partime.png").stat().st_size > 1000


def test_rounds_out_of_range_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(SpecError, match="--rounds must be from 1 to 20, got 0"):
        partime.run(out=tmp_path, rounds=0)
