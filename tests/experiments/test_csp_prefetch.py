"""experiments.csp_prefetch: counts that add up, none slower on one stage, and its input errors."""

import pytest

from experiments import csp_prefetch
from sim.core.errors import SpecError


def test_counts_add_up_and_one_stage_is_never_slower():
    result = csp_prefetch.run(problems=150, seed=2)
    assert sum(result.one_stage) + sum(result.several_stages) == 150
    assert result.one_stage[2] == 0  # the property that holds on one stage (tests/sim/csp/test_prefetch.py)
    assert result.worst_slowdown >= 0


def test_a_bad_count_is_refused_naming_the_flag():
    with pytest.raises(SpecError, match="--problems must be >= 1"):
        csp_prefetch.run(problems=0)
