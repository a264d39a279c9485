"""``sim.run --schedule csp``: the supernet's subnet sequence simulated with NASPipe's CSP, end to end."""

import json

import pytest

from sim.csp.build import CspInputs, build_csp_plan, build_csp_problem
from sim.csp.rules import csp_pick, subnet_table
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
])
def test_bad_csp_input_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        sim_main(["--topology", "2xideal", "--out", str(tmp_path / "o"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
