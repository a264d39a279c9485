"""The balanced partition is exactly optimal (checked against brute force), returns exactly what the original
O(p·n²) dynamic program returns (kept here as the reference), and the other methods."""

import math
import random
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.bench.reference_partition import reference_dp, reference_stage_cost
from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.cost.profile import LayerTiming, MeasuredProfile
from sim.hw.topology import Topology
from sim.models import build_model
from sim.models.graph import Layer, LayerGraph
from sim.plan import bottleneck
from sim.plan.bottleneck import StageCosts, min_max_counts
from sim.plan.partition import balanced_counts, counts_to_ranges, parse_partition, stage_time, uniform_counts
from tests.sim.cost.nccl_closed_form import nccl_call_s


def _graph(times, acts):
    layers = [Layer(f"l{i}", "uniform", 0.0, 0.0, 0, a, a, 0, f, b) for i, ((f, b), a) in enumerate(zip(times, acts))]
    return LayerGraph("custom", layers, dtype_bytes=2, input_bytes=0)


def _brute_force_best(graph, topo, p):
    n = len(graph)
    best = float("inf")
    for cuts in combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        best = min(best, max(stage_time(CostOracle(graph, 1, None, topo), counts)))
    return best


@settings(max_examples=80, deadline=None)
@given(
    p=st.integers(1, 4),
    topology=st.sampled_from(["{p}xideal", "{p}xV100", "1x{p}xT4", "{p}xV100+{p}xA100"]),
    data=st.data(),
)
def test_balanced_equals_brute_force(p, topology, data):
    n = data.draw(st.integers(p, 8), label="layers")
    times = data.draw(st.lists(st.tuples(st.floats(1e-4, 1e-2), st.floats(1e-4, 1e-2)), min_size=n, max_size=n))
    acts = data.draw(st.lists(st.integers(0, 400_000_000), min_size=n, max_size=n), label="activation bytes")
    graph = _graph(times, acts)
    topo = Topology.parse(topology.format(p=p))
    counts = balanced_counts(CostOracle(graph, 1, None, topo), p)
    assert sum(counts) == n and len(counts) == p and min(counts) >= 1
    best = _brute_force_best(graph, topo, p)
    assert max(stage_time(CostOracle(graph, 1, None, topo), counts)) == pytest.approx(best, rel=1e-12)


def test_stage_time_adds_transfers_in_both_directions():
    graph = _graph([(1e-3, 2e-3)] * 4, [1_000_000] * 4)
    topo = Topology.parse("2xV100")
    oracle = CostOracle(graph, 1, None, topo)
    # Each direction is one NCCL message between GPUs of an NVLink server: the link model at NCCL's cheapest
    # protocol for one step.
    forward = nccl_call_s(topo.transfer_time(1_000_000, 0, 1), 1, "nvlink")
    backward = nccl_call_s(topo.transfer_time(1_000_000, 1, 0), 1, "nvlink")
    assert stage_time(oracle, (2, 2)) == pytest.approx((6e-3 + forward, 6e-3 + backward))


def test_heterogeneous_devices_get_more_layers_on_the_faster_one():
    # A roofline model (cnn's convolutions) and GPT's kernel model at a microbatch large enough for the GPU, not
    # the host issuing kernels, to set a block's time: both make the H100 faster per layer than the V100.
    topo = Topology.parse("1xV100+1xH100")
    for spec, microbatch_size in (("cnn:layers=16", 1), ("gpt:layers=16,hidden=1024", 8)):
        oracle = CostOracle(build_model(spec), microbatch_size, None, topo)
        assert oracle.stage_compute_s(1, 1, 2) < oracle.stage_compute_s(0, 1, 2), spec  # the premise
        counts = balanced_counts(oracle, 2)
        assert counts[1] > counts[0], spec


def test_uniform_counts_spread_the_remainder_to_the_last_stages():
    assert uniform_counts(10, 4) == (2, 2, 3, 3)
    assert counts_to_ranges((2, 2, 3, 3)) == ((0, 2), (2, 4), (4, 7), (7, 10))


