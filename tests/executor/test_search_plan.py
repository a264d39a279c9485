"""The plan a search picks runs in ``executor.run`` as it is written: ``python -m sim.search`` on a CPU cluster, then
``python -m executor.run --plan`` on its ``plan.json`` (real processes), whose ``compare.json`` predicts the time the
search ranked it by."""

import json
import math

from sim.ir.plan import Plan
from sim.search.cli import main as search_main
from tests.executor.runs import SPEC, execute


def test_the_searched_best_plan_runs_in_the_executor(tmp_path, capsys):
    found = tmp_path / "search"
    assert search_main(["--topology", "2xcpu", "--model", SPEC, "--global-batch", "4", "--no-progress",
                        "--out", str(found)]) == 0
    capsys.readouterr()
    best = json.loads((found / "search.json").read_text())["best"]
    plan = Plan.loads((found / "plan.json").read_text())
    assert plan.world_size == 2 and plan.microbatch_size == best["candidate"]["microbatch_size"]
    assert plan.num_microbatches == best["microbatches"]

    out = tmp_path / "real"
    result = execute(found / "plan.json", out, "--warmup", "1", "--iterations", "2", "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    compare = json.loads((out / "compare.json").read_text())
    # The executor predicts the plan by the same path the search costed it by: the same number, to the bit.
    assert compare["predicted_iteration_time_s"] == best["iteration_time_s"]
    assert math.isfinite(compare["measured_iteration_time_s"]) and compare["measured_iteration_time_s"] > 0
    losses = json.loads((out / "metrics.json").read_text())["measurement"]["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for step in losses for x in step)
