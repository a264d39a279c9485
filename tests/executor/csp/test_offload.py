"""CSP context switching on real ranks (``sim.csp.memory``, ``executor.csp.offload``): with a device parameter
budget small enough to force write-backs, training is still bitwise the sequential run, the copies are real and
recorded, and the rank's decisions are the simulator's."""

import json

import pytest
import torch
from torch import nn

from executor.csp.offload import ParamOffload
from executor.nn.optim import make_optimizer
from sim.csp.memory import CopyPlan
from sim.ir.plan import Plan
from sim.predict import predict
from sim.run import main as sim_main

SPEC = "supernet:blocks=6,choices=4,hidden=32,heads=4,seq=8,vocab=50"
# Candidates are 6336, 8576, 25280 and 0 plan bytes (fp16 in the graph); the largest subnet on one of the two
# stages needs 59136 B, so 60 KB holds one subnet's layers and little else: every stage must write back.
BUDGET = 60_000


@pytest.fixture(scope="module")
def sequential(csp_reference):
    return csp_reference


@pytest.mark.parametrize("prefetch", ["on_demand", "predict"])
def test_budget_forces_copies_and_training_stays_bitwise(tmp_path, sequential, prefetch, csp_run):
    out = tmp_path / "run"
    run = csp_run(out, 2, "--device-param-budget", "60KB", "--prefetch", prefetch)
    assert run["final_params_sha256"] == sequential["final_params_sha256"]
    assert run["losses"] == sequential["losses"]
    assert run["csp"]["device_param_budget_bytes"] == BUDGET and run["csp"]["prefetch"] == prefetch
    copies = run["csp"]["copies"]
    assert [c["stage"] for c in copies] == [0, 1]
    for c in copies:
        assert c["h2d_bytes"] > 0 and c["prefetches"] > 0 and c["h2d_tensor_bytes"] > 0
        assert c["d2h_bytes"] > 0 and c["evictions"] > 0 and c["d2h_tensor_bytes"] > 0
        assert 0 < c["peak_resident_bytes"] <= BUDGET
        assert c["copy_wait_s"] >= 0
        assert (c["prefetches_ahead"] > 0) == (prefetch == "predict")
    events = json.loads((out / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    for rank in (0, 1):
        kinds = {e["cat"] for e in spans if e["pid"] == rank}
        assert {"F", "B", "OPT_STEP", "PREFETCH", "EVICT"} <= kinds, (rank, kinds)
        assert any(e["name"] == f"{rank}PREFETCH0" for e in spans)
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= {e["cat"] for e in spans}
    assert min(e["ts"] for e in spans) == 0
    assert run["ops"]["PREFETCH"]["count"] == sum(c["prefetches"] for c in copies)
    assert (out / "gantt.png").exists()


@pytest.mark.parametrize("prefetch", ["on_demand", "predict"])
def test_one_stage_copies_are_the_simulators(tmp_path, sequential, prefetch, csp_run):
    """On one stage the order of ops does not depend on timing, so the rank must copy and write back exactly what
    ``sim.csp.simulate`` does under the same rules (Belady eviction, admission, the predictor's assumed state)."""
    run = csp_run(tmp_path / "run", 1, "--device-param-budget", "100KB", "--prefetch", prefetch)
    assert run["final_params_sha256"] == sequential["final_params_sha256"]
    plan = Plan.loads((tmp_path / "run-plan" / "plan.json").read_text())
    simulated = predict(plan).csp  # the simulator on the very plan the ranks ran
    assert simulated is not None
    fields = ("h2d_bytes", "d2h_bytes", "prefetches", "evictions", "peak_resident_bytes")
    assert [tuple(c[f] for f in fields) for c in run["csp"]["copies"]] == [
        tuple(getattr(c, f) for f in fields) for c in simulated.copies]


@pytest.mark.parametrize("argv,message", [
    (["--device-param-budget", "50KB"], "smaller than subnet"),
    (["--device-param-budget", "lots"], "not a byte size"),
    (["--device-param-budget", "60KB", "--prefetch", "eager"], "invalid choice"),
    (["--prefetch", "predict"], "without a budget every layer is resident"),
])
def test_bad_budget_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        sim_main(["--topology", "2xcpu", "--schedule", "csp", "--model", SPEC, "--subnets", "12", "--seed", "3",
                  "--partition", "uniform", *argv, "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_offload_moves_parameters_and_adam_state_bitwise(one_thread):
    """Training two layers with every key written back and copied in between steps equals training in place."""
    def train(offload: bool):
        torch.manual_seed(0)
        layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        optimizer = make_optimizer("adam", layers.parameters())
        params = {("b", k): list(layer.parameters()) for k, layer in enumerate(layers)}
        mover = ParamOffload(params, optimizer, torch.device("cpu")) if offload else None
        resident: set = set()
        for step in range(6):
            k = step % 2
            if mover is not None:  # a budget of one layer: write the other back, copy this one in
                mover.copy_in(CopyPlan(step, (("b", k),), tuple(resident)))
                resident = {("b", k)}
            layers[k](torch.full((2, 4), float(step))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if mover is not None:
            mover.close(resident)
            assert mover.d2h_tensor_bytes > 0 and {s[0] for s in mover.spans} == {"PREFETCH", "EVICT"}
        return [p.detach().clone() for p in layers.parameters()], [
            {n: v.clone() for n, v in optimizer.state[p].items()} for p in layers.parameters()]

    (plain, plain_state), (moved, moved_state) = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, moved, strict=True))
    for a, b in zip(plain_state, moved_state, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_checkpoint_sees_every_key_and_a_restored_stage_continues_bitwise(one_thread):
    """``whole`` puts every key's current values in place at once (what a checkpoint captures) and puts the
    placeholders back; a ParamOffload built over a stage restored from that capture (optimizer state before any key
    is resident) trains on exactly as the uninterrupted stage. Oracle: the same steps without offloading."""
    import copy

    def build():
        torch.manual_seed(0)
        layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        return layers, make_optimizer("adam", layers.parameters())

    def train(layers, optimizer, mover, steps, resident):
        for step in steps:
            k = step % 2
            if mover is not None:
                mover.copy_in(CopyPlan(step, (("b", k),), tuple(resident)))
                resident = {("b", k)}
            layers[k](torch.full((2, 4), float(step))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return resident

    def keys(layers):
        return {("b", k): list(layer.parameters()) for k, layer in enumerate(layers)}

    plain, plain_optimizer = build()
    train(plain, plain_optimizer, None, range(3), set())
    at_three = (copy.deepcopy(plain.state_dict()), copy.deepcopy(plain_optimizer.state_dict()))
    train(plain, plain_optimizer, None, range(3, 6), set())

    layers, optimizer = build()
    mover = ParamOffload(keys(layers), optimizer, torch.device("cpu"))
    resident = train(layers, optimizer, mover, range(3), set())
    with mover.whole(resident):
        captured = (copy.deepcopy(layers.state_dict()), copy.deepcopy(optimizer.state_dict()))
    assert resident == {("b", 0)} and all(p.numel() == 0 for p in layers[1].parameters())  # back to a placeholder
    for a, b in ((at_three[0], captured[0]), (at_three[1]["state"], captured[1]["state"])):
        assert a.keys() == b.keys()
        for key in a:
            values = a[key].items() if isinstance(a[key], dict) else [(None, a[key])]
            for name, value in values:
                other = b[key][name] if name is not None else b[key]
                assert torch.equal(value, other), (key, name)

    restored, restored_optimizer = build()
    restored.load_state_dict(captured[0])
    restored_optimizer.load_state_dict(captured[1])
    again = ParamOffload(keys(restored), restored_optimizer, torch.device("cpu"))
    assert not restored_optimizer.state  # moved to the keys' host state
    again.close(train(restored, restored_optimizer, again, range(3, 6), set()))
    mover.close(train(layers, optimizer, mover, range(3, 6), resident))
    for model in (restored, layers):
        assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    for model_optimizer in (restored_optimizer, optimizer):
        for p, q in zip(plain.parameters(), model_optimizer.param_groups[0]["params"], strict=True):
            mine, theirs = plain_optimizer.state[p], model_optimizer.state[q]
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