@pytest.mark.parametrize("text, message", [
    ("2,2", "has 2 stages, the plan has 3"),
    ("2,2,2", "covers 6 layers, the model has 8"),
    ("4,0,4", "at least one layer"),
    ("a,b,c", "'a,b,c'"),
    ("greedy", "'greedy'"),
])
def test_bad_partitions_name_the_value(text, message):
    graph = build_model("uniform:layers=8")
    with pytest.raises(SpecError, match=message):
        parse_partition(text, CostOracle(graph, 1, None, Topology.parse("3xideal")), 3)


@pytest.mark.parametrize("blocks, stages, expected", [
    (24, 4, (7, 6, 6, 7)),   # 24 blocks / 4, +1 embedding on the first stage, +1 head on the last
    (10, 4, (3, 2, 3, 4)),   # blocks 2,2,3,3 as uniform_counts spreads them, then embedding and head
    (6, 1, (8,)),            # one stage holds everything
])
def test_blocks_is_megatron_deepspeeds_type_transformer_partition(blocks, stages, expected):
    graph = build_model(f"gpt:layers={blocks},hidden=64,heads=4,seq=16,vocab=100")
    oracle = CostOracle(graph, 1, None, Topology.parse(f"{stages}xideal"))
    assert parse_partition("blocks", oracle, stages) == expected
    assert sum(expected) == len(graph) == blocks + 2


def test_blocks_needs_a_transformer_with_enough_blocks():
    with pytest.raises(SpecError, match="not one"):
        parse_partition("blocks", CostOracle(build_model("uniform:layers=8"), 1, None, Topology.parse("2xideal")), 2)
    gpt = build_model("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100")
    with pytest.raises(SpecError, match="3 stages, 2 blocks"):
        parse_partition("blocks", CostOracle(gpt, 1, None, Topology.parse("3xideal")), 3)


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(SpecError, match=r"more stages \(5\) than layers \(4\)"):
        parse_partition("uniform", CostOracle(build_model("uniform:layers=4"), 1, None, Topology.parse("5xideal")), 5)


# --- the reference: the original dynamic program, verbatim but for returning its tables ---------------------------


def _reference_suffixes(n, p, cost, limit):
    """``ok[s][i]``: stages s..p-1 can cover layers [i, n) with every stage at most ``limit`` (brute force)."""
    ok = [[False] * (n + 1) for _ in range(p)]
    for i in range(p - 1, n):
        ok[p - 1][i] = cost(p - 1, i, n) <= limit
    for s in range(p - 2, -1, -1):
        for i in range(s, n - p + s + 1):
            ok[s][i] = any(ok[s + 1][j] and cost(s, i, j) <= limit for j in range(i + 1, n - p + s + 2))
    return ok


# --- random instances with many exact ties -------------------------------------------------------------------------

#: Dyadic times add up exactly, so equal stages tie exactly; zero-time layers make whole runs of ties.
_TIED_TIMES = st.sampled_from([0.0, 2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10])
_ANY_TIME = st.one_of(_TIED_TIMES, st.floats(1e-4, 1e-2))
_ACTS = st.one_of(st.sampled_from([0, 1_000_000, 64_000_000]), st.integers(0, 400_000_000))
#: (spec, ranks, identical devices): ideal links, one V100 server, mixed devices, two servers (a network hop).
_TOPOLOGIES = [("{r}xideal", 1, True), ("{r}xV100", 1, True), ("{h}xV100+{h}xA100", 2, False),
               ("2x{h}xA100", 2, True), ("1x{r}xT4", 1, True), ("2xideal+{h}xV100", 2, False)]


