"""Byzantine replicas and Zeno (``executor.run --byzantine``, ``--aggregate zeno:B``): on 4 gloo ranks of data
parallelism with one replica sending −4 times its gradient, Zeno trains as the single-process reference that writes
the same rule out does (``executor.reference.train_reference`` with ``byzantine`` and ``zeno``), and ends away from
where averaging the same gradients would; bad flags are refused."""

import json

import pytest
import torch

from executor.byzantine import Byzantine, corrupt, parse_byzantine
from executor.reference import train_reference
from executor.zeno import keep, parse_aggregate
from sim.core.errors import SpecError
from sim.ir.plan import Plan
from sim.run import main as sim_main
from tests.executor.runs import SPEC, assert_state_equals, execute, merged_state, refused

pytestmark = pytest.mark.usefixtures("one_thread")

WARMUP, ITERATIONS = 1, 3
BAD = (3, "sign-flip", 4.0)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zeno")
    assert sim_main(["--topology", "4xcpu", "--model", SPEC, "--dp", "4", "--global-batch", "8", "--no-gantt",
                     "--out", str(tmp / "sim")]) == 0
    return tmp / "sim" / "plan.json"


def test_a_byzantine_replica_trains_as_the_reference_writes_zeno(tmp_path, plan_path):
    plan = Plan.loads(plan_path.read_text())
    result = execute(plan_path, tmp_path / "run", "--warmup", str(WARMUP), "--iterations", str(ITERATIONS),
                     "--optimizer", "sgd", "--byzantine", "3:sign-flip", "--aggregate", "zeno:1", "--save-state",
                     str(tmp_path / "state"), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    steps = dict(steps=WARMUP + ITERATIONS, num_microbatches=plan.num_microbatches, microbatch_size=1, optimizer="sgd",
                 replicas=4, byzantine=(BAD,))
    reference = train_reference(SPEC, **steps, zeno=(1, 0.0))
    merged = merged_state(tmp_path / "state", plan.num_vstages)
    assert_state_equals(merged, reference.state, atol=1e-7)
    # Zeno changed the outcome: averaging the same four gradients, the bad one among them, ends elsewhere.
    averaged = train_reference(SPEC, **steps)
    assert max((merged[k] - averaged.state[k]).abs().max().item() for k in averaged.state) > 100 * 1e-7
    losses = json.loads((tmp_path / "run" / "metrics.json").read_text())["measurement"]["losses"]
    assert len(losses) == WARMUP + ITERATIONS


def test_zeno_keeps_the_best_scored_and_the_attacks_are_what_they_say():
    assert keep([0.3, -2.0, 0.1, 0.2], 1) == [0, 2, 3] and keep([1.0, 1.0, 1.0], 2) == [0]
    g = torch.arange(6.0)
    assert torch.equal(corrupt(g, Byzantine(0, "sign-flip", 4.0), 0), -4 * g)
    noise = corrupt(g, Byzantine(1, "noise", 2.0), 5)
    assert torch.equal(noise, corrupt(g, Byzantine(1, "noise", 2.0), 5)) and not torch.equal(noise, g)
    assert parse_aggregate("zeno:2:0.01", 4).drop == 2 and parse_aggregate("mean", 4) is None
    for text, message in (("zeno:4", "B must be 1..3"), ("krum", "mean or zeno"), ("zeno:1:-1", "RHO")):
        with pytest.raises(SpecError, match=message):
            parse_aggregate(text, 4)
    with pytest.raises(SpecError, match="mode must be one of sign-flip, noise"):
        parse_byzantine("1:flip", 4)


def test_zeno_off_plain_data_parallelism_is_refused(tmp_path, capsys):
    assert sim_main(["--topology", "4xcpu", "--model", SPEC, "--dp", "2", "--pp", "2", "--global-batch", "4",
                     "--no-gantt", "--out", str(tmp_path / "sim")]) == 0
    message = refused(capsys, tmp_path / "sim" / "plan.json", tmp_path / "out", "--aggregate", "zeno:1")
    assert "it runs on plain data parallelism" in message
