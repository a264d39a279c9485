"""Per-layer memory (``profiles.layer_memory``) against independent oracles: closed forms of the fp32 state, torch's
own saved-tensor hooks for what a forward keeps, and, end to end, a one-rank plan run in this process whose memory
after every op is counted and set beside the memory ledger's replay with a profile of these measurements."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from executor.interpreter import RankInterpreter
from executor.memory import StorageCounter, live_tensors
from executor.nn.optim import make_optimizer
from executor.nn.stages import boundary_specs, build_layers, build_stage, loss_fn, synthetic_batch
from profiles.layer_memory import measure_layer_memory
from sim.core.errors import SpecError
from sim.cost.ledger import MemoryLedger
from sim.cost.profile import layer_memory_fields, load_profile, profile_document
from sim.ir.ops import OpKind
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100"


@pytest.fixture(scope="module")
def measured():
    return measure_layer_memory(SPEC)


@pytest.mark.parametrize("spec", [SPEC, "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,seq=16,vocab=50",
                                  "moe:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,ffn=96,vocab=50,seq=16,"
                                  "experts=4,topk=2,expert_ffn=32"])
def test_what_a_layer_keeps_and_its_gradients_are_what_torchs_own_memory_tracker_counts(spec):
    """The oracle is PyTorch's MemTracker (``torch.distributed._tools.mem_tracker``), which attributes every live
    storage to a category as its tensors are made: after a layer's forward (the head's with its loss) its
    activations, less the storages the layer was handed (its input and the targets), are what the layer keeps; after
    the backward, its gradients. Ours are measured by an independent counter (``executor.memory.StorageCounter``)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from profiles.layer_inputs import layers_on_inputs

    cpu = torch.device("cpu")
    model = layers_on_inputs(spec, microbatch_size=2, seed=0, device=cpu)
    ours = measure_layer_memory(spec, microbatch_size=2)
    last = len(model.layers) - 1
    for i, (layer, given) in enumerate(zip(model.layers, model.inputs)):
        x = given.detach().clone().requires_grad_(i > 0)
        tracker = MemTracker()
        tracker.track_external(layer)
        with tracker:
            out = model.loss(layer(x), model.targets) if i == last else layer(x)
            kept = tracker.get_tracker_snapshot("current")[cpu][_MemRefType.ACT]
            out.backward(None if i == last else torch.randn_like(out))
            gradients = tracker.get_tracker_snapshot("current")[cpu][_MemRefType.GRAD]
        handed = (x.untyped_storage().nbytes() if i > 0 else 0) + (
            model.targets.untyped_storage().nbytes() if i == last else 0)
        assert (kept - handed, gradients) == (ours[i].retained_bytes, ours[i].gradient_bytes), model.graph.layers[i]


def test_state_is_four_bytes_per_parameter_and_adams_two_moments(measured):
    graph = build_model(SPEC)
    layers = build_layers(graph.spec, seed=0)
    for got, layer in zip(measured, layers):
        params = [p for p in layer.parameters()]
        count = sum(p.numel() for p in params)
        assert got.param_bytes == got.gradient_bytes == 4 * count
        assert got.optimizer_bytes == 8 * count + 4 * len(params)  # exp_avg, exp_avg_sq, and a float32 step each


