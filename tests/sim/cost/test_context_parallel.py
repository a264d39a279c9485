"""Context parallelism (``--cp``): the layout's data axis, the exchange's exposed time against closed forms, the
attention work of the load-balanced chunks against a brute-force count, the per-device model against the whole one,
and plans that use it (or are refused)."""

import math

import pytest

from sim.core.errors import SpecError
from sim.cost.collectives import concurrent_transfer
from sim.cost.context_parallel import KvExchange, exposed_seconds, kv_exchange
from sim.cost.kernels.llama import LlamaBlockShape, llama_block_kernels
from sim.cost.oracle import CostOracle
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.ir.plan import Plan
from sim.models import Sharding, build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built

LLAMA = "llama:layers=2,hidden=1024,heads=8,kv_heads=2,ffn=2816,vocab=1000,seq=4096"


def test_cp_ranks_sit_innermost_on_the_data_axis():
    layout = Parallelism(tp=2, dp=2, pp=2, cp=2)
    assert layout.world_size == 16 and layout.data_ranks == 4
    # device = tp + T·(data position + D·C·pp); data position = replica·C + part
    assert layout.cp_group(1, 1, 1) == tuple(1 + 2 * (1 * 2 + c + 4 * 1) for c in range(2))
    assert layout.dp_group(0, 0) == (0, 2, 4, 6)  # gradients reduce over replicas and sequence parts alike
    assert len(layout.groups()["cp"]) == 2 * 2 * 2
    assert Parallelism.from_json(layout.to_json(), 2, "test") == layout
    assert "cp" not in Parallelism(dp=2).to_json()  # plans without context parallelism are written as before
    hsdp = Parallelism(dp=4, cp=2, zero=3, dp_replicate=2)
    assert hsdp.dp_shard == 4 and hsdp.shard_group(0, 0, 1) == (4, 5, 6, 7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp=0), "cp must be an integer >= 1"),
    (dict(cp_comm="allgather"), "needs cp > 1"),
    (dict(cp=2, cp_comm="tree"), "must be one of ring, allgather"),
])
def test_bad_context_parallel_layouts_are_refused(kwargs, message):
    with pytest.raises(SpecError, match=message):
        Parallelism(**kwargs)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("attention, hop", [(1.0, 0.5), (1.0, 1.0), (1.0, 2.5)])
def test_exposed_exchange_matches_the_closed_forms(cp, attention, hop):
    # C equal steps of a seconds, hops of h: a ring forward waits (C−1)·max(0, h − a); an all-gather of g under the
    # first step max(0, g − a); a ring backward's hops carry twice the bytes, plus one last hop.
    steps = [attention] * cp
    ring = KvExchange("ring", cp, hop, 0.0)
    assert exposed_seconds(ring, steps, False) == pytest.approx((cp - 1) * max(0.0, hop - attention))
    assert exposed_seconds(ring, steps, True) == pytest.approx((cp - 1) * max(0.0, 2 * hop - attention) + hop)
    gather = KvExchange("allgather", cp, hop, 3 * hop)
    assert exposed_seconds(gather, steps, False) == pytest.approx(max(0.0, 3 * hop - attention))
    assert exposed_seconds(gather, steps, True) >= max(0.0, 3 * hop - attention) + hop


def test_the_exchange_is_costed_on_the_links():
    topology = Topology.parse("2x4xH100")
    inside = kv_exchange(topology, ((0, 1, 2, 3),), 64 << 20, "ring")
    across = kv_exchange(topology, ((0, 4),), 64 << 20, "ring")
    assert inside.shard_s == concurrent_transfer(topology, [(0, 1), (1, 2), (2, 3), (3, 0)], 64 << 20)[0]
    assert across.shard_s > inside.shard_s  # the network is slower than NVLink
    assert kv_exchange(topology, ((0, 1, 2, 3),), 64 << 20, "allgather").gather_s > inside.shard_s


