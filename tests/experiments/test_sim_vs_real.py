"""experiments.run: the registry CLI and sim_vs_real's summary and table (the full run is a benchmark, not a test)."""

import pytest

from experiments.run import EXPERIMENTS, main
from experiments.sim_vs_real import format_table, summarize


def _row(schedule, m, predicted, measured):
    return {"schedule": schedule, "microbatches": m, "predicted_s": predicted, "measured_s": measured,
            "relative_error": (measured - predicted) / measured}


def test_summary_is_median_and_max_of_absolute_errors():
    rows = [_row("gpipe", 4, 0.9, 1.0), _row("gpipe", 8, 2.2, 2.0), _row("1f1b", 4, 1.0, 1.0)]
    summary = summarize(rows)
    assert summary["median_abs_error"] == pytest.approx(0.1)  # |errors| 0.1, 0.1, 0.0
    assert summary["max_abs_error"] == pytest.approx(0.1)
    table = format_table(rows, summary)
    assert "| gpipe | 8 | 2200.0 | 2000.0 | -10.0% |" in table
    assert "target met" in table and "NOT" not in table
    worse = [_row("gpipe", 4, 0.5, 1.0)]
    assert "target NOT met" in format_table(worse, summarize(worse))


def test_list_and_unknown_experiment(capsys):
    assert main(["list"]) == 0
    assert "sim_vs_real" in capsys.readouterr().out and "sim_vs_real" in EXPERIMENTS
    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2 and "unknown experiment 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--microbatches", "4,x"], "comma-separated positive integers"),
    (["--microbatches", "0"], "comma-separated positive integers"),
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--bogus"], "unrecognized arguments"),
])
def test_sim_vs_real_rejects_bad_options(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["sim_vs_real", "--out", str(tmp_path / "out"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