def test_retained_is_what_autograd_saves_plus_the_output(measured):
    """Oracle: torch's saved-tensor hooks (each storage once, parameters and the input left out) plus the output's
    storage when autograd did not save it: what the forward keeps, by another route than counting storages."""
    graph = build_model(SPEC)
    layers = build_layers(graph.spec, seed=0)
    x = synthetic_batch(graph.spec, 1, seed=0, index=0)[0]
    with torch.no_grad():
        x = layers[0](x)
    layer = layers[1]  # a block
    x = x.detach().requires_grad_(True)
    skip = {p.untyped_storage()._cdata for p in layer.parameters()} | {x.untyped_storage()._cdata}
    saved: dict[int, int] = {}

    def pack(tensor):
        key = tensor.untyped_storage()._cdata
        if key not in skip:
            saved.setdefault(key, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    output = 0 if y.untyped_storage()._cdata in saved else y.untyped_storage().nbytes()
    assert measured[1].retained_bytes == sum(saved.values()) + output


def test_a_deferred_w_keeps_less_than_the_activations_and_the_embedding_none(measured):
    assert measured[0].deferred_bytes == 0  # no weight GEMM in an embedding lookup
    assert 0 < measured[1].deferred_bytes <= measured[1].retained_bytes + measured[1].output_bytes
    # A first backward makes the gradient buffers (less what it frees as it goes); a later one adds temporaries.
    assert measured[1].first_backward_bytes > measured[1].backward_transient_bytes


def _profile(tmp_path, measured) -> str:
    """A profile of ``measured`` (times are placeholders: only memory is under test)."""
    names = [layer.name for layer in build_model(SPEC).layers]
    layers = [{"name": name, "fwd_s": 1e-3, "bwd_s": 2e-3, **layer_memory_fields(m)}
              for name, m in zip(names, measured)]
    document = profile_document(model=build_model(SPEC).spec, device="cpu", microbatch_size=1, layers=layers,
                                method={}, machine={}, software={}, extra={"gradients": "per_step"})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_the_profile_reads_back_and_refuses_partial_memory(tmp_path, measured):
    path = _profile(tmp_path, measured)
    profile = load_profile(path)
    assert profile.gradients == "per_step" and profile.memory is not None
    assert [m.retained_bytes for m in profile.memory] == [m.retained_bytes for m in measured]
    data = json.loads((tmp_path / "profile.json").read_text())
    del data["layers"][1]["deferred_bytes"]
    (tmp_path / "partial.json").write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"layers\[1\]: deferred_bytes must be a non-negative integer"):
        load_profile(tmp_path / "partial.json")
    data = json.loads((tmp_path / "profile.json").read_text())
    data["gradients"] = "sometimes"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SpecError, match="gradients must be one of resident, per_step"):
        load_profile(tmp_path / "bad.json")
    for value in (0, True, "2"):
        data = json.loads((tmp_path / "profile.json").read_text())
        data["tensor_parallel"] = value
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(SpecError, match=r"tensor_parallel must be an integer >= 1 \(the measured shards' degree\)"):
            load_profile(tmp_path / "bad.json")
    assert profile.tensor_parallel == 1  # whole layers when the field is absent


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1p", "pipedream"])
def test_one_rank_memory_after_every_op_is_the_ledgers(tmp_path, measured, schedule):
    """A single-process reference run: one rank of the whole model, its live storages counted op by op by the
    executor's interpreter, against the ledger's replay of the same plan with the measured profile: every op's peak
    above the iteration's start within 3 % (the optimizer step's temporaries, which the ledger leaves out, are not
    compared)."""
    torch.manual_seed(0)
    built = build_plan(PlanInputs(SPEC, "1xcpu", schedule, 3, profile=_profile(tmp_path, measured)))
    plan = built.plan
    stage = build_stage(built.graph.spec, 0, len(built.graph), seed=0)
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("adam", stage.parameters())},
                                  loss_fn(built.graph.spec), {0: boundary_specs(built.graph.spec, [0], 1)[0]})
    batches = [synthetic_batch(built.graph.spec, 1, seed=0, index=j) for j in range(3)]
    inputs, targets = [x for x, _ in batches], [y for _, y in batches]
    interpreter.run_iteration(inputs, targets)  # Adam's state exists from here on, as in a measured iteration
    # Garbage other tests left in reference cycles would be collected during the iteration and counted as freed.
    gc.collect()
    counter = StorageCounter()
    counter.track(live_tensors())
    peaks: dict[str, int] = {}
    for kind, handler in list(interpreter.handlers.items()):
        def counted(op, handler=handler):
            counter.reset_peak()
            handler(op)
            peaks[op.id] = counter.peak_bytes
        interpreter.handlers[kind] = counted
    with counter:
        start = counter.live_bytes
        interpreter.run_iteration(inputs, targets)
    # The counter also sees whatever else this test process holds (other tests' tensors): compare what the
    # iteration adds above its start, the training state's bytes being a closed form checked above.
    ledger = MemoryLedger(plan, built.costs)
    level = ledger.resident(0)
    # Under weight stashing the ledger holds the starting weights' copy from the start; the executor makes it when
    # the iteration begins, after the counter's start.
    resident = level - (built.costs.param_bytes(0) if (0, 0) in ledger.stash_users else 0)
    for op in plan.programs[0]:
        released, allocated = ledger.start(op)
        level += allocated - released
        if op.kind is not OpKind.OPT_STEP:
            assert level - resident == pytest.approx(peaks[op.id] - start, rel=0.03, abs=4096), op.id
        level -= ledger.end(op)
