"""``python -m sim.bench_memory`` measures real ``sim.run`` children (so these tests start processes, ~1 s each)."""

from __future__ import annotations

import pytest

from sim.bench_memory import main, measure
from sim.core.errors import SpecError
from sim.plan.limits import plan_op_count


def test_each_size_is_measured_in_its_own_child_and_the_ratios_close_the_report(capsys):
    assert main(["--topology", "2xideal", "--model", "uniform:layers=2", "--microbatches", "4,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.strip()[:1].isdigit()]
    # 1F1B on 2 ranks: 2 compute ops per stage and 4 transfers per microbatch, and 2 optimizer steps.
    assert [(row[0], int(row[1].replace(",", ""))) for row in rows] == [
        ("2", plan_op_count(2, (0, 1), 2, False)), ("4", plan_op_count(4, (0, 1), 2, False))]
    assert all(float(row[3]) > 0 for row in rows)  # a peak RSS was read for every child
    assert out[-2].startswith("memory ratio: ") and out[-1].startswith("time ratio: ")


def test_a_failing_run_is_one_error_naming_it(capsys):
    with pytest.raises(SpecError, match="sim.run failed \\(status 2\\): error: "):
        measure(["--topology", "2xideal", "--model", "nonsense"], 2)
    with pytest.raises(SystemExit) as info:
        main(["--microbatches", "0"])
    assert info.value.code == 2
