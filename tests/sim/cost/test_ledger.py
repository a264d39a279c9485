"""The memory ledger (``sim.cost.ledger``): every effect has a rule, its program-order replay is the engine's peak on
random plans of every schedule, and full recomputation keeps one checkpoint per layer and rebuilds one layer at a
time (closed forms in the model's own sizes)."""

import random

import pytest

from sim.core.errors import SpecError
from sim.cost.cost_view import replica_views
from sim.cost.ledger import RULES, MemoryLedger, ReductionMemory, program_order_peaks
from sim.engine.simpy_engine import simulate
from sim.ir.ops import OP_SEMANTICS, MemoryEffect, Op, OpKind
from sim.models import gpt
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs


def test_every_memory_effect_has_a_rule_and_every_rule_a_method():
    assert set(RULES) == set(MemoryEffect)
    assert {semantics.memory for semantics in OP_SEMANTICS.values()} <= set(RULES)
    for method in RULES.values():
        assert callable(getattr(MemoryLedger, method))


def _engine_and_ledger(inputs):
    built = build_plan(inputs)
    plan, oracle = built.plan, built.costs.oracle
    views = replica_views(oracle.graph, built.topology, plan.placement, plan.microbatch_size, None, oracle=oracle,
                          layout=plan.layout)
    engine = simulate(plan, views, built.topology, check_memory=False).peak_memory_bytes
    return engine, program_order_peaks(plan, views)


def _random_inputs(rng):
    schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb1p", "pipedream", "stream"])
    p = rng.choice([1, 2, 4])
    tp, dp = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2)]) if schedule != "stream" else (1, 1)
    devices = tp * dp * p
    mixed = devices > 1 and schedule != "interleaved" and rng.random() < 0.5
    topology = (f"{devices // 2}xV100+{devices // 2}xA100" if mixed else
                f"{devices}xA100" if devices <= 8 else f"{devices // 8}x8xA100")
    recompute = "none" if schedule == "stream" else rng.choice(["none", "full", "selective"])
    layers = 8 if schedule != "interleaved" else 8 * 2
    model = f"gpt:layers={layers},hidden=256,heads=8,seq=128,vocab=1000"
    m = rng.choice([p, 2 * p + 1, 3 * p])
    zero = rng.choice([0, 1, 2, 3]) if dp > 1 else 0
    return PlanInputs(model, topology, schedule, m, pp=p, tp=tp, dp=dp, chunks=2 if schedule == "interleaved" else 1,
                      recompute=recompute, microbatch_size=rng.choice([1, 2]), zero=zero,
                      reshard_after_forward=zero != 3 or rng.random() < 0.5,
                      rank_order=rng.choice(["tp-dp-pp", "tp-pp-dp"]))


def test_program_order_replay_is_the_engines_peak_on_random_plans_of_every_schedule():
    """Oracle: the SimPy engine's peak per simulated rank. Without host copies memory changes only at a rank's own
    ops, in program order, so the replay without times must give the same bytes (module docstring of the ledger)."""
    rng = random.Random(2026)
    seen, zeros = set(), set()
    checked = 0
    for _ in range(300):
        inputs = _random_inputs(rng)
        try:
            engine, replay = _engine_and_ledger(inputs)
        except SpecError:  # a combination the product refuses (e.g. ZeRO with stashing, TP across device models)
            continue
        assert replay == engine, inputs
        seen.add((inputs.schedule, inputs.recompute_mode))
        zeros.add((inputs.zero, inputs.reshard_after_forward))
        checked += 1
        if checked == 48:
            break
    assert checked == 48
    assert {schedule for schedule, _ in seen} == {"gpipe", "1f1b", "interleaved", "zb1p", "pipedream", "stream"}
    assert {mode for _, mode in seen} == {"none", "full", "selective"}
    assert {zero for zero, _ in zeros} == {0, 1, 2, 3} and (3, False) in zeros


def test_host_copies_are_refused_by_the_replay():
    built = build_plan(PlanInputs("uniform:layers=2", "1xideal", "1f1b", 1))
    program = (Op(OpKind.PREFETCH, 0), *built.plan.programs[0])
    with pytest.raises(ValueError, match="host copies"):
        program_order_peaks(built.plan.with_programs((program,), level="L1"), (built.costs,))


def _gpt_checkpoint(layers, hidden, seq, batch):
    """Closed form of what one microbatch of a whole GPT on one device keeps under full recomputation
    (sim.models.gpt): every layer's input (token ids for the embedding, a 2·s·h tensor for each block and the
    head)."""
    act = gpt.DTYPE_BYTES * seq * hidden
    return batch * (gpt.TOKEN_ID_BYTES * seq + (layers + 1) * act)


