"""``--ep-dispatcher deduplicated``: the expert exchange sent once per server (DeepSeek-V3 §3.2.2). Oracles: the
plain all-to-all inside one server (the same time to the bit), a written plan predicting as the built one, the
group-limited routing read from DeepSeek-V3's config, and refusals."""

import pytest

from sim.core.errors import SpecError
from sim.ir.plan import Plan
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

SMALL = "moe:layers=4,hidden=256,heads=8,kv_heads=2,head_dim=32,ffn=512,vocab=1024,seq=512,experts=16,topk=4," \
        "expert_ffn=128,qk_norm=0"


def _time(topology, dispatcher, model=SMALL, ep=8, **extra):
    inputs = PlanInputs(model, topology, "1f1b", 4, dp=ep, ep=ep, zero=1, ep_dispatcher=dispatcher, **extra)
    built = build_plan(inputs)
    return built, predict_built(built).metrics["iteration_time_s"]


def test_inside_one_server_it_is_the_all_to_all():
    assert _time("8xH100", "deduplicated")[1] == _time("8xH100", "all-to-all")[1]


def test_across_servers_it_sends_less_and_a_written_plan_predicts_the_same():
    built, deduplicated = _time("2x8xH100", "deduplicated", ep=16)
    _, plain = _time("2x8xH100", "all-to-all", ep=16)
    assert deduplicated < plain
    assert built.plan.option("ep_dispatcher") == "deduplicated"
    again = predict(Plan.loads(built.plan.dumps()))
    assert again.metrics["iteration_time_s"] == deduplicated


def test_group_limited_routing_is_read_from_deepseek_v3s_config_and_checked():
    graph = build_model("deepseek-v3,seq=4096")
    mixture = next(layer.transformer.moe for layer in graph.layers if layer.transformer and layer.transformer.moe)
    assert (mixture.groups, mixture.group_topk) == (8, 4)  # its config's n_group and topk_group
    limited, _ = _time("2x8xH100", "deduplicated", model=SMALL + ",groups=4,group_topk=1", ep=16)
    # one group of 4 experts a token: all on one server (2 servers of 8 experts each), against up to 2 without
    assert predict_built(limited).metrics["iteration_time_s"] < _time("2x8xH100", "deduplicated", ep=16)[1]
    with pytest.raises(SpecError, match="group-limited routing needs"):
        build_model(SMALL + ",groups=3,group_topk=1")


@pytest.mark.parametrize("extra, message", [
    ({"ep": 1}, "needs --ep > 1"), ({"routing": "skew:1.0"}, "balanced dropless routing"),
])
def test_what_it_does_not_model_is_refused(extra, message):
    ep = extra.pop("ep", 16)
    with pytest.raises(SpecError, match=message):
        build_plan(PlanInputs(SMALL, "2x8xH100", "1f1b", 4, dp=16, ep=ep, ep_dispatcher="deduplicated", **extra))


def test_an_unknown_dispatcher_is_refused_by_name():
    with pytest.raises(SpecError, match="ep_dispatcher.*all-to-all, deduplicated, all-gather"):
        _time("8xH100", "deepep")


# --ep-dispatcher all-gather: Megatron-Core's all-gather token dispatcher (Megatron-LM's default).

def _exchange(dispatcher, topology="8xH100", ep=8):
    """The EP op of pipeline rank 0 under ``dispatcher``, with what it was computed from."""
    from sim.cost.expert_exchange import expert_exchange_cost
    from sim.cost.oracle import CostOracle
    from sim.cost.plan_costs import sharded_graph
    from sim.hw.topology import Topology
    from sim.ir.parallel import Parallelism
    from sim.models.routing import BALANCED

    layout = Parallelism(dp=ep, ep=ep, zero=1)
    graph = sharded_graph(SMALL, layout, "none", BALANCED, 0.0, dispatcher)
    oracle = CostOracle(graph, 2, None, Topology.parse(topology))
    return expert_exchange_cost(graph.layers, layout, 0, oracle, 2, 2), graph, layout, oracle


def test_all_gather_costs_the_gather_and_the_reduce_scatter_in_closed_form():
    cost, graph, layout, oracle = _exchange("all-gather")
    groups = tuple(layout.ep_group(0, d, 0) for d in range(layout.expert_dp))
    tokens, hidden, experts, members = 2 * 512, 256, 16, 8  # microbatch 2 of seq 512; SMALL's hidden and experts
    moe_layers = sum(1 for layer in graph.layers if layer.transformer and layer.transformer.moe)
    gathered = members * tokens * (hidden * 2 + experts * (2 + 1))  # states, scores (bf16) and the routing map
    combined = members * tokens * hidden * 2
    per_layer = (oracle.collective("all_gather", groups, gathered).seconds
                 + oracle.collective("reduce_scatter", groups, combined).seconds)
    assert moe_layers == 4
    assert cost.seconds == pytest.approx(moe_layers * per_layer, rel=1e-12)


def test_all_gather_moves_more_than_the_all_to_all_when_few_experts_are_chosen():
    # topk 4 of 16 experts over 8 ranks: the all-to-all sends each token's 4 copies (7/8 of them away), the gather
    # brings every rank all 8 ranks' tokens and the combine returns as much: more bytes, so longer.
    gathered, _, _, _ = _exchange("all-gather")
    plain, _, _, _ = _exchange("all-to-all")
    assert gathered.seconds > plain.seconds


def test_all_gather_is_refused_beside_tensor_parallelism():
    with pytest.raises(SpecError, match="needs --tp 1 and --etp 1"):
        build_plan(PlanInputs(SMALL, "8xH100", "1f1b", 4, tp=2, dp=4, ep=4, ep_dispatcher="all-gather"))
    built, _ = _time("8xH100", "all-gather")
    assert built.plan.option("ep_dispatcher") == "all-gather"
