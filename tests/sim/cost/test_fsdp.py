"""ZeRO stages 2 and 3 (FSDP): the overlap of gathers and scatters with compute against closed forms, the state
against the ZeRO paper's memory forms, the lowering's collectives, and the refusals."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.cost import fsdp
from sim.cost.memory_sizes import StateShards, state_bytes_per_param
from sim.ir.plan import OpKind, Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

times = st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=12)


def test_forward_closed_forms():
    f = [1.0, 2.0, 3.0]
    assert fsdp.forward_seconds(f, [0.0, 0.0, 0.0]) == 6.0  # free collectives: compute only
    # Each gather shorter than the layer before it: only the first one is exposed.
    assert fsdp.forward_seconds(f, [0.5, 0.9, 1.9]) == 0.5 + 6.0
    # Collective-bound: the gathers back to back, then the last layer.
    assert fsdp.forward_seconds(f, [10.0, 10.0, 10.0]) == 30.0 + 3.0


def test_backward_closed_forms():
    b = [2.0, 2.0, 2.0]
    assert fsdp.backward_seconds(b, [0.0] * 3, [0.0] * 3) == 6.0
    # Collectives shorter than the compute they hide under: the last layer's gather before, the first layer's
    # reduce-scatter after.
    assert fsdp.backward_seconds(b, [0.5] * 3, [0.5] * 3) == 0.5 + 6.0 + 0.5
    # Kept after the forward: no gathers, only the trailing scatter exposed.
    assert fsdp.backward_seconds(b, None, [1.0] * 3) == 6.0 + 1.0
    # Collective-bound (no compute): every gather and scatter back to back on the one collective stream.
    assert fsdp.backward_seconds([0.0] * 3, [1.0] * 3, [1.0] * 3) == 6.0


@settings(max_examples=200, deadline=None)
@given(times, st.data())
def test_the_overlap_is_bounded_by_serial_and_by_either_stream(compute, data):
    n = len(compute)
    gather = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=n, max_size=n))
    scatter = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=n, max_size=n))
    forward = fsdp.forward_seconds(compute, gather)
    assert max(sum(compute), sum(gather)) - 1e-9 <= forward <= sum(compute) + sum(gather) + 1e-9
    backward = fsdp.backward_seconds(compute, gather, scatter)
    comm = sum(gather) + sum(scatter)
    assert max(sum(compute), comm) - 1e-9 <= backward <= sum(compute) + comm + 1e-9


def test_gathered_bytes():
    assert fsdp.forward_gathered_bytes([1, 5, 2, 4]) == 7  # a layer and the next (prefetched)
    assert fsdp.forward_gathered_bytes([3]) == 3
    # Backward at layer 2: its and layer 1's parameters, its and layer 3's gradients.
    assert fsdp.backward_gathered_bytes([1, 5, 2, 4], [10, 10, 30, 10], gather=True) == 2 + 5 + 30 + 10
    assert fsdp.backward_gathered_bytes([1, 5, 2, 4], [10, 10, 30, 10], gather=False) == 30 + 10


@pytest.mark.parametrize("zero, per_device_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_state_equals_the_zero_papers_forms(zero, per_device_gb):
    # ZeRO (arXiv 1910.02054) Figure 1: Ψ = 7.5 B parameters, N_d = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB.
    shards = StateShards.of_zero(zero, 64)
    assert 7.5e9 * state_bytes_per_param(2, shards) / 1e9 == pytest.approx(per_device_gb, abs=0.05)


GPT = "gpt:layers=4,hidden=512,heads=8,seq=256,vocab=1000"


def _built(zero, schedule="1f1b", **extra):
    return build_plan(PlanInputs(GPT, "2x4xA100", schedule, microbatches=4, dp=4, pp=2, zero=zero, **extra))


def test_zero2_reduces_each_microbatch_after_its_backward_and_gathers_after_the_step():
    plan = _built(2).plan
    for program in plan.programs:
        reductions = [op for op in program if op.kind is OpKind.REDUCE_GRAD]
        assert sorted(op.mb for op in reductions) == [0, 1, 2, 3]
        for op in reductions:  # right after the microbatch's backward of the stage, waiting for it
            assert op.deps == (f"{op.vstage}B{op.mb}",) and program[program.index(op) - 1].id == op.deps[0]
        step = next(op for op in program if op.kind is OpKind.OPT_STEP)
        assert set(step.deps) == {op.id for op in reductions}
        assert program[-1].kind is OpKind.GATHER_PARAMS


def test_zero3_has_no_step_collectives_and_costs_them_inside_forward_and_backward():
    built3, built0 = _built(3), _built(0)
    kinds = {op.kind for program in built3.plan.programs for op in program}
    assert OpKind.REDUCE_GRAD not in kinds and OpKind.GATHER_PARAMS not in kinds
    view3, view0 = predict_built(built3).costs, predict_built(built0).costs
    for v in range(2):
        assert view3.compute_time(OpKind.F, v) > view0.compute_time(OpKind.F, v)
        assert view3.compute_time(OpKind.B, v) > view0.compute_time(OpKind.B, v)
        assert view3.compute_time(OpKind.R, v) == view0.compute_time(OpKind.R, v)  # rebuilt with the B's gathers
        # Oracle: the ZeRO paper's split of the state, every part over the 4 replicas.
        assert view3.state_bytes(v) < view0.state_bytes(v) / 3.9


def test_keeping_gathered_parameters_costs_memory_and_saves_the_backwards_gathers():
    resharded, kept = _built(3), _built(3, reshard_after_forward=False)
    a, b = predict_built(resharded), predict_built(kept)
    assert b.costs.compute_time(OpKind.B, 0) < a.costs.compute_time(OpKind.B, 0)
    assert all(k > r for k, r in zip(b.peak_memory_bytes, a.peak_memory_bytes))
    assert kept.plan.layout.reshard_after_forward is False and "reshard_after_forward" in kept.plan.dumps()
    assert Plan.loads(kept.plan.dumps()) == kept.plan  # plan.json keeps it


@pytest.mark.parametrize("inputs, message", [
    (dict(zero=3, schedule="zb1p"), "--zero 3 is not modelled for a split backward"),
    (dict(zero=2, grad_overlap=True), "grad_overlap.*already reduces each microbatch"),
    (dict(zero=1, reshard_after_forward=False), "needs .*zero.* 3"),
])
def test_what_is_not_modelled_is_refused(inputs, message):
    schedule = inputs.pop("schedule", "1f1b")
    with pytest.raises(SpecError, match=message):
        _built(schedule=schedule, **inputs)


def test_hsdp_shards_within_groups_and_replicates_across_them():
    # dp 4 as 2 groups of 2: the state split over 2 (ZeRO §5's 16/N_d with N_d = 2); the shard groups are consecutive
    # data-parallel ranks, the replicate groups their counterparts.
    hsdp, fsdp_over_two = _built(3, dp_replicate=2), build_plan(PlanInputs(GPT, "2x2xA100", "1f1b", microbatches=4,
                                                                            dp=2, pp=2, zero=3))
    layout = hsdp.plan.layout
    assert layout.dp_shard == 2 and layout.shard_group(0, 0, 1) == (2, 3) and layout.replicate_group(0, 0, 0) == (0, 2)
    a, b = predict_built(hsdp).costs, predict_built(fsdp_over_two).costs
    assert [a.state_bytes(v) for v in range(2)] == [b.state_bytes(v) for v in range(2)]
    # The same gathers and scatters as FSDP over 2 (two groups at once, which can only slow them), and each gradient
    # shard all-reduced across the groups on top: the backward takes at least as long, the forward as long or more.
    assert a.compute_time(OpKind.B, 0) > b.compute_time(OpKind.B, 0)
    assert a.compute_time(OpKind.F, 0) >= b.compute_time(OpKind.F, 0)
    assert Plan.loads(hsdp.plan.dumps()) == hsdp.plan


def test_hsdp_with_groups_of_one_is_replication():
    # dp_replicate = dp: every shard group is one device, so nothing is gathered or scattered and the state is whole
    # (16 bytes per parameter, as without ZeRO); the gradients are all-reduced whole across the replicas.
    replicated, plain = predict_built(_built(3, dp_replicate=4)).costs, predict_built(_built(0)).costs
    assert [replicated.state_bytes(v) for v in range(2)] == [plain.state_bytes(v) for v in range(2)]
    assert replicated.compute_time(OpKind.F, 1) == plain.compute_time(OpKind.F, 1)


@pytest.mark.parametrize("inputs, message", [
    (dict(zero=1, dp_replicate=2), "dp_replicate 2 splits .* it needs zero 3"),
    (dict(zero=3, dp_replicate=3), "to divide dp"),
])
def test_hsdp_refusals(inputs, message):
    with pytest.raises(SpecError, match=message):
        _built(**inputs)