def _pairs(s: int, cp: int, rank: int) -> int:
    """(query, key) pairs with key ≤ query among rank's tokens: chunks rank and 2·cp − 1 − rank of 2·cp."""
    chunk = s // (2 * cp)
    mine = [*range(rank * chunk, (rank + 1) * chunk), *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
    return sum(q + 1 for q in mine)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_does_its_share_of_the_causal_attention(cp):
    # Oracle: a brute-force count of the causal (query, key) pairs each rank's chunks hold: equal on every rank (the
    # load balance), their sum the whole triangle; the kernels' FLOPs are 4·d·heads per pair up to the 128-tile
    # rounding of the causal diagonal (a tile on it is computed whole).
    s, a, g, d = 4096, 8, 2, 64
    counts = [_pairs(s, cp, r) for r in range(cp)]
    assert len(set(counts)) == 1 and sum(counts) == s * (s + 1) // 2
    shape = LlamaBlockShape(1, s, a * d, a, g, d, 2816, 1, cp=cp)
    flops = sum(k.flops for k in llama_block_kernels(shape, backward=False) if k.kind == "attention")
    tiles = s // cp // 128
    assert flops >= 4 * d * a * counts[0]
    assert flops == pytest.approx(4 * d * a * counts[0], rel=1.5 / tiles)


def test_a_device_holds_one_cp_th_of_the_model_work():
    whole, split = build_model(LLAMA), build_model(LLAMA, Sharding(cp=4))
    for one, part in zip(whole.layers, split.layers, strict=True):
        assert part.flops_fwd * 4 == pytest.approx(one.flops_fwd, rel=1e-9)
        assert part.saved_bytes * 4 == one.saved_bytes
        assert part.param_bytes == one.param_bytes  # parameters are whole on every sequence part
    with pytest.raises(SpecError, match="multiple of 16"):
        build_model(LLAMA.replace("seq=4096", "seq=4100"), Sharding(cp=8))
    with pytest.raises(SpecError, match="llama and moe families only"):
        build_model("gpt:layers=2", Sharding(cp=2))


def test_plans_with_context_parallelism():
    inputs = dict(microbatch_size=1, global_batch=2, zero=3, cp=2)
    plain = build_plan(PlanInputs(LLAMA, "4xH100", "1f1b", dp=2, zero=3, global_batch=4))
    ring = build_plan(PlanInputs(LLAMA.replace("seq=4096", "seq=8192"), "4xH100", "1f1b", dp=1, **inputs))
    layout = ring.plan.layout
    assert layout.cp == 2 and layout.dp_shard == 2 and ring.plan.num_microbatches == 2
    written = predict(Plan.loads(ring.plan.dumps()))
    # one prediction path: the written plan predicts what the built one did
    assert written.metrics["iteration_time_s"] == predict_built(ring).metrics["iteration_time_s"]
    # Twice the sequence on twice the devices per sample: about the same tokens per device (attention grows).
    tokens = written.metrics["tokens_per_s_per_device"]
    assert 0.5 < tokens / predict(Plan.loads(plain.plan.dumps())).metrics["tokens_per_s_per_device"] < 1.0
    gather = build_plan(PlanInputs(LLAMA.replace("seq=4096", "seq=8192"), "4xH100", "1f1b", dp=1, cp_comm="allgather",
                                   **inputs))
    assert gather.plan.layout.cp_comm == "allgather"
    with pytest.raises(SpecError, match="llama and moe families only"):
        build_plan(PlanInputs("gpt:layers=2,seq=1024", "4xH100", "1f1b", dp=2, cp=2, global_batch=2))
    assert math.isfinite(tokens)


def test_on_the_roofline_the_exchange_is_waited_for():
    # Oracle: on CPU ranks (the roofline; the executor's gathers there are blocking) a block's forward is the
    # roofline's plus the whole ring of hops, (C − 1) hops, and its backward twice the bytes' hops plus the last one:
    # the difference from the same shard whose "group" is one device twice (hops of 0 s) is exactly that.
    spec = LLAMA.replace("seq=4096", "seq=256")
    split = build_plan(PlanInputs(spec, "2xcpu", "1f1b", dp=1, cp=2, global_batch=1))
    oracle, device = split.costs.oracle, split.topology.devices[0]
    hop = oracle._kv_exchange(oracle.graph.layers[1].transformer).shard_s
    assert hop > 0
    alone = CostOracle(oracle.graph, 1, None, split.topology, cp_groups=((0, 0),), cp_comm="ring")
    with_exchange, without = oracle.layer_costs(device), alone.layer_costs(device)
    assert with_exchange.fwd[1] - without.fwd[1] == pytest.approx(hop, rel=1e-12)
    assert with_exchange.bwd[1] - without.bwd[1] == pytest.approx(3 * hop, rel=1e-12)
    assert with_exchange.fwd[0] == without.fwd[0]  # the embedding exchanges nothing
