"""``sim.run --schedule csp``: the supernet's subnet sequence simulated with NASPipe's CSP, end to end."""

import json
import re
from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.cost.memory_sizes import state_bytes_per_param
from sim.csp.csp_plan import CspInputs, build_csp_plan, build_csp_problem, check_csp_plan
from sim.csp.rules import csp_pick, subnet_table
from sim.ir.plan import Op, Placement, Plan
from sim.models.supernet_space import sample_subnets
from sim.predict import predict
from sim.run import main as sim_main

SMALL = "supernet:blocks=6,choices=4,hidden=64,heads=4,seq=16,vocab=100"


def test_cli_writes_outputs_and_every_decision_obeys_csp_pick(tmp_path):
    out = tmp_path / "csp"
    assert sim_main(["--topology", "4xideal", "--schedule", "csp", "--model", SMALL, "--subnets", "12",
                     "--partition", "uniform", "--no-gantt", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["csp"]["subnets"] == 12 and len(metrics["csp"]["stalls"]) == 4
    record = json.loads((out / "csp.json").read_text())
    plan, _, problem = build_csp_problem(CspInputs(SMALL, None, "4xideal", subnets=12, partition="uniform"))
    assert record["subnets"] == [list(s) for s in plan.subnets]
    uses = subnet_table(problem.uses, 4)
    for d in record["decisions"]:
        assert csp_pick(d["stage"], d["arrived"], d["unfinished"], uses) == d["picked"]


def test_same_inputs_give_byte_identical_traces(tmp_path):
    for name in ("a", "b"):
        assert sim_main(["--topology", "3xideal", "--schedule", "csp", "--model", SMALL, "--subnets", "8",
                         "--seed", "4", "--no-gantt", "--out", str(tmp_path / name)]) == 0
    assert (tmp_path / "a" / "trace.json").read_bytes() == (tmp_path / "b" / "trace.json").read_bytes()


def _simulate(inputs: CspInputs):
    result = predict(build_csp_plan(inputs)).csp
    assert result is not None
    return result


def test_a_supernet_with_one_choice_degrades_to_one_subnet_at_a_time():
    # Every subnet picks the only candidate of every block, so all share every layer (NASPipe's worst case).
    spec = SMALL.replace("choices=4", "choices=1")
    csp = _simulate(CspInputs(spec, None, "3xideal", subnets=6, partition="uniform"))
    alone = _simulate(CspInputs(spec, None, "3xideal", subnets=6, partition="uniform", one_at_a_time=True))
    assert csp.makespan == pytest.approx(alone.makespan)


def test_identical_subnets_stall_under_csp_but_never_one_at_a_time():
    few = _simulate(CspInputs(SMALL.replace("choices=4", "choices=1"), None, "4xideal", subnets=16,
                            partition="uniform"))
    alone = _simulate(CspInputs(SMALL.replace("choices=4", "choices=1"), None, "4xideal", subnets=16,
                              partition="uniform", one_at_a_time=True))
    assert sum(s.blocked_s for s in few.stalls) > 0 and sum(s.blocked_s for s in alone.stalls) == 0


@pytest.mark.parametrize("argv,message", [
    (["--schedule", "csp", "--model", "gpt:layers=2"], "trains subnets of a supernet"),
    (["--schedule", "csp"], "needs a supernet"),
    (["--schedule", "1f1b", "--space", "c3"], "--space names a supernet"),
    (["--schedule", "csp", "--space", "c9"], "c9"),
    (["--schedule", "csp", "--space", "c3", "--subnets", "0"], "--subnets must be >= 1"),
    (["--schedule", "csp", "--space", "c3", "--subnets", "100000000"], "at most 100,000"),
    (["--schedule", "csp", "--space", "c3", "--prefetch", "on_demand"], "without a budget"),
    (["--schedule", "csp", "--space", "c3", "-m", "4"], "--microbatches does not apply to --schedule csp"),
    (["--schedule", "csp", "--space", "c3", "--profile", "p.json"], "--profile does not apply to --schedule csp"),
    (["--schedule", "csp", "--space", "c3", "--recompute"], "--recompute does not apply"),
])
def test_bad_csp_input_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        sim_main(["--topology", "2xideal", "--out", str(tmp_path / "o"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


# --- the plan: what sim.run writes is everything a run needs, and is checked when read back ----------------------


def test_the_plan_round_trips_and_carries_the_run(tmp_path):
    plan = build_csp_plan(CspInputs(SMALL, None, "3xideal", subnets=5, seed=2, lookahead=4,
                                    device_param_budget_bytes=10**6, prefetch="on_demand"))
    again = Plan.loads(plan.dumps())
    assert again == plan and again.dumps() == plan.dumps()
    assert (plan.schedule, plan.weight_policy, plan.num_microbatches, plan.num_ranks) == ("csp", "csp", 5, 3)
    assert plan.subnets == sample_subnets(6, 4, 5, 2)  # the seeded table, in training order
    assert dict(plan.options) == {"lookahead": 4, "one_at_a_time": False, "seed": 2, "partition": "balanced",
                                  "device_param_budget_bytes": 10**6, "prefetch": "on_demand"}
    assert predict(again).trace.makespan == predict(plan).trace.makespan


@pytest.mark.parametrize("edit,message", [
    (lambda p: replace(p, subnets=p.subnets[:-1]), "subnet table has 4 rows"),
    (lambda p: replace(p, subnets=((9,) * 6,) + p.subnets[1:]), "subnet 0 is"),
    (lambda p: replace(p, subnets=((0,) * 5,) + p.subnets[1:]), "subnet 0 is"),
    (lambda p: replace(p, options=(("lookahead", 0),)), "lookahead must be >= 1"),
    (lambda p: replace(p, options=(("prefetch", "predict"),)), "go together"),
    (lambda p: replace(p, options=(("device_param_budget_bytes", 10), ("prefetch", "predict"))), "smaller than"),
    (lambda p: replace(p, options=(("seed", "7"),)), "option seed must be int"),
    (lambda p: replace(p, options=(("chunks", 2),)), "unknown option(s) chunks"),
    (lambda p: replace(p, model="gpt:layers=4"), "must be a supernet"),
    (lambda p: replace(p, weight_policy="flush"), "weight_policy must be"),
    (lambda p: replace(p, programs=((Op.parse("0F0"),), (), ())), "rank 0 has ops"),
    (lambda p: replace(p, placement=Placement(p.placement.vstage_layers, (0, 2, 1))), "one stage per rank"),
])
def test_a_plan_that_cannot_be_run_is_refused_with_the_reason(edit, message):
    plan = build_csp_plan(CspInputs(SMALL, None, "3xideal", subnets=5, seed=2))
    with pytest.raises(SpecError, match=re.escape(message)):
        check_csp_plan(edit(plan))


# --- device memory: one subnet at a time makes the peak a closed form -----------------------------------------------


def test_peak_memory_one_at_a_time_is_the_static_state_plus_the_largest_subnet():
    """With one subnet in flight, each stage holds its static state plus that subnet's activations from its forward
    to its backward, so the peak is static + the largest subnet's activations there (and CSP can only hold more)."""
    inputs = CspInputs(SMALL, None, "3xV100", subnets=8, seed=5, one_at_a_time=True)
    plan, setup, problem = build_csp_problem(inputs)
    model = problem.memory
    assert model is not None and model.state_per_param_byte == 0  # no budget: every candidate resident
    expected = tuple(model.static_bytes[s] + max(row[s] for row in model.activation_bytes) for s in range(3))
    assert predict(plan).peak_memory_bytes == expected
    overlapped = predict(build_csp_plan(replace(inputs, one_at_a_time=False))).peak_memory_bytes
    assert all(a >= b for a, b in zip(overlapped, expected, strict=True))


def test_static_memory_is_the_training_state_of_every_candidate_and_shared_layer():
    plan, setup, problem = build_csp_problem(CspInputs(SMALL, None, "2xV100", subnets=2))
    supernet = setup.supernet
    per_param = state_bytes_per_param(supernet.graph.dtype_bytes)
    total = (supernet.graph.total_param_bytes() // supernet.graph.dtype_bytes) * per_param
    assert sum(problem.memory.static_bytes) == total  # the graph's block layer = every candidate of the block
