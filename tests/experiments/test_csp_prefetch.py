"""experiments.run csp_prefetch: counts that add up, none slower on one stage, and its input errors."""

import re

import pytest

from experiments.run import main


def test_counts_add_up_and_one_stage_is_never_slower(capsys):
    assert main(["csp_prefetch", "--problems", "150", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    rows = {name: [int(x) for x in counts] for name, *counts in
            re.findall(r"\| (one stage|several stages) \| (\d+) \| (\d+) \| (\d+) \|", out)}
    assert sum(map(sum, rows.values())) == 150
    assert rows["one stage"][2] == 0  # the property that holds on one stage (tests/sim/csp/test_prefetch.py)
    assert "worst slowdown" in out


def test_bad_count_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["csp_prefetch", "--problems", "0"])
    assert info.value.code == 2 and "--problems must be >= 1" in capsys.readouterr().err
