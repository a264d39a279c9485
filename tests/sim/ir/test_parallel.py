"""The tensor × data × pipeline layout: device numbering, groups, JSON, refusals."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.ir.parallel import RANK_ORDERS, Parallelism
from sim.ir.plan import Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

layouts = st.builds(Parallelism, tp=st.integers(1, 4), dp=st.integers(1, 4), pp=st.integers(1, 4),
                    order=st.sampled_from(RANK_ORDERS))


def test_megatron_order_is_tp_fastest_then_dp_then_pp():
    # Megatron-LM initialize_model_parallel: consecutive ranks form a tensor-parallel group, pipeline stages are
    # world/pp apart.
    layout = Parallelism(tp=2, dp=4, pp=8)
    for pp, dp, tp in itertools.product(range(8), range(4), range(2)):
        assert layout.device(pp, dp, tp) == tp + 2 * (dp + 4 * pp)
    assert layout.tp_group(3, 1) == (26, 27)
    assert layout.dp_group(0, 1) == (1, 3, 5, 7)
    assert layout.pp_group(0, 0) == tuple(range(0, 64, 8))


@settings(max_examples=60, deadline=None)
@given(layout=layouts)
def test_device_numbering_is_a_bijection_and_groups_partition_the_devices(layout):
    devices = [layout.device(p, d, t) for p in range(layout.pp) for d in range(layout.dp) for t in range(layout.tp)]
    assert sorted(devices) == list(range(layout.world_size))
    for device in range(layout.world_size):
        assert layout.device(*layout.coords(device)) == device
    for kind, size in (("tp", layout.tp), ("dp", layout.dp), ("pp", layout.pp)):
        groups = layout.groups()[kind]
        assert all(len(group) == size for group in groups)
        assert sorted(d for group in groups for d in group) == list(range(layout.world_size))


@settings(max_examples=40, deadline=None)
@given(layout=layouts)
def test_json_round_trip(layout):
    assert Parallelism.from_json(layout.to_json(), layout.pp, "x") == layout


def test_freed_stage_outputs_are_written_only_when_asked_and_read_back():
    kept, freed = Parallelism(pp=2), Parallelism(pp=2, deallocate_pipeline_outputs=True)
    assert "deallocate_pipeline_outputs" not in kept.to_json()
    assert freed.to_json()["deallocate_pipeline_outputs"] is True
    assert Parallelism.from_json(freed.to_json(), 2, "x") == freed
    assert "stage outputs freed once sent" in freed.describe()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tp": 0}, r"^tp must be an integer >= 1, got 0"),
    ({"dp": True}, r"^dp must be an integer >= 1, got True"),
    ({"order": "tp-pp"}, r"^order must be one of .*got 'tp-pp'"),
    ({"zero": 4, "dp": 2}, r"^zero must be one of 0, 1, 2, 3, got 4"),
    ({"zero": 2, "dp": 2, "reshard_after_forward": False}, r"^reshard_after_forward false .*needs zero 3"),
    ({"zero": 2, "dp": 2, "grad_overlap": True}, r"^grad_overlap buckets one reduction per step"),
    ({"zero": 1}, r"^zero 1 .*needs dp > 1"),
    ({"sequence_parallel": True}, r"^sequence_parallel .*needs tp > 1"),
    ({"deallocate_pipeline_outputs": True}, r"^deallocate_pipeline_outputs frees .*needs pp > 1"),
    ({"pp": 2, "deallocate_pipeline_outputs": 1}, r"^deallocate_pipeline_outputs must be true or false, got 1"),
])
def test_bad_layouts_are_refused_by_name(kwargs, message):
    with pytest.raises(SpecError, match=message):
        Parallelism(**kwargs)


def _plan_text() -> str:
    built = build_plan(PlanInputs("gpt:layers=4,hidden=64,heads=4,seq=16,vocab=128", "8xA100", "1f1b", tp=2, dp=2,
                                  pp=2, global_batch=8, microbatch_size=2))
    return built.plan.dumps()


def test_plan_json_carries_the_layout_and_its_groups():
    text = _plan_text()
    plan = Plan.loads(text)
    assert plan.layout == Parallelism(tp=2, dp=2, pp=2)
    assert plan.world_size == 8
    assert Plan.loads(plan.dumps()) == plan
    assert '"groups"' in text and '"tp": [\n' in text


def _edited(edit) -> str:
    data = json.loads(_plan_text())
    edit(data["parallel"])
    return json.dumps(data)


def test_a_hand_edited_group_is_refused():
    text = _edited(lambda parallel: parallel["groups"]["dp"][0].__setitem__(1, 3))
    with pytest.raises(SpecError, match=r"parallel.groups are not the groups of TP 2 × DP 2 × PP 2"):
        Plan.loads(text)


def test_a_layout_whose_pp_disagrees_with_the_programs_is_refused():
    with pytest.raises(SpecError, match=r"parallel.pp is 3 but the plan has 2 rank programs"):
        Plan.loads(_edited(lambda parallel: parallel.__setitem__("pp", 3)))


def test_an_unknown_layout_field_is_refused():
    with pytest.raises(SpecError, match=r"parallel has unknown field\(s\) 'overlap'"):
        Plan.loads(_edited(lambda parallel: parallel.__setitem__("overlap", True)))


def test_pure_pipeline_plans_have_no_parallel_object():
    built = build_plan(PlanInputs("uniform:layers=4", "4xideal", "1f1b", microbatches=4))
    assert built.plan.parallel is None
    assert '"parallel"' not in built.plan.dumps()
    assert built.plan.layout == Parallelism(pp=4)


@settings(max_examples=40, deadline=None)
@given(layout=layouts, seed=st.integers(0, 2**16))
def test_a_device_order_moves_every_position_and_coords_inverts_it(layout, seed):
    import random

    # A permutation of the pipeline ranks' blocks of devices (the search's placement moves): groups stay ascending.
    stages = list(range(layout.pp))
    random.Random(seed).shuffle(stages)
    block = {p: sorted(layout.device(p, d, t) for d in range(layout.dp) for t in range(layout.tp))
             for p in range(layout.pp)}
    order = [0] * layout.world_size
    for p in range(layout.pp):
        for src, dst in zip(block[p], block[stages[p]]):
            order[src] = dst
    try:
        placed = Parallelism(tp=layout.tp, dp=layout.dp, pp=layout.pp, order=layout.order, devices=tuple(order))
    except SpecError as exc:  # a nesting with pp inside another kind interleaves the blocks; then groups may reverse
        assert "ascending" in str(exc)
        return
    for pp, dp, tp in itertools.product(range(layout.pp), range(layout.dp), range(layout.tp)):
        device = placed.device(pp, dp, tp)
        assert device == order[layout.device(pp, dp, tp)]  # position i of the nesting runs on devices[i]
        assert placed.coords(device) == (pp, dp, tp)
    again = Parallelism.from_json(json.loads(json.dumps(placed.to_json())), layout.pp, "test")
    assert again == placed


@pytest.mark.parametrize("devices, message", [((0, 0, 1, 2), "each once"), ((0, 1, 2), "0..3"),
                                              ((1, 2, 3, 4), "0..3"), ((1, 0, 2, 3), "tp group \\[1, 0\\]")])
def test_a_device_order_that_is_not_a_permutation_is_refused(devices, message):
    with pytest.raises(SpecError, match=message):
        Parallelism(tp=2, pp=2, devices=devices)


def test_the_identity_order_simulates_like_no_order_and_a_reversed_one_moves_the_stages():
    from sim.predict import predict_built

    def run(devices):
        built = build_plan(PlanInputs(model="gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000",
                                      topology="2xV100+2xA100", tp=2, pp=2, global_batch=4, partition="uniform",
                                      devices=devices))
        return built, predict_built(built)

    (_, plain), (_, identity) = run(()), run((0, 1, 2, 3))
    assert identity.metrics["iteration_time_s"] == plain.metrics["iteration_time_s"]
    built, reversed_ = run((2, 3, 0, 1))
    assert [built.topology.devices[d].name for d in built.costs.devices] == ["a100-sxm4-80gb", "v100-sxm2-32gb"]
    assert reversed_.metrics["iteration_time_s"] != plain.metrics["iteration_time_s"]
