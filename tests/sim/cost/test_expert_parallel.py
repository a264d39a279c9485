"""Expert parallelism: the folded groups against brute force, the all-to-all against its closed form on one switch
(balanced and with a traffic matrix), where the lowering puts the EP ops, the expert state's sharding and
reduction, and a written plan predicting what the built one did."""

import itertools
import json

import pytest

from sim.core.errors import SpecError
from sim.core.spec import SpecParams, parse_spec
from sim.cost.collectives import all_to_all_cost
from sim.hw.topology import Topology
from sim.ir.ops import EP_KINDS, OpKind
from sim.ir.parallel import Parallelism
from sim.ir.plan import Plan
from sim.models import build_model
from sim.models.moe import expert_params, shape_of
from sim.models.sharding import Sharding
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict

#: A small mixture (8 experts, top 2) that builds and simulates in well under a second.
SMALL = "moe:layers=4,hidden=256,heads=8,kv_heads=2,head_dim=32,ffn=512,vocab=1024,seq=512,experts=8,topk=2," \
        "expert_ffn=128,qk_norm=0"


@pytest.mark.parametrize("tp, dp, cp, ep, etp", [(1, 8, 1, 8, 1), (2, 4, 1, 4, 1), (2, 2, 2, 2, 2), (1, 4, 2, 4, 2),
                                                 (4, 2, 1, 2, 4)])
