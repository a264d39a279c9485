"""AmoebaNet-D in the zoo (sim/models/amoebanet.py): a cell's FLOPs and parameters against closed forms written from
the cell's op list, the network's cell sequence, resolutions and channels, the bytes a stage boundary carries, specs
and their errors, and the cost oracle's elementwise term on a cell."""

from __future__ import annotations

import pytest

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.hw.catalog import get_device
from sim.hw.topology import Topology
from sim.models import build_model
from sim.models.amoebanet import cell_costs


def test_a_normal_cell_costs_78_f2_s2_flops():
    # Base: two 1x1 convolutions from 4F channels to F. Ops on F channels: three 1x1 and two 1x7+7x1 (each two convs
    # of 7 taps). Multiply-adds per pixel: 4F·F + 4F·F + 3·F² + 2·2·7·F² = 39 F²; FLOPs twice that.
    for f, s in ((16, 7), (256, 28)):
        costs = cell_costs(False, f, (4 * f, s), (4 * f, s))
        assert costs.flops == 78 * f * f * s * s
        # weights + 2 batch-norm parameters per conv output channel: 2 base convs, 3 one-conv ops, 2 two-conv ops
        assert costs.params == 2 * (4 * f * f + 2 * f) + 3 * (f * f + 2 * f) + 2 * (14 * f * f + 4 * f)
        assert (costs.out_channels, costs.out_size) == (4 * f, s)


def test_a_reduction_cell_runs_its_ops_at_half_resolution():
    # Base on the input resolution s: two 1x1 convs from c to F. Ops at s/2: one 3x3 (stride 2), one 1x7+7x1 and one
    # 1x1: 9 + 14 + 1 = 24 F² multiply-adds per output pixel.
    f, c, s = 32, 96, 14
    costs = cell_costs(True, f, (c, s), (c, s))
    assert costs.flops == 2 * 2 * c * f * s * s + 2 * 24 * f * f * (s // 2) ** 2
    assert (costs.out_channels, costs.out_size) == (3 * f, s // 2)
    odd = cell_costs(True, f, (c, 15), (c, 15))
    assert odd.out_size == 8  # 'same' padding with stride 2 rounds up


def test_an_older_input_at_twice_the_resolution_takes_the_factorized_reduction():
    # Two stride-2 1x1 convs to F/2 each on the older input cost what one 1x1 conv at the cell's resolution costs
    # (2 x c_old x F/2 multiply-adds per output pixel): so a newer input of 3F instead of 4F channels is the only
    # difference from the equal-resolution cell, 2 x (3F - 4F) x F x s² FLOPs.
    f, s = 64, 14
    same = cell_costs(False, f, (4 * f, s), (4 * f, s))
    reduced = cell_costs(False, f, (3 * f, s), (4 * f, 2 * s))
    assert reduced.flops == same.flops - 2 * f * f * s * s


def test_the_network_is_stem_two_stem_cells_three_stacks_and_a_head():
    graph = build_model("amoebanet")
    assert graph.spec == "amoebanet:cells=18,classes=1000,filters=256,size=224"
    names = [layer.name for layer in graph.layers]
    assert names == (["stem", "stem_cell0", "stem_cell1"] + [f"cell{i}" for i in range(6)] + ["reduction0"]
                     + [f"cell{i}" for i in range(6, 12)] + ["reduction1"] + [f"cell{i}" for i in range(12, 18)]
                     + ["head"])
    # 224 -> 111 (3x3 stride 2, valid) -> 56 -> 28 (stem cells); stacks at 28, 14, 7 with 4F = 1024, 2048, 4096
    # output channels; a boundary after a cell carries its output and the cell before's.
    by_name = {layer.name: layer for layer in graph.layers}
    assert by_name["stem"].activation_bytes == 2 * 32 * 111 * 111
    assert by_name["cell3"].activation_bytes == 2 * 2 * 1024 * 28 * 28
    assert by_name["cell9"].activation_bytes == 2 * 2 * 2048 * 14 * 14
    assert by_name["reduction1"].activation_bytes == 2 * (3 * 1024 * 7 * 7 + 2048 * 14 * 14)
    assert by_name["cell14"].flops_fwd == 78 * 1024 ** 2 * 7 * 7  # F²·s² is the same in every stack
    assert by_name["cell3"].flops_fwd == 78 * 256 ** 2 * 28 * 28
    assert by_name["head"].flops_fwd == 2 * 4096 * 1000
    assert all(layer.flops_bwd == 2 * layer.flops_fwd for layer in graph.layers)
    assert graph.input_bytes == 2 * 3 * 224 * 224


@pytest.mark.parametrize("spec, message", [
    ("amoebanet:cells=2", "cells must be at least 3"),
    ("amoebanet:filters=100", "filters must be a positive multiple of 8"),
    ("amoebanet:size=16", "size must be at least 32"),
    ("amoebanet:depth=3", "depth"),
])
def test_bad_specs_are_refused_with_the_value(spec, message):
    with pytest.raises(SpecError, match=message):
        build_model(spec)


def test_the_roofline_adds_a_cell_s_elementwise_traffic():
    # On a TPU v3 core (no launch, roofline): forward = max(FLOPs / (peak x efficiency), weights + input + output
    # bytes / bandwidth) + size x elementwise bytes / bandwidth; the backward adds twice the elementwise time.
    graph = build_model("amoebanet:cells=3,filters=64,size=64")
    device = get_device("TPUv3")
    oracle = CostOracle(graph, 4, topology=Topology.parse("1xTPUv3"))
    costs = oracle.layer_costs(device)
    throughput = device.peak_flops * device.matmul_efficiency
    for i, layer in enumerate(graph.layers):
        io = graph.input_bytes if i == 0 else graph.layers[i - 1].activation_bytes
        act = 4 * (io + layer.activation_bytes)
        ew = 4 * layer.elementwise_bytes / device.memory_bandwidth
        assert layer.elementwise_bytes > 0
        assert costs.fwd[i] == pytest.approx(max(layer.flops_fwd * 4 / throughput,
                                                 (layer.param_bytes + act) / device.memory_bandwidth) + ew, rel=1e-12)
        assert costs.bwd[i] == pytest.approx(max(layer.flops_bwd * 4 / throughput,
                                                 (2 * layer.param_bytes + 2 * act) / device.memory_bandwidth)
                                             + 2 * ew, rel=1e-12)
