"""experiments.scatter's error summary and target line, against hand-computed values."""

import math

from experiments.scatter import error_stats, target_line


def test_error_stats_are_the_median_and_the_max_of_the_absolute_errors():
    assert error_stats([0.02, 0.10, 0.04]) == {"rows": 3, "median_abs_error": 0.04, "max_abs_error": 0.10}
    assert math.isnan(error_stats([])["median_abs_error"])


def test_a_target_line_says_met_or_the_distance_in_points():
    line = target_line("dense", error_stats([0.05, 0.072, 0.30]), 0.06, 0.15)
    assert line == ("target dense: median |error| <= 6% (7.2%: missed by 1.2 points), max <= 15% (30.0%: missed by "
                    "15.0 points)")
    assert target_line("x", error_stats([0.01, 0.02]), 0.05, 0.12).count(": met") == 2