def test_folded_groups_partition_each_stage_as_megatron_numbers_them(tp, dp, cp, ep, etp):
    layout = Parallelism(tp=tp, dp=dp, cp=cp, pp=2, ep=ep, etp=etp)
    for p in range(2):
        stage = [layout.device(p, d, t) for d in range(layout.data_ranks) for t in range(tp)]  # position order
        # brute force: position i has etp rank i % etp, ep rank (i // etp) % ep, edp rank i // (etp·ep)
        expected = {}
        for i, device in enumerate(stage):
            expected.setdefault((i // (etp * ep), i % etp), []).append(device)
        groups = {(d, t): list(layout.ep_group(p, d, t)) for d in range(layout.expert_dp) for t in range(etp)}
        assert groups == expected
        covered = sorted(itertools.chain.from_iterable(groups.values()))
        assert covered == sorted(stage)
        for e in range(ep):
            for t in range(etp):
                holders = layout.expert_dp_group(p, e, t)  # the same experts: the same (ep, etp) ranks
                assert len(holders) == layout.expert_dp == tp * dp * cp // (ep * etp)
                assert all(holder == groups[(d, t)][e] for d, holder in enumerate(holders))
        for device in stage:  # each device's coordinates place it in its three groups
            d, e, t = layout.expert_coords(device)
            assert layout.ep_group(p, d, t)[e] == device == layout.etp_group(p, d, e)[t] \
                == layout.expert_dp_group(p, e, t)[d]


def test_a_fold_that_does_not_divide_the_stage_is_refused_with_the_numbers():
    with pytest.raises(SpecError, match=r"TP × CP × DP = 2 × 1 × 3 = 6 devices: ep × etp = 4 × 1 = 4 must divide"):
        Parallelism(tp=2, dp=3, ep=4)
    with pytest.raises(SpecError, match="ep=3 must divide experts=8"):
        build_model(SMALL, Sharding(ep=3))


def test_a_balanced_all_to_all_on_one_switch_is_its_closed_form():
    topology = Topology.parse("8xH100")
    link = topology.path(0, 1)[0].spec  # every GPU's one NVSwitch port
    nbytes = 64 * 2**20
    for n in (2, 4, 8):
        cost = all_to_all_cost(topology, [list(range(n))], nbytes)
        # each member's port carries (n - 1)/n of its bytes out and as much in, two hops through the switch
        assert cost.seconds == pytest.approx((n - 1) / n * nbytes / link.bandwidth + 2 * link.latency, rel=1e-12)
    # two groups at once on their own ports: no slower than one
    two = all_to_all_cost(topology, [[0, 1, 2, 3], [4, 5, 6, 7]], nbytes)
    assert two.seconds == pytest.approx(all_to_all_cost(topology, [[0, 1, 2, 3]], nbytes).seconds, rel=1e-12)


def test_a_skewed_traffic_matrix_is_bounded_by_the_busiest_receiver():
    topology = Topology.parse("8xH100")
    link = topology.path(0, 1)[0].spec
    nbytes, shares = 64 * 2**20, (0.4, 0.2, 0.2, 0.2)
    cost = all_to_all_cost(topology, [[0, 1, 2, 3]], nbytes, shares)
    # member 0 receives 0.4·S from each of the three others on its one port; every sender's port carries less
    assert cost.seconds == pytest.approx(3 * 0.4 * nbytes / link.bandwidth + 2 * link.latency, rel=1e-12)
    assert cost.seconds > all_to_all_cost(topology, [[0, 1, 2, 3]], nbytes).seconds
    with pytest.raises(ValueError, match="shares must be 4 numbers"):
        all_to_all_cost(topology, [[0, 1, 2, 3]], nbytes, (0.5, 0.5))


def test_across_servers_the_network_carries_the_remote_share():
    topology = Topology.parse("2x8xH100")
    inside = all_to_all_cost(topology, [list(range(8))], 2**26).seconds
    across = all_to_all_cost(topology, [list(range(16))], 2**26).seconds
    assert across > 3 * inside  # half of every member's tokens leave the server through its NIC


def _inputs(**extra):
    return PlanInputs(SMALL, "8xH100", "1f1b", 4, dp=4, pp=2, ep=4, zero=1, **extra)


def test_the_lowering_puts_each_exchange_after_its_compute_and_tensor_parallel_op():
    built = build_plan(PlanInputs(SMALL, "8xH100", "1f1b", 4, tp=2, sequence_parallel=True, dp=2, pp=2, ep=4,
                                  zero=1))
    for program in built.plan.programs:
        ids = [op.id for op in program]
        for i, op in enumerate(program):
            if op.kind in (OpKind.F, OpKind.B):
                tp, ep = ("TP_F", "EP_F") if op.kind is OpKind.F else ("TP_B", "EP_B")
                assert ids[i + 1] == f"{op.vstage}{tp}{op.mb}" and ids[i + 2] == f"{op.vstage}{ep}{op.mb}"
            if op.kind is OpKind.SEND_F:  # what leaves a forward waits for its exchange, not its compute
                assert f"{op.vstage}EP_F{op.mb}" in op.deps
    assert any(op.kind in EP_KINDS for program in built.plan.programs for op in program)


def test_expert_state_is_split_over_the_expert_data_parallel_group():
    built = build_plan(_inputs())
    graph, views = built.graph, built.costs
    shape = shape_of(SpecParams(SMALL, parse_spec(SMALL)[1]))[0]
    experts = sum(layer.expert_param_bytes for layer in graph.layers) // 2
    assert experts == shape.layers * expert_params(shape, 4)  # each device holds a quarter of every layer's experts
    # ZeRO-1 over 4 replicas: the rest's optimizer state split 4 ways (2 + 2 + 12/4 bytes a parameter); the
    # experts' (EP 4 over the 4 replicas: expert-DP 1) whole (2 + 2 + 12)
    start, end = built.plan.placement.vstage_layers[0]
    stage_experts = sum(graph.expert_param_count(i) for i in range(start, end))
    stage = sum(graph.param_count(i) for i in range(start, end))
    assert stage_experts > 0
    assert views.state_bytes(0) == pytest.approx((stage - stage_experts) * 7 + stage_experts * 16, abs=1)
    # the reduction: the rest reduce-scattered over the data-parallel group, the experts over their own group, a
    # single device here: nothing to move
    layout = built.plan.layout
    dense = views.param_bytes(0) - 2 * stage_experts
    alone = views.oracle.collective("reduce_scatter", (layout.dp_group(0, 0),), dense).seconds
    assert views.collective_op(OpKind.REDUCE_GRAD, 0).seconds == pytest.approx(alone, rel=1e-12)


def test_a_written_plan_predicts_what_the_built_one_did_with_its_routing():
    built = build_plan(_inputs(routing="skew:1.2:3", capacity_factor=1.5))
    assert built.plan.option("routing") == "skew:1.2:3" and built.plan.option("capacity_factor") == 1.5
    from sim.predict import predict_built

    written = predict(Plan.loads(built.plan.dumps()))
    assert written.metrics["iteration_time_s"] == predict_built(built).metrics["iteration_time_s"]
    balanced = predict_built(build_plan(_inputs()))
    assert written.metrics["iteration_time_s"] > balanced.metrics["iteration_time_s"]


def test_expert_flags_are_refused_where_they_mean_nothing():
    with pytest.raises(SpecError, match="belong to the moe family"):
        build_plan(PlanInputs("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=100", "8xH100", "1f1b", 4, dp=4, pp=2,
                              ep=4))
    with pytest.raises(SpecError, match="zero 3 .FSDP. is not modelled for a mixture of experts"):
        build_plan(PlanInputs(SMALL, "8xH100", "1f1b", 4, dp=4, pp=2, ep=4, zero=3))
    with pytest.raises(SpecError, match="capacity_factor must be a number >= 0"):
        build_plan(_inputs(capacity_factor=-1.0))


def test_replicas_simulated_one_by_one_exchange_tokens_as_one_all_to_all():
    # An expert-parallel group spans data-parallel replicas: their copies of one microbatch's EP op are one exchange,
    # so simulating every replica gives the time one replica standing for all gives (they must not queue).
    from sim.predict import predict_built

    built = build_plan(_inputs())
    one = predict_built(built).metrics["iteration_time_s"]
    every = predict_built(built, simulate_all=True).metrics["iteration_time_s"]
    assert every == pytest.approx(one, rel=1e-9)


def test_sim_run_shows_what_a_skew_costs_against_balanced_routing(tmp_path, capsys):
    # The oracle: the same plan simulated with balanced dropless routing by its own sim.run.
    from sim.run import main as sim_main

    common = ["--model", SMALL, "--topology", "8xH100", "--dp", "4", "--pp", "2", "--ep", "4", "-m", "4", "--no-gantt"]
    assert sim_main([*common, "--out", str(tmp_path / "balanced")]) == 0
    balanced = json.loads((tmp_path / "balanced" / "metrics.json").read_text())
    assert "routing" not in balanced and "routing " not in capsys.readouterr().out
    assert sim_main([*common, "--routing", "skew:1.2:3", "--out", str(tmp_path / "skew")]) == 0
    skew = json.loads((tmp_path / "skew" / "metrics.json").read_text())
    routing = skew["routing"]
    assert routing["balanced_iteration_time_s"] == balanced["iteration_time_s"]
    assert routing["slowdown_vs_balanced"] == skew["iteration_time_s"] / balanced["iteration_time_s"] > 1
    assert (routing["routing"], routing["capacity_factor"]) == ("skew:1.2:3", 0.0)
    assert f"routing           skew:1.2:3: {routing['slowdown_vs_balanced']:.2f}x the iteration time of balanced " \
           f"dropless routing" in capsys.readouterr().out
