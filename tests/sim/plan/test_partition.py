"""The balanced partition is exactly optimal (checked against brute force), and the other methods."""

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.hw.topology import Topology
from sim.models import build_model
from sim.models.graph import Layer, LayerGraph
from sim.plan.partition import balanced_counts, counts_to_ranges, parse_partition, stage_time, uniform_counts


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
    assert max(stage_time(CostOracle(graph, 1, None, topo), counts)) == pytest.approx(_brute_force_best(graph, topo, p), rel=1e-12)


def test_stage_time_adds_transfers_in_both_directions():
    graph = _graph([(1e-3, 2e-3)] * 4, [1_000_000] * 4)
    topo = Topology.parse("2xV100")
    forward = topo.transfer_time(1_000_000, 0, 1)
    backward = topo.transfer_time(1_000_000, 1, 0)
    assert stage_time(CostOracle(graph, 1, None, topo), (2, 2)) == pytest.approx((6e-3 + forward, 6e-3 + backward))


def test_heterogeneous_devices_get_more_layers_on_the_faster_one():
    graph = build_model("gpt:layers=16,hidden=1024")
    topo = Topology.parse("1xV100+1xH100")
    counts = balanced_counts(CostOracle(graph, 1, None, topo), 2)
    assert counts[1] > counts[0]


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


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(SpecError, match=r"more stages \(5\) than layers \(4\)"):
        parse_partition("uniform", CostOracle(build_model("uniform:layers=4"), 1, None, Topology.parse("5xideal")), 5)
