"""LayerGraph: validation, edges, boundary bytes, equality (sim/models/graph.py)."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.models.graph import Layer, LayerGraph, canonical_spec


def make_layer(name: str, act: int = 10, params: int = 8, **kw) -> Layer:
    base = {
        "kind": "test",
        "flops_fwd": 1.0,
        "flops_bwd": 2.0,
        "param_bytes": params,
        "activation_bytes": act,
        "saved_bytes": act,
    }
    base.update(kw)
    return Layer(name=name, **base)


@pytest.fixture
def chain() -> LayerGraph:
    layers = [make_layer(f"l{i}", act=10 * (i + 1), params=4 * (i + 1)) for i in range(4)]
    return LayerGraph("test:chain", layers, dtype_bytes=2, input_bytes=7)


@pytest.fixture
def skip_dag() -> LayerGraph:
    # l0 -> l1 -> l2 -> l3 plus a skip l0 -> l2 (a residual connection that crosses one layer).
    layers = [make_layer(f"l{i}") for i in range(4)]
    edges = {(0, 1): 10, (1, 2): 20, (2, 3): 30, (0, 2): 5}
    return LayerGraph("test:skip", layers, dtype_bytes=4, edges=edges)


# --- Layer ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"flops_fwd": -1.0}, "-1.0"),
        ({"flops_bwd": math.nan}, "nan"),
        ({"flops_fwd": math.inf}, "inf"),
        ({"param_bytes": -8}, "-8"),
        ({"activation_bytes": 1.5}, "1.5"),
        ({"saved_bytes": -1}, "-1"),
        ({"workspace_bytes": -2}, "-2"),
        ({"fwd_s": 0.1}, "0.1"),  # bwd_s missing
        ({"fwd_s": -0.1, "bwd_s": 0.2}, "-0.1"),
        ({"kind": ""}, "''"),
    ],
)
def test_layer_rejects_bad_values_and_names_them(kw, shown):
    with pytest.raises(ValueError, match=shown.replace(".", r"\.")):
        make_layer("bad", **kw)


def test_layer_is_frozen_and_hashable():
    layer = make_layer("a")
    with pytest.raises(AttributeError):
        layer.flops_fwd = 3.0  # type: ignore[misc]
    assert hash(layer) == hash(make_layer("a"))


# --- construction and validation ----------------------------------------------------------------------------------


def test_zero_layers_rejected():
    with pytest.raises(ValueError, match="at least one layer, got 0"):
        LayerGraph("test:empty", [], dtype_bytes=2)


def test_duplicate_names_rejected_with_name_and_positions():
    with pytest.raises(ValueError, match=r"duplicate layer name 'x' at 0 and 2"):
        LayerGraph("test:dup", [make_layer("x"), make_layer("y"), make_layer("x")], dtype_bytes=2)


@pytest.mark.parametrize(
    ("edges", "shown"),
    [
        ({(0, 1): 1, (1, 2): 1, (2, 0): 1}, r"edge \(2, 0\) does not go forward"),  # a cycle
        ({(1, 1): 1}, r"edge \(1, 1\) does not go forward"),  # self-loop
        ({(0, 3): 1}, r"edge \(0, 3\) names no layer"),
        ({(-1, 1): 1}, r"edge \(-1, 1\) names no layer"),
        ({(0, 1): -4}, r"bytes must be an int >= 0, got -4"),
    ],
)
def test_bad_edges_rejected(edges, shown):
    layers = [make_layer(f"l{i}") for i in range(3)]
    with pytest.raises(ValueError, match=shown):
        LayerGraph("test:edges", layers, dtype_bytes=2, edges=edges)


@pytest.mark.parametrize(("kw", "shown"), [({"dtype_bytes": 0}, "dtype_bytes"), ({"input_bytes": -1}, "input_bytes")])
def test_bad_sizes_rejected(kw, shown):
    args = {"dtype_bytes": 2, **kw}
    with pytest.raises(ValueError, match=f"{shown} must be an int"):
        LayerGraph("test:sizes", [make_layer("a")], **args)


# --- structure ----------------------------------------------------------------------------------------------------


def test_default_edges_are_the_chain_with_activation_bytes(chain):
    assert list(chain.graph.nodes) == [0, 1, 2, 3]
    assert chain.edge_bytes() == {(0, 1): 10, (1, 2): 20, (2, 3): 30}
    assert all(chain.graph.nodes[i]["layer"] is chain[i] for i in range(4))
    assert chain.graph.edges[1, 2]["bytes"] == 20
    assert nx.is_directed_acyclic_graph(chain.graph)


def test_graph_is_frozen(chain):
    with pytest.raises(nx.NetworkXError):
        chain.graph.add_edge(0, 3)


def test_sequence_protocol_and_params(chain):
    assert len(chain) == 4
    assert [layer.name for layer in chain] == ["l0", "l1", "l2", "l3"]
    assert chain[2].name == "l2" and chain.layers[-1].name == "l3"
    assert [chain.param_count(i) for i in range(4)] == [2, 4, 6, 8]  # param_bytes 4, 8, 12, 16 at 2 bytes each
    assert chain.total_param_bytes() == 40
    assert chain.input_bytes == 7 and chain.dtype_bytes == 2 and chain.spec == "test:chain"


def test_boundary_bytes_chain(chain):
    assert [chain.boundary_bytes(c) for c in (1, 2, 3)] == [10, 20, 30]


def test_boundary_bytes_with_skip_edge(skip_dag):
    assert skip_dag.boundary_bytes(1) == 10 + 5  # l0->l1 and the skip l0->l2
    assert skip_dag.boundary_bytes(2) == 20 + 5  # l1->l2 and the skip
    assert skip_dag.boundary_bytes(3) == 30


@pytest.mark.parametrize("cut", [0, 4, -1, 10, 1.0, True])
def test_boundary_bytes_rejects_cuts_outside_the_graph(chain, cut):
    with pytest.raises(ValueError, match="0 < cut < 4"):
        chain.boundary_bytes(cut)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 9).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.dictionaries(
                st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda e: e[0] < e[1]),
                st.integers(0, 1000),
            ),
        )
    )
)
def test_boundary_bytes_matches_brute_force(case):
    n, edges = case
    graph = LayerGraph("test:random", [make_layer(f"l{i}") for i in range(n)], dtype_bytes=2, edges=edges)
    for cut in range(1, n):
        assert graph.boundary_bytes(cut) == sum(b for (u, v), b in edges.items() if u < cut <= v)


def test_equality_and_hash():
    def build(spec="test:eq", act=10):
        return LayerGraph(spec, [make_layer("a", act=act), make_layer("b")], dtype_bytes=2)

    assert build() == build() and hash(build()) == hash(build())
    assert build() != build(spec="test:other")
    assert build() != build(act=11)
    layers = [make_layer("a"), make_layer("b")]
    assert LayerGraph("s", layers, dtype_bytes=2) != LayerGraph("s", layers, dtype_bytes=2, edges={(0, 1): 3})


def test_summary_is_one_line_with_counts():
    layers = [make_layer(f"l{i}", params=2_000_000, flops_fwd=0.5e9) for i in range(3)]
    text = LayerGraph("test:sum", layers, dtype_bytes=2).summary()
    assert "\n" not in text
    assert text == "test:sum: 3 layers, 3.00M params, 1.500 GFLOP/sample fwd"


def test_summary_shows_fixed_times():
    layers = [make_layer(f"l{i}", fwd_s=0.001, bwd_s=0.002) for i in range(4)]
    assert LayerGraph("test:t", layers, dtype_bytes=2).summary().endswith(", 4 ms/sample fwd")


def test_canonical_spec_sorts_keys_and_formats_numbers():
    assert canonical_spec("m", {"b": 2, "a": 1.0, "c": 0.25, "d": 1e-5}) == "m:a=1,b=2,c=0.25,d=1e-05"
    assert canonical_spec("m", {}) == "m"
