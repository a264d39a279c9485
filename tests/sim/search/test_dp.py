"""The joint dynamic program over partition and placement: its bottleneck is, bit for bit, the best that balancing
each placement separately reaches over every placement (brute force); on one kind of device it is ``balanced``; the
dp strategy costs its plans by the one prediction path and, given the budget, finds the brute-force best on a
homogeneous cluster."""

import random
from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.cost.memory_sizes import StateShards
from sim.cost.oracle import CostOracle
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.models import build_model
from sim.plan.partition import balanced_counts, stage_time
from sim.search import dp as dp_module
from sim.search.dp import joint_candidates, joint_partition
from sim.search.evaluate import evaluate
from sim.search.placement import stage_placements
from sim.search.search import run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace, enumerate_candidates


def representatives(layout: Parallelism) -> tuple[int, ...]:
    """The device that stands for each pipeline stage in a plan (the oracle costs a stage on it)."""
    return tuple(layout.device(p, 0, 0) for p in range(layout.pp))


def brute_force(oracle: CostOracle, layout: Parallelism, topology: Topology) -> float:
    """The smallest bottleneck over every distinct placement, each balanced by ``--partition balanced``."""
    best = float("inf")
    for order in stage_placements(layout, topology, limit=10**6):
        ranks = representatives(replace(layout, devices=order))
        best = min(best, max(stage_time(oracle, balanced_counts(oracle, layout.pp, ranks), ranks)))
    return best


def cases(count: int, seed: int) -> list[tuple[str, str, int, Parallelism]]:
    rng = random.Random(seed)
    topologies = ["2xV100+2xA100", "4xV100+4xA100", "2xT4+2xV100+2xA100", "2xV100+2xA100+2xH100+2xT4",
                  "1xT4+3xA100", "2x2xV100+1x4xA100"]
    found = []
    for _ in range(count):
        topology = rng.choice(topologies)
        devices = Topology.parse(topology).num_ranks
        tp, dp = rng.choice([(1, 1), (1, 1), (1, 2), (2, 1)])
        pp = devices // (tp * dp)
        layers = rng.choice([pp, pp + 1, 2 * pp + 3, 14])
        model = f"gpt:layers={max(layers - 2, 1)},hidden={rng.choice([256, 512, 1024])},heads=8,seq=256,vocab=4000"
        found.append((topology, model, rng.choice([1, 2, 4]), Parallelism(tp=tp, dp=dp, pp=pp)))
    return found


