"""experiments.naspipe: a small run end to end, and its input errors."""

import json

import pytest

from experiments import naspipe
from experiments.naspipe import CASES
from sim.core.errors import SpecError


def test_small_run_holds_every_case_and_writes_a_table_and_plot(tmp_path):
    result = naspipe.run(topology="4xV100", spaces="c3", subnets=8)
    (row,) = result.rows
    assert set(row["subnets_per_s"]) == set(CASES)
    for case in CASES:
        assert row["over_gpipe"][case] == pytest.approx(row["subnets_per_s"][case] / row["subnets_per_s"]["gpipe"])
    # Every resident case holds the same stage share of the supernet; the budgeted ones less, pipedream more.
    held = row["device_param_bytes"]
    assert held["csp"] == held["gpipe"] == held["1f1b"] == held["one-at-a-time"] < row["supernet_bytes"]
    assert held["csp+predict"] < held["csp"] and held["csp+on_demand"] < held["csp"] < held["pipedream"]
    assert row["paper_over_gpipe"] == {"naspipe": 2.8, "pipedream": 1.25}
    files = naspipe.write(result, tmp_path)
    assert files == [tmp_path / "results.json", tmp_path / "table.md", tmp_path / "naspipe.png"]
    assert json.loads(files[0].read_text())["rows"] == json.loads(json.dumps([row]))
    assert "| c3 |" in files[1].read_text() and files[2].stat().st_size > 0


@pytest.mark.parametrize("options,message", [({"subnets": 0}, "--subnets must be >= 1"),
                                             ({"budget_factor": 0.5}, "--budget-factor must be >= 1"),
                                             ({"minibatch": 30}, "must divide --minibatch 30")])
def test_bad_options_are_refused_naming_the_flag(options, message):
    with pytest.raises(SpecError, match=message):
        naspipe.run(**options)
