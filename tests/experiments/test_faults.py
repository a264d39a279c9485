"""``experiments.faults`` on one scale and MTBF: a row per policy, each continuing policy at least as good as
restarting, ReCycle's simulated slowdown between 1 and the extra work's factor, and the files written."""

import csv

import pytest

from experiments.faults import POLICIES, Result, recycle_slowdown, run, write


def test_one_scale_gives_every_policy_and_continuing_never_loses_to_restarting(tmp_path):
    rows = run(scales=(1024,), mtbf_factors=(1.0,)).rows
    assert [r.policy for r in rows] == list(POLICIES)
    restart = rows[0]
    for row in rows:
        assert 0 < row.ettr <= 1 and row.goodput_tokens_per_s > 0 and row.iteration_s == restart.iteration_s
        assert row.job_mtbf_h == pytest.approx(row.device_mtbf_h / 1024)
    assert all(row.ettr >= restart.ettr for row in rows[1:])
    files = write(Result(rows), tmp_path)
    assert files == [tmp_path / "faults.csv", tmp_path / "faults.png"]
    with open(tmp_path / "faults.csv") as handle:
        assert [line["policy"] for line in csv.DictReader(handle)] == list(POLICIES)


@pytest.mark.parametrize("replicas", [4, 32])
def test_recycles_slowdown_is_at_most_the_extra_work(replicas):
    # The failed stage's peers each take D/(D - 1) of their work: the iteration cannot slow by more than that.
    slowdown = recycle_slowdown(replicas)
    assert 1.0 <= slowdown <= replicas / (replicas - 1) + 1e-12