@pytest.mark.parametrize("topology, model, microbatch, layout", cases(10, seed=5),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_the_joint_program_equals_the_best_balanced_placement_bit_for_bit(topology, model, microbatch, layout):
    cluster = Topology.parse(topology)
    oracle = CostOracle(build_model(model), microbatch, None, cluster)
    if layout.pp > len(oracle.graph):
        pytest.skip("more stages than layers")  # not drawn by the seeds above; kept for other seeds
    answer = joint_partition(oracle, layout, cluster)
    assert answer.bottleneck_s == brute_force(oracle, layout, cluster)
    # The answer is a plan: its counts on its device order have the bottleneck it claims, as the oracle costs it.
    ranks = representatives(replace(layout, devices=answer.devices))
    assert max(stage_time(oracle, answer.counts, ranks)) == answer.bottleneck_s
    assert sum(answer.counts) == len(oracle.graph) and min(answer.counts) >= 1


def test_on_one_kind_of_device_it_is_the_balanced_partition():
    cluster = Topology.parse("2x4xA100")
    oracle = CostOracle(build_model("gpt:layers=22,hidden=1024"), 2, None, cluster)
    for pp in (2, 4, 8):
        layout = Parallelism(dp=8 // pp, pp=pp)
        answer = joint_partition(oracle, layout, cluster)
        ranks = representatives(layout)
        assert answer.devices == ()
        assert answer.bottleneck_s == max(stage_time(oracle, balanced_counts(oracle, pp, ranks), ranks))


def test_a_program_too_large_is_refused_before_it_runs(monkeypatch):
    cluster = Topology.parse("4xV100+4xA100")
    oracle = CostOracle(build_model("gpt:layers=22,hidden=512"), 1, None, cluster)
    monkeypatch.setattr(dp_module, "MAX_WORK", 1000)
    with pytest.raises(SpecError, match="would touch .* more than 1,000"):
        joint_partition(oracle, Parallelism(pp=8), cluster)
    with pytest.raises(SpecError, match="more stages"):
        joint_partition(CostOracle(build_model("gpt:layers=2,hidden=512"), 1, None, cluster), Parallelism(pp=8),
                        cluster)


def test_each_pipeline_layout_keeps_one_placement_and_interleaved_keeps_its_own():
    problem = SearchProblem("gpt:layers=10,hidden=512,heads=8,seq=256,vocab=4000", "4xV100+4xA100", 16,
                            space=SearchSpace(schedules=("1f1b", "interleaved"), chunks=(2,), recompute=("none",),
                                              zero=(0,), sequence_parallel=(False,)))
    cluster = Topology.parse(problem.topology)
    listed = enumerate_candidates(problem, cluster.num_ranks, cluster)
    joint = joint_candidates(problem, cluster, listed)
    one_stage_per_rank = [c for c in joint if c.schedule == "1f1b" and c.pp > 1]
    layouts = {replace(c, devices=(), partition="balanced") for c in one_stage_per_rank}
    assert len(layouts) == len(one_stage_per_rank)  # one plan per layout
    assert all(c.partition != "balanced" for c in one_stage_per_rank)
    assert [c for c in joint if c.schedule == "interleaved"] == [c for c in listed if c.schedule == "interleaved"]


def test_the_dp_strategy_finds_the_brute_force_best_on_one_kind_of_device():
    problem = SearchProblem("gpt:layers=10,hidden=512,heads=8,seq=256,vocab=4000", "2x4xA100", 16,
                            space=SearchSpace(schedules=("gpipe", "1f1b", "zb1p"), recompute=("none", "full"),
                                              zero=(0,)))
    brute = run_search(problem)
    found = run_search(problem, strategy="dp", evaluations=brute.space_size)
    assert found.strategy == "dp" and found.space_size == brute.space_size
    assert found.best.iteration_time_s == brute.best.iteration_time_s
    for evaluation in found.evaluations[:5]:  # costed by the one prediction path
        assert evaluate(problem, evaluation.candidate) == evaluation


def test_a_layout_that_breaks_a_rule_stays_as_listed():
    cluster = Topology.parse("2xV100+2xA100")
    short = SearchProblem("gpt:layers=1,hidden=512,heads=8,seq=256,vocab=4000", "2xV100+2xA100", 8)
    four_stages = Candidate(1, 1, 4, 1, "1f1b")  # 3 layers (embedding, one block, head) cannot fill 4 stages
    assert joint_candidates(short, cluster, [four_stages]) == [four_stages]
    longer = replace(short, model="gpt:layers=2,hidden=512,heads=8,seq=256,vocab=4000")
    (placed,) = joint_candidates(longer, cluster, [four_stages])
    assert placed.partition == "1,1,1,1"


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("topology, layout, microbatches", [
    ("2xV100+2xA100", Parallelism(pp=4), 4),
    ("4xV100+4xA100", Parallelism(dp=2, pp=4), 2),
    ("2xV100+2xA100+2xT4+2xH100", Parallelism(dp=2, pp=4, zero=1), 3),
    ("2xV100+2xA100", Parallelism(tp=2, pp=2), 8),
], ids=lambda value: value if isinstance(value, str) else "")
def test_with_the_update_amortised_it_equals_brute_force_over_partitions_and_placements(topology, layout,
                                                                                        microbatches):
    # The brute force costs each plan through the plan's own cost view (the engine's numbers): per stage, the
    # partition's compute and messages plus (optimizer step + gradient reduction) / m, the slowest stage counting.
    from sim.cost.cost_view import replica_views
    from sim.cost.plan_settings import plan_sharding
    from sim.ir.plan import OpKind, Placement
    from sim.plan.partition import counts_to_ranges

    cluster = Topology.parse(topology)
    graph = build_model("gpt:layers=5,hidden=512,heads=8,seq=256,vocab=4000", plan_sharding(layout, "none"))
    oracle = CostOracle(graph, 2, None, cluster, shards=StateShards.of_zero(layout.zero, layout.dp))
    answer = joint_partition(oracle, layout, cluster, microbatches)
    best = float("inf")
    for order in stage_placements(layout, cluster, limit=10**6):
        placed = replace(layout, devices=order)
        ranks = representatives(placed)
        for counts in compositions(len(graph), layout.pp):
            placement = Placement(counts_to_ranges(counts), tuple(range(layout.pp)))
            (view, *_) = replica_views(graph, cluster, placement, 2, oracle=oracle, layout=placed)
            stages = stage_time(oracle, counts, ranks)
            updates = [view.compute_time(OpKind.OPT_STEP, s) + (
                view.collective_op(OpKind.REDUCE_GRAD, s).seconds + (view.collective_op(OpKind.GATHER_PARAMS, s).seconds
                                                             if layout.zero else 0.0) if layout.dp > 1 else 0.0)
                       for s in range(layout.pp)]
            best = min(best, max(c + u / microbatches for c, u in zip(stages, updates)))
    assert answer.bottleneck_s == pytest.approx(best, rel=1e-12)
