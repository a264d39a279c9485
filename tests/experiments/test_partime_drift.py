"""``experiments.partime_drift``: the ``--quick`` runs and files, one stage's curve equal to exact online SGD's, the
measures on losses whose answers are known, a diverged run stopped where it diverged, and bad input."""

from __future__ import annotations

import csv
import math
from collections import defaultdict

import pytest

from experiments import partime_drift
from experiments.partime_drift import QUICK, Run, Setup, _online, summarise
from sim.core.errors import SpecError


@pytest.fixture(scope="module")
def quick() -> partime_drift.Result:
    return partime_drift.run(quick=True)


def test_quick_has_every_frame_of_every_method_and_one_stage_equals_exact_sgd_exactly(quick):
    curves = {run.method: run.losses for run in quick.runs}
    assert sorted(curves) == ["exact", "partime N=1", "partime N=2"] and len(quick.runs) == 3
    for losses in curves.values():
        assert len(losses) == QUICK.frames
    assert curves["partime N=1"] == curves["exact"]  # every loss, bit for bit
    assert curves["partime N=2"] != curves["exact"]
    assert curves["exact"][0] == curves["partime N=2"][0]  # frame 0 meets the initial weights in both


def test_quick_writes_every_frame_of_every_run(quick, tmp_path):
    files = partime_drift.write(quick, tmp_path)
    assert files == [tmp_path / "partime_drift.csv", tmp_path / "partime_drift.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = defaultdict(dict)
    for row in csv.DictReader(files[0].open()):
        curves[row["method"]][int(row["frame"])] = float(row["online_loss"])
    assert {run.method: tuple(curves[run.method][f] for f in range(QUICK.frames)) for run in quick.runs} == {
        run.method: run.losses for run in quick.runs}


SETUP = Setup(size=8, frames=40, stages=(2, 4), repeats=1, lrs=(0.5,))


def test_the_measures_on_losses_with_known_answers():
    # exact: 1 everywhere; N=2: 2 before the cut (frame 20), 3 after; N=4: diverged (nan) at frame 5
    runs = [Run(0.5, 0, 0, (1.0,) * 40), Run(0.5, 0, 2, (2.0,) * 20 + (3.0,) * 20),
            Run(0.5, 0, 4, (1.0,) * 5 + (math.nan,))]
    rows = {n: row for _, n, row in summarise(SETUP, runs)}
    assert rows[0] == {"whole": 1.0, "drift": 1.0, "cut15": 1.0, "cut100": 1.0, "peak": 0, "recovery": 0,
                       "diverged": 0, "first_divergence": None}
    two = rows[2]
    assert (two["whole"], two["drift"], two["cut15"], two["cut100"]) == (2.5, 2.0, 3.0, 3.0)
    assert two["peak"] == 0 and two["recovery"] == math.inf  # never back at 2 within the run
    assert (two["diverged"], two["first_divergence"]) == (0, None)
    four = rows[4]
    assert four["whole"] == four["drift"] == four["cut15"] == math.inf
    assert (four["diverged"], four["first_divergence"]) == (1, 5)


def test_a_recovery_is_counted_from_the_cut():
    # its 10-frame mean (the SMOOTH window) comes back to the pre-cut level 1.0 when it starts at frame 20 + 7
    losses = (1.0,) * 20 + (5.0,) * 7 + (1.0,) * 13
    rows = {n: row for _, n, row in summarise(SETUP, [Run(0.5, 0, 0, (1.0,) * 40), Run(0.5, 0, 2, losses),
                                                      Run(0.5, 0, 4, losses)])}
    assert rows[2]["recovery"] == 7 and rows[2]["peak"] == 0
    assert rows[2]["cut15"] == pytest.approx((7 * 5 + 8) / 15)


def test_a_run_stops_at_its_first_loss_out_of_range():
    import torch

    calls = []

    def train(stages, optimizer, frames, count, loss):
        for f in range(count):
            calls.append(f)
            loss(torch.tensor(float(f)), torch.tensor(0.0 if f < 3 else -1e3))  # (f - y)^2 > 1e3 from frame 3
        raise AssertionError("not reached")

    losses = _online(train, [], None, None, 10, lambda out, y: (out - y) ** 2)
    assert losses == (0.0, 1.0, 4.0, (3 + 1e3) ** 2) and calls == [0, 1, 2, 3]
    assert Run(0.5, 0, 2, losses).diverged_at == 3


@pytest.mark.parametrize(("options", "message"), [
    ({"frames": 29}, "--frames must be from 30 to 5000, got 29"),
    ({"repeats": 0}, "--repeats must be from 1 to 10, got 0"),
    ({"seed": -1}, "--seed must be >= 0, got -1"),
    ({"lr": "0"}, "--lr must be numbers in (0, 10], got '0'"),
    ({"lr": "0.5,nan"}, "--lr must be numbers in (0, 10], got '0.5,nan'"),
    ({"lr": "fast"}, "--lr must be comma-separated numbers, got 'fast'"),
    ({"lr": "0.1,0.1"}, "--lr must be at most 4 different rates, got '0.1,0.1'"),
])
def test_bad_input_is_refused_naming_the_flag(options, message):
    with pytest.raises(SpecError) as caught:
        partime_drift.run(quick=True, **options)
    assert str(caught.value) == message
