"""The one assembly of a plan's costs (``sim.cost.plan_costs``): the shard built from everything that shapes it, kept
and shared where the inputs agree, and the same costs whether a plan is built or read back from its file."""

from dataclasses import replace

from sim.cost.cost_view import replica_views
from sim.cost.plan_costs import plan_costs, sharded_graph, written_plan_costs
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.ir.plan import OpKind
from sim.models import build_model
from sim.models.routing import parse_routing
from sim.models.sharding import Sharding
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

MOE = ("moe:layers=4,experts=8,hidden=512,expert_ffn=512,ffn=1024,heads=8,kv_heads=2,head_dim=64,seq=256,topk=2,"
       "vocab=4000")
GPT = "gpt:layers=8,hidden=256,heads=8,seq=256,vocab=4000"


def test_the_shard_is_the_models_own_builder_with_every_input_that_shapes_it():
    layout = Parallelism(pp=2, dp=2, ep=2)
    skew = parse_routing("skew:1.5:3")
    graph = sharded_graph(MOE, layout, "full", skew, 1.25)
    assert graph.layers == build_model(MOE, Sharding(ep=2, routing=skew, capacity_factor=1.25)).layers
    assert sharded_graph(MOE, layout, "full", skew, 1.25) is graph  # kept
    balanced = sharded_graph(MOE, layout, "full")
    assert balanced is not graph and balanced.layers != graph.layers  # the routing shapes the expert layers
    tensor = Parallelism(tp=2, pp=2, dp=2, sequence_parallel=True)
    assert sharded_graph(GPT, tensor, "selective").layers == build_model(
        GPT, Sharding(tp=2, sequence_parallel=True, selective_recompute=True)).layers


def test_layouts_with_the_same_state_sharding_share_one_oracle_and_others_do_not():
    topology = Topology.parse("8xA100")
    graph = sharded_graph(GPT, Parallelism(pp=2, dp=4))
    first = plan_costs(graph, topology, Parallelism(pp=2, dp=4), 2)
    assert plan_costs(graph, topology, Parallelism(pp=4, dp=2), 2).oracle is first.oracle  # no ZeRO: whole state
    assert plan_costs(graph, topology, Parallelism(pp=2, dp=4, zero=1), 2).oracle is not first.oracle
    assert plan_costs(graph, topology, Parallelism(pp=2, dp=4), 4).oracle is not first.oracle
    assert plan_costs(graph, Topology.parse("8xA100"), Parallelism(pp=2, dp=4), 2).oracle is not first.oracle


def test_a_written_plan_is_costed_as_it_was_built_routing_included():
    inputs = PlanInputs(model=MOE, topology="4xA100", schedule="1f1b", microbatch_size=2, pp=2, dp=2, ep=2,
                        global_batch=8, routing="skew:1.5", capacity_factor=1.25)
    built = build_plan(inputs)
    read = written_plan_costs(built.plan, Topology.parse(built.plan.topology))
    assert read.graph.layers == built.graph.layers
    (view,) = read.views(built.plan.placement)
    (built_view,) = built.views()
    for vstage in range(built.plan.num_vstages):
        for kind in (OpKind.F, OpKind.B, OpKind.EP_F, OpKind.EP_B):
            cost = (view.compute_time if kind in (OpKind.F, OpKind.B)
                    else (lambda k, v: view.collective_op(k, v).seconds))
            expected = (built_view.compute_time if kind in (OpKind.F, OpKind.B)
                        else (lambda k, v: built_view.collective_op(k, v).seconds))
            assert cost(kind, vstage) == expected(kind, vstage)
    balanced = build_plan(replace(inputs, routing="balanced", capacity_factor=0.0))
    assert balanced.graph.layers != built.graph.layers


def test_the_views_are_the_engines_replica_views():
    topology = Topology.parse("2xV100+2xA100")
    built = build_plan(PlanInputs(model=GPT, topology="2xV100+2xA100", schedule="1f1b", pp=2, dp=2, global_batch=8,
                                  rank_order="tp-pp-dp"))  # replica 0 on the V100s, replica 1 on the A100s
    layout = built.plan.layout
    costs = plan_costs(built.graph, built.topology, layout, built.plan.microbatch_size)
    views = costs.views(built.plan.placement)
    reference = replica_views(built.graph, topology, built.plan.placement, built.plan.microbatch_size,
                              layout=layout)
    assert len(views) == len(reference) == 2  # the replicas run on different devices: one view each
    for ours, theirs in zip(views, reference):
        assert (ours.replica, ours.concurrent, ours.devices) == (theirs.replica, theirs.concurrent, theirs.devices)
        assert [ours.compute_time(k, v) for k in (OpKind.F, OpKind.B) for v in range(2)] == \
            [theirs.compute_time(k, v) for k in (OpKind.F, OpKind.B) for v in range(2)]
