"""The roofline at the precision of the model: an fp32 layer at the FP32 CUDA-core peak, an fp16 one at the tensor
peak (sim.cost.oracle, ``CostOracle._compute_layer_costs``).

Oracle: the closed form ``max(flops / (peak x efficiency), bytes / bandwidth) + launch`` with the catalog's cited
figures typed in (V100 SXM2: 15.7 TFLOP/s fp32, 125 tensor, efficiency 0.78, 900 GB/s, 5 µs; V100 PCIe: 14.0 and
112, 0.75), not read back from the code under test.
"""

from __future__ import annotations

import pytest

from sim.cost.oracle import CostOracle
from sim.hw.catalog import get_device, slowed_device
from sim.models import build_model

LAUNCH_S, BANDWIDTH = 5e-6, 900e9  # every V100's launch overhead and HBM2 bandwidth in devices.yaml


def _moved(graph, i: int, size: int) -> tuple[float, float]:
    """Forward and backward bytes of layer ``i`` for ``size`` samples: weights, input and output, once and twice."""
    layer = graph[i]
    into = graph.boundary_bytes(i) if i > 0 else graph.input_bytes
    act = size * (into + layer.activation_bytes)
    return layer.param_bytes + act, 2 * layer.param_bytes + 2 * act


def test_a_cnn_convolution_on_a_v100_runs_at_the_fp32_peak():
    # cnn's conv1 (64 -> 64 channels, 5 x 5, 256 x 256 frames), fp32, 2 frames: compute-bound at 15.7 TFLOP/s.
    graph, size = build_model("cnn:features=64,layers=3"), 2
    assert graph.dtype_bytes == 4
    conv = graph[1]
    fwd_bytes, bwd_bytes = _moved(graph, 1, size)
    achieved = 15.7e12 * 0.78
    assert size * conv.flops_fwd / achieved > fwd_bytes / BANDWIDTH  # compute-bound, so the FLOP term decides
    costs = CostOracle(graph, size).layer_costs(get_device("V100"))
    assert costs.fwd[1] == pytest.approx(max(size * conv.flops_fwd / achieved, fwd_bytes / BANDWIDTH) + LAUNCH_S,
                                         rel=1e-12)
    assert costs.bwd[1] == pytest.approx(max(size * conv.flops_bwd / achieved, bwd_bytes / BANDWIDTH) + LAUNCH_S,
                                         rel=1e-12)
    # At the tensor peak it would be 125 / 15.7 = 7.96 times faster: the error this fixes.
    assert (costs.fwd[1] - LAUNCH_S) / (size * conv.flops_fwd / (125e12 * 0.78)) == pytest.approx(125 / 15.7)


def test_a_vgg16_convolution_on_a_v100_pcie_runs_at_its_fp32_peak():
    # VGG-16's conv1_2 (64 -> 64, 3 x 3, 224 x 224), fp32, 16 images, on PipeDream's Cluster-A card: 14.0 TFLOP/s.
    graph, size = build_model("vgg16"), 16
    assert graph.dtype_bytes == 4 and graph[1].name == "conv1_2"
    fwd_bytes, _ = _moved(graph, 1, size)
    achieved = 14.0e12 * 0.75
    assert size * graph[1].flops_fwd / achieved > fwd_bytes / BANDWIDTH
    fwd = CostOracle(graph, size).layer_costs(get_device("v100-pcie-16gb")).fwd[1]
    assert fwd == pytest.approx(size * graph[1].flops_fwd / achieved + LAUNCH_S, rel=1e-12)


def test_an_fp16_models_roofline_layer_keeps_the_tensor_peak():
    # NASPipe's supernet is fp16 and has no GPT layers, so its choice blocks take the roofline on a GPU: 125 TFLOP/s.
    graph, size = build_model("supernet:blocks=2,choices=2,hidden=1024,seq=512"), 8
    assert graph.dtype_bytes == 2 and graph[1].transformer is None
    fwd_bytes, bwd_bytes = _moved(graph, 1, size)
    achieved = 125e12 * 0.78
    block = graph[1]
    assert size * block.flops_fwd / achieved > fwd_bytes / BANDWIDTH
    costs = CostOracle(graph, size).layer_costs(get_device("V100"))
    assert costs.fwd[1] == pytest.approx(size * block.flops_fwd / achieved + LAUNCH_S, rel=1e-12)
    assert costs.bwd[1] == pytest.approx(max(size * block.flops_bwd / achieved, bwd_bytes / BANDWIDTH) + LAUNCH_S,
                                         rel=1e-12)


def test_a_slowed_v100_costs_an_fp32_layer_at_its_divided_fp32_peak():
    # A 2x slowed V100: every op twice as long, the launch included (catalog.slowed_device).
    graph, size = build_model("cnn:features=64,layers=3"), 2
    slow = CostOracle(graph, size).layer_costs(slowed_device(get_device("V100"), 2))
    assert slow.fwd[1] == pytest.approx(2 * (size * graph[1].flops_fwd / (15.7e12 * 0.78) + LAUNCH_S), rel=1e-12)
