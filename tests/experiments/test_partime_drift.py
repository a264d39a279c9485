"""``experiments.run partime_drift``: the ``--quick`` files, one stage's curve equal to exact online SGD's, the
measures on losses whose answers are known, a diverged run stopped where it diverged, and bad input."""

from __future__ import annotations

import csv
import math
from collections import defaultdict

import pytest

from experiments.partime_drift import QUICK, Run, Setup, _online, summarise
from experiments.run import main as run_main
from tests.experiments.refusal import refused


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick") / "out"
    return run_main(["partime_drift", "--quick", "--out", str(out)]), out


def test_quick_writes_its_two_files(quick):
    status, out = quick
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == ["partime_drift.csv", "partime_drift.png"]
    assert (out / "partime_drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_has_every_frame_of_every_method_and_one_stage_equals_exact_sgd_exactly(quick):
    _, out = quick
    curves = defaultdict(dict)
    for row in csv.DictReader((out / "partime_drift.csv").open()):
        curves[row["method"]][int(row["frame"])] = row["online_loss"]
    assert sorted(curves) == ["exact", "partime N=1", "partime N=2"]
    for frames in curves.values():
        assert sorted(frames) == list(range(QUICK.frames))
    assert curves["partime N=1"] == curves["exact"]  # the repr of every loss: bit for bit
    assert curves["partime N=2"] != curves["exact"]
    assert curves["exact"][0] == curves["partime N=2"][0]  # frame 0 meets the initial weights in both


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


@pytest.mark.parametrize(("argv", "message"), [
    (["--frames", "29"], "error: --frames must be from 30 to 5000, got 29\n"),
    (["--repeats", "0"], "error: --repeats must be from 1 to 10, got 0\n"),
    (["--seed", "-1"], "error: --seed must be >= 0, got -1\n"),
    (["--lr", "0"], "error: --lr must be numbers in (0, 10], got '0'\n"),
    (["--lr", "0.5,nan"], "error: --lr must be numbers in (0, 10], got '0.5,nan'\n"),
    (["--lr", "fast"], "error: --lr must be comma-separated numbers, got 'fast'\n"),
    (["--lr", "0.1,0.1"], "error: --lr must be at most 4 different rates, got '0.1,0.1'\n"),
    (["--frames", "many"], "invalid int value: 'many'"),
    (["--quick", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_error_line_and_status_2(tmp_path, capsys, argv, message):
    assert message in refused(capsys, ["partime_drift", "--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "out").exists()
