"""experiments.run naspipe: a small run end to end, and its input errors."""

import json

import pytest

from experiments.run import main


def test_small_run_writes_a_table_with_every_case(tmp_path, capsys):
    out = tmp_path / "n"
    assert main(["naspipe", "--out", str(out), "--topology", "4xV100", "--spaces", "c3", "--subnets", "8"]) == 0
    results = json.loads((out / "results.json").read_text())
    (row,) = results["rows"]
    assert set(row["subnets_per_s"]) == {"csp", "csp+predict", "csp+on_demand", "one-at-a-time"}
    assert row["speedup_csp"] == pytest.approx(row["subnets_per_s"]["csp"] / row["subnets_per_s"]["one-at-a-time"])
    assert row["device_budget_bytes"] < row["supernet_bytes"]  # the device holds a fraction of the supernet
    assert "| c3 |" in (out / "table.md").read_text()


@pytest.mark.parametrize("argv,message", [(["--subnets", "0"], "--subnets must be >= 1"),
                                          (["--budget-factor", "0.5"], "--budget-factor >= 1")])
def test_bad_options_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["naspipe", "--out", str(tmp_path / "o"), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
