"""experiments.run naspipe: a small run end to end, and its input errors."""

import json

import pytest

from experiments.naspipe import CASES
from experiments.run import main


def test_small_run_writes_a_table_and_plot_with_every_case(tmp_path, capsys):
    out = tmp_path / "n"
    assert main(["naspipe", "--out", str(out), "--topology", "4xV100", "--spaces", "c3", "--subnets", "8"]) == 0
    results = json.loads((out / "results.json").read_text())
    (row,) = results["rows"]
    assert set(row["subnets_per_s"]) == set(CASES)
    for case in CASES:
        assert row["over_gpipe"][case] == pytest.approx(row["subnets_per_s"][case] / row["subnets_per_s"]["gpipe"])
    # Every resident case holds the same stage share of the supernet; the budgeted ones less, pipedream more.
    held = row["device_param_bytes"]
    assert held["csp"] == held["gpipe"] == held["1f1b"] == held["one-at-a-time"] < row["supernet_bytes"]
    assert held["csp+predict"] < held["csp"] and held["csp+on_demand"] < held["csp"] < held["pipedream"]
    assert row["paper_over_gpipe"] == {"naspipe": 2.8, "pipedream": 1.25}
    assert "| c3 |" in (out / "table.md").read_text()
    assert (out / "naspipe.png").stat().st_size > 0


@pytest.mark.parametrize("argv,message", [(["--subnets", "0"], "--subnets must be >= 1"),
                                          (["--budget-factor", "0.5"], "--budget-factor must be >= 1"),
                                          (["--minibatch", "30"], "must divide --minibatch 30")])
def test_bad_options_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["naspipe", "--out", str(tmp_path / "o"), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