@st.composite
def _instances(draw, max_layers=24):
    """(oracle, num_stages, vstage_to_rank): a random chain on a random topology and placement."""
    spec, step, identical = draw(st.sampled_from(_TOPOLOGIES))
    ranks = step * draw(st.integers(1, 4 // step), label="ranks / step")
    topo = Topology.parse(spec.format(r=ranks, h=ranks // 2))
    placement = draw(st.sampled_from(["default", "permuted", "interleaved"] if identical and ranks > 1
                                      else ["default", "permuted"]), label="placement")
    if placement == "interleaved":  # several vstages per rank, e.g. (0, 1, 0, 1)
        chunks = draw(st.integers(2, 3), label="chunks")
        vstage_to_rank = tuple(r for _ in range(chunks) for r in range(ranks))
    elif placement == "permuted":
        vstage_to_rank = tuple(draw(st.permutations(range(ranks))))[:draw(st.integers(1, ranks))]
    else:
        vstage_to_rank = None
    p = ranks if vstage_to_rank is None else len(vstage_to_rank)
    n = draw(st.integers(p, max(p, max_layers)), label="layers")
    if draw(st.booleans(), label="identical layers"):
        times = [draw(st.tuples(_ANY_TIME, _ANY_TIME))] * n
        acts = [draw(_ACTS)] * n
    else:
        times = draw(st.lists(st.tuples(_ANY_TIME, _ANY_TIME), min_size=n, max_size=n))
        acts = draw(st.lists(_ACTS, min_size=n, max_size=n), label="activation bytes")
    microbatch = draw(st.integers(1, 4), label="microbatch size")
    return CostOracle(_graph(times, acts), microbatch, None, topo), p, vstage_to_rank


@settings(max_examples=60, deadline=None)
@given(_instances(max_layers=20))
def test_balanced_returns_exactly_what_the_reference_dp_returns(instance):
    oracle, p, vstage_to_rank = instance
    assert balanced_counts(oracle, p, vstage_to_rank) == reference_dp(oracle, p, vstage_to_rank)[0]


def _shake(costs, margin, rng):
    """Give ``costs`` a margin of ``margin`` times a stage cost and move every approximate key by up to a third of
    it: what the threshold tests must survive, as their keys are only trusted to within the margin."""
    costs.margin = margin * max(1e-9, costs.bottleneck(list(range(costs.num_stages))))
    for keys in (costs.start_key, costs.end_key):
        for s, key in enumerate(keys):
            keys[s] = key + [rng.uniform(-costs.margin, costs.margin) / 3 for _ in range(key.size)]


@settings(max_examples=40, deadline=None)
@given(_instances(max_layers=12), st.sampled_from([None, 1e-3, 0.5, 1e6]), st.randoms(use_true_random=False))
def test_keys_off_by_anything_within_the_margin_give_the_reference_partition(instance, margin, rng):
    """The approximate keys ``A``, ``B`` only steer: with shaken keys (``_shake``; ``None``: the computed margin,
    keys untouched) the ends inside the margin are decided exactly, and the partition is still the reference's."""
    oracle, p, vstage_to_rank = instance
    ranks = tuple(range(p)) if vstage_to_rank is None else vstage_to_rank
    costs = StageCosts(oracle, ranks)
    if margin is not None:
        _shake(costs, margin, rng)
    expected = reference_dp(oracle, p, vstage_to_rank)[0]
    assert min_max_counts(costs, uniform_counts(len(oracle.graph), p))[0] == expected


@settings(max_examples=40, deadline=None)
@given(_instances(max_layers=12), st.sampled_from([None, 1e-3, 0.5]), st.randoms(use_true_random=False), st.data())
def test_threshold_feasibility_equals_the_reference_tables(instance, margin, rng, data):
    """F_s(T) = {j : best[s][j] <= T} and G_s(T) (brute force) at thresholds that are stage costs, and one ulp
    either side, where the approximate test is least sure; also with shaken keys (``_shake``)."""
    oracle, p, vstage_to_rank = instance
    n = len(oracle.graph)
    ranks = tuple(range(p)) if vstage_to_rank is None else vstage_to_rank
    _, best, cost = reference_dp(oracle, p, vstage_to_rank)
    costs = StageCosts(oracle, ranks)
    if margin is not None:
        _shake(costs, margin, rng)
    s = data.draw(st.integers(0, p - 1), label="stage")
    i = data.draw(st.integers(s, n - p + s), label="start")
    j = data.draw(st.integers(i + 1, n - p + s + 1), label="end")
    base = max(best[p - 1][n], cost(s, i, j)) if data.draw(st.booleans(), label="feasible") else cost(s, i, j)
    limit = data.draw(st.sampled_from([base, math.nextafter(base, math.inf), math.nextafter(base, -math.inf)]))
    found = bottleneck._forward(costs, limit)
    if best[p - 1][n] > limit:
        assert found is None
        return
    masks, witnesses = found
    for stage in range(p):
        for end in range(1, n + 1):
            assert masks[stage][end] == (best[stage][end] <= limit), (stage, end)
            if stage and masks[stage][end]:
                start = int(witnesses[stage][end])
                assert masks[stage - 1][start] and cost(stage, start, end) <= limit
    suffixes = _reference_suffixes(n, p, cost, limit)
    backward = bottleneck._backward(costs, limit)
    for stage in range(1, p):
        assert [bool(x) for x in backward[stage][:n + 1]] == suffixes[stage], stage


@settings(max_examples=40, deadline=None)
@given(_instances(max_layers=10))
def test_stage_costs_are_bitwise_the_oracles(instance):
    oracle, p, vstage_to_rank = instance
    ranks = tuple(range(p)) if vstage_to_rank is None else vstage_to_rank
    costs, n = StageCosts(oracle, ranks), len(oracle.graph)
    for s in range(p):
        for i in range(n):
            for j in range(i + 1, n + 1):
                assert float(costs.exact(s, i, j)) == reference_stage_cost(oracle, ranks, s, i, j), (s, i, j)


def _profiled_oracle(n, topology, seed):
    """Layers costed by a measured profile on the ``cpu`` device, messages between cpu ranks by its p2p fit."""
    rng = random.Random(seed)
    layers = [Layer(f"l{i}", "conv", 1e6, 2e6, 1000, a, a, 0) for i, a in
              enumerate(rng.choice([1000, 4096, 2_000_000]) for _ in range(n))]
    graph = LayerGraph("custom:profiled", layers, dtype_bytes=2, input_bytes=64)
    timings = tuple(LayerTiming(f"l{i}", rng.choice([1e-3, 2e-3, rng.uniform(1e-4, 5e-3)]), 2e-3) for i in range(n))
    profile = MeasuredProfile("test", graph.spec, "cpu", 1, timings, p2p_latency_s=5e-5, p2p_bandwidth=1e9)
    return CostOracle(graph, 2, profile, Topology.parse(topology))


@pytest.mark.parametrize("topology, p, vstage_to_rank", [
    ("4xcpu", 4, None), ("4xcpu", 4, (0, 1, 0, 1)), ("2xcpu+2xV100", 4, None), ("2xcpu+2xV100", 4, (2, 0, 1, 3)),
])
@pytest.mark.parametrize("seed", range(3))
def test_a_profile_and_its_p2p_fit_give_the_reference_partition(topology, p, vstage_to_rank, seed):
    oracle = _profiled_oracle(30, topology, seed)
    assert oracle.uses_measured_p2p()
    assert balanced_counts(oracle, p, vstage_to_rank) == reference_dp(oracle, p, vstage_to_rank)[0]


@pytest.mark.parametrize("model, topology, p, vstage_to_rank", [
    ("gpt:layers=40,hidden=1024", "2x4xA100", 8, None),
    ("gpt:layers=30,hidden=1024", "4xV100+4xA100", 8, None),
    ("gpt:layers=32,hidden=1024", "4xV100", 8, (0, 1, 2, 3, 0, 1, 2, 3)),
    ("cnn:layers=20", "4xT4", 4, None),
    ("uniform:layers=60", "12xideal", 12, None),
])
def test_zoo_models_give_the_reference_partition(model, topology, p, vstage_to_rank):
    oracle = CostOracle(build_model(model), 2, None, Topology.parse(topology))
    assert balanced_counts(oracle, p, vstage_to_rank) == reference_dp(oracle, p, vstage_to_rank)[0]


def test_a_table_too_large_is_refused_before_it_is_built(monkeypatch):
    monkeypatch.setattr(bottleneck, "MAX_CELLS", 8 * 20)
    oracle = CostOracle(build_model("uniform:layers=20"), 1, None, Topology.parse("8xideal"))
    with pytest.raises(SpecError, match=r"20 layers and 8 stages needs 168 table cells, more than 160"):
        balanced_counts(oracle, 8)
