"""experiments.memory_suite: a seeded suite of plans it did not choose, each predicted and measured on CPU ranks."""

import json

import pytest

from experiments import memory_suite
from sim.core.errors import SpecError
from sim.plan.build import build_plan


def test_the_same_seed_draws_the_same_suite_and_another_seed_another():
    first, again = memory_suite.draw_plans(0, 12, 2), memory_suite.draw_plans(0, 12, 2)
    assert first == again
    assert [p.name for p in memory_suite.draw_plans(1, 12, 2)] != [p.name for p in first]
    # the suite covers the layouts and stays in the model space
    names = " ".join(p.name for p in memory_suite.draw_plans(0, 40, 4))
    for layout in ("pp4-", "dp4-zero0", "dp4-zero1", "dp4-zero2", "tp4", "pp2-dp2"):
        assert layout in names, layout
    for plan in first:
        dims = dict(item.split("=") for item in plan.inputs.model.removeprefix("gpt:").split(","))
        assert all(int(dims[key]) in values for key, values in memory_suite.MODEL_SPACE.items())


def test_every_drawn_plan_builds_or_is_refused_with_a_reason():
    for plan in memory_suite.draw_plans(0, 40, 4):
        try:
            build_plan(plan.inputs)
        except SpecError as exc:
            assert str(exc), plan.name


def test_one_plan_is_predicted_and_measured_on_every_rank(tmp_path):
    result = memory_suite.run(out=tmp_path, seed=0, plans=1, ranks=2)
    (case,) = result.results
    assert [r["rank"] for r in case["ranks"]] == [0, 1]
    for r in case["ranks"]:
        assert r["measured_bytes"] > 0 and r["relative_error"] == pytest.approx(
            r["predicted_bytes"] / r["measured_bytes"] - 1)
    assert result.summary["ranks"] == 2
    files = memory_suite.write(result, tmp_path)
    assert json.loads(files[1].read_text())["summary"] == result.summary


def test_bad_sizes_are_refused_by_their_flags(tmp_path):
    with pytest.raises(SpecError, match="--ranks must be 2, 3 or 4, got 5"):
        memory_suite.run(out=tmp_path, ranks=5)
    with pytest.raises(SpecError, match="--plans must be >= 1, got 0"):
        memory_suite.run(out=tmp_path, plans=0)