@pytest.mark.parametrize("layers, hidden, seq", [(4, 256, 128), (6, 512, 256)])
def test_full_recompute_keeps_each_layers_input_and_rebuilds_the_largest_layer(layers, hidden, seq):
    """At one stage the peak is state + checkpoint + the largest layer's saved tensors + the workspace (while the
    backward of the last layer rebuilt runs), against state + all activations + workspace without recomputation."""
    spec = f"gpt:layers={layers},hidden={hidden},heads=8,seq={seq},vocab=1000"
    batch = 2
    plain = build_plan(PlanInputs(spec, "1xA100", "1f1b", 3, microbatch_size=batch))
    full = build_plan(PlanInputs(spec, "1xA100", "1f1b", 3, microbatch_size=batch, recompute=True))
    graph = full.graph
    state = full.costs.state_bytes(0)
    workspace = batch * max(layer.workspace_bytes for layer in graph.layers)
    saved = [batch * layer.saved_bytes for layer in graph.layers]
    assert full.costs.checkpoint_bytes(0) == _gpt_checkpoint(layers, hidden, seq, batch)
    assert full.costs.rebuilt_bytes(0) == max(saved)
    assert full.costs.activation_bytes(0) == batch * gpt.TOKEN_ID_BYTES * seq + sum(saved)
    (peak_full,) = simulate(full.plan, full.costs, full.topology).peak_memory_bytes
    (peak_plain,) = simulate(plain.plan, plain.costs, plain.topology).peak_memory_bytes
    assert peak_full == state + _gpt_checkpoint(layers, hidden, seq, batch) + max(saved) + workspace
    assert peak_plain == state + full.costs.activation_bytes(0) + workspace
    assert peak_full < peak_plain


def test_recompute_at_one_stage_now_saves_memory_on_a_large_gpt():
    """A 32-layer h4096 GPT at seq 8192 on 8 A100s, TP 8 (one pipeline stage): recomputation used to rebuild the whole
    stage at once and saved nothing; one layer at a time it fits in a third of the memory."""
    spec = "gpt:layers=32,hidden=4096,seq=8192"
    peaks = {}
    for recompute in (False, True):
        built = build_plan(PlanInputs(spec, "8xA100", "1f1b", 8, tp=8, recompute=recompute))
        (peaks[recompute],) = program_order_peaks(built.plan, (built.costs,))
    assert peaks[True] < peaks[False] / 2.5


def test_a_flat_copy_reduction_holds_the_gradients_from_its_issue_to_the_update():
    """One stage, DP 2, whose reduction copies the gradients (a profile says so for the executor): the engine and the
    replay agree, and the peak is the larger of the plain plan's and the state plus one more copy of the gradients
    (all activations are freed by the time the reduction is issued, after the last backward)."""
    built = build_plan(PlanInputs("gpt:layers=4,hidden=512,heads=8,seq=32,vocab=1000", "2xA100", "gpipe", 1, dp=2))
    plan, oracle = built.plan, built.costs.oracle
    plain = replica_views(oracle.graph, built.topology, plan.placement, plan.microbatch_size, None, oracle=oracle,
                          layout=plan.layout)

    class Copying(type(plain[0])):
        def reduction_memory(self, vstage):
            return ReductionMemory(until_update=self.gradient_bytes(vstage))

    copying = tuple(Copying(oracle.graph, built.topology, plan.placement, plan.microbatch_size, None, oracle=oracle,
                            layout=plan.layout, replica=view.replica, concurrent=view.concurrent) for view in plain)
    engine = simulate(plan, copying, built.topology, check_memory=False).peak_memory_bytes
    assert program_order_peaks(plan, copying) == engine
    state, gradients = copying[0].state_bytes(0), copying[0].gradient_bytes(0)
    before = program_order_peaks(plan, plain)
    assert engine == tuple(max(peak, state + gradients) for peak in before)
    assert engine != before  # this plan's activations are smaller than its gradients: the copy sets the peak


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_reduction_holds_what_the_executor_holds_of_its_flat_copy(tmp_path, zero):
    """Where a profile says the framework reduces a flat copy (``executor.data_parallel``): without ZeRO the copy is
    the all-reduce's result and stays until the update; under ZeRO-1 and 2 the copy is freed when its reduce-scatter
    ends and the replica's slice of the result (1/D of it) stays until the update; ZeRO-2's copy replaces the
    microbatch's gradients, which its next backward makes again."""
    import json

    from sim.models import build_model

    graph = build_model("gpt:layers=2,hidden=64,heads=2,seq=16,vocab=100")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "format": "pipedejavu-profile", "format_version": 1, "model": graph.spec, "device": "cpu",
        "microbatch_size": 1, "gradients": "per_step", "reduction": "flat_copy",
        "layers": [{"name": layer.name, "fwd_s": 1e-3, "bwd_s": 2e-3} for layer in graph.layers]}))
    built = build_plan(PlanInputs(graph.spec, "2xcpu", "1f1b", microbatch_size=1, dp=2, pp=1, zero=zero,
                                  global_batch=4, profile=str(profile)))
    view = built.views()[0]
    ledger = MemoryLedger(built.plan, view)
    gradients = view.gradient_bytes(0)
    flat, slice_ = gradients, -(-gradients // 2)
    for op in built.plan.programs[0]:
        released, allocated = ledger.start(op)
        if op.kind is OpKind.REDUCE_GRAD:
            assert released == (gradients if zero == 2 else 0)
            assert allocated == (flat if zero == 0 else slice_ + flat)
            assert ledger.end(op) == (0 if zero == 0 else flat)
            continue
        if op.kind is OpKind.OPT_STEP:
            reductions = 1 if zero < 2 else built.plan.num_microbatches
            assert released == (flat if zero == 0 else reductions * slice_)
        ledger.end(op)
