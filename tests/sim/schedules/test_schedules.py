"""Exact op order of the generators for small cases, in the string notation."""

import pytest

from sim.core.errors import SpecError
from sim.schedules import SCHEDULES, get_schedule


def _rows(programs):
    return [" ".join(op.id for op in program) for program in programs]


def test_gpipe_p3_m4():
    assert _rows(SCHEDULES["gpipe"].build(3, 4)) == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    ]


def test_1f1b_p3_m4_megatron_order():
    # Warm-up p - r - 1 forwards, then F/B pairs, then the remaining backwards (Megatron-LM schedules.py).
    assert _rows(SCHEDULES["1f1b"].build(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_1f1b_with_fewer_microbatches_than_stages_caps_warmup():
    assert _rows(SCHEDULES["1f1b"].build(4, 2)) == [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
        "2F0 2F1 2B0 2B1",
        "3F0 3B0 3F1 3B1",
    ]


def test_single_stage_is_sequential():
    assert _rows(SCHEDULES["1f1b"].build(1, 3)) == ["0F0 0B0 0F1 0B1 0F2 0B2"]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("stages, microbatches", [(0, 4), (2, 0)])
def test_generators_reject_empty_sizes(name, stages, microbatches):
    with pytest.raises(ValueError):
        SCHEDULES[name].build(stages, microbatches)


def test_unknown_schedule_names_the_value():
    with pytest.raises(SpecError, match="'zb9'"):
        get_schedule("zb9")
