"""VGG-16 in the zoo (sim/models/vgg.py): the published parameter count, FLOPs against a closed form, bytes per
layer from the tensor shapes, specs and their errors, and the executor's refusal of a model it cannot build."""

from __future__ import annotations

import pytest

from sim.core.errors import SpecError
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

# Configuration D written out by hand (Simonyan & Zisserman, arXiv 1409.1556, Table 1): (C_in, C_out, side of the
# input map) of each 3x3 convolution at 224 x 224, and whether a 2x2 max-pool follows it.
CONVS_224 = [(3, 64, 224, False), (64, 64, 224, True),
             (64, 128, 112, False), (128, 128, 112, True),
             (128, 256, 56, False), (256, 256, 56, False), (256, 256, 56, True),
             (256, 512, 28, False), (512, 512, 28, False), (512, 512, 28, True),
             (512, 512, 14, False), (512, 512, 14, False), (512, 512, 14, True)]
FCS = [(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]


def test_parameter_count_is_the_published_138_357_544():
    graph = build_model("vgg16")
    assert graph.spec == "vgg16:classes=1000,size=224"
    # torchvision's vgg16 (the paper's Table 2 rounds it to 138M); fp32 weights
    assert sum(graph.param_count(i) for i in range(len(graph))) == 138_357_544
    assert graph.total_param_bytes() == 4 * 138_357_544
    # and layer by layer: k^2·C_in·C_out + C_out per convolution, n_in·n_out + n_out per linear layer
    expected = [9 * a * b + b for a, b, _, _ in CONVS_224] + [a * b + b for a, b in FCS]
    assert [graph.param_count(i) for i in range(len(graph))] == expected
    fc = sum(graph.param_count(i) for i in range(13, 16))
    assert fc == 123_642_856 and fc / 138_357_544 > 0.89  # most of it in the three FC layers


def test_forward_flops_equal_the_closed_form_and_torchvisions_gmacs():
    graph = build_model("vgg16")
    # Closed form: a stride-1 'same' 3x3 convolution is H·W·C_out dot products of length 9·C_in, a linear layer
    # n_out of length n_in; one multiply-add is 2 FLOPs.
    macs = sum(9 * a * b * side * side for a, b, side, _ in CONVS_224) + sum(a * b for a, b in FCS)
    assert macs == 15_470_264_320
    assert [layer.flops_fwd for layer in graph] == [2.0 * 9 * a * b * s * s for a, b, s, _ in CONVS_224] + [
        2.0 * a * b for a, b in FCS]
    assert sum(layer.flops_fwd for layer in graph) == 2 * macs
    assert abs(macs / 1e9 - 15.47) < 0.005  # torchvision publishes 15.47 GFLOPS (multiply-adds) for vgg16
    assert all(layer.flops_bwd == 2 * layer.flops_fwd for layer in graph)


def test_activation_saved_and_workspace_bytes_follow_the_tensor_shapes():
    graph = build_model("vgg16")
    assert graph.input_bytes == 4 * 3 * 224 * 224
    for layer, (a, b, side, pooled) in zip(graph.layers[:13], CONVS_224, strict=True):
        out_side = side // 2 if pooled else side
        assert layer.activation_bytes == 4 * b * out_side ** 2
        # ReLU output (in place on the conv output); a pool adds its fp32 output and int64 indices
        assert layer.saved_bytes == 4 * b * side ** 2 + (12 * b * out_side ** 2 if pooled else 0)
        assert layer.workspace_bytes == 4 * a * side ** 2  # the input's gradient
    fc6, fc7, fc8 = graph.layers[13:]
    assert [fc.activation_bytes for fc in (fc6, fc7, fc8)] == [4 * 4096, 4 * 4096, 4 * 1000]
    assert fc6.saved_bytes == fc7.saved_bytes == 4096 * (4 + 1 + 4)  # ReLU out, dropout mask, dropout out
    assert fc8.saved_bytes == 4 * 1000 and fc6.workspace_bytes == 4 * 25088
    # what crosses a stage boundary is the previous layer's output
    assert graph.boundary_bytes(13) == 4 * 512 * 7 * 7


def test_size_and_classes_change_the_fc_layers_as_the_shapes_say():
    graph = build_model("vgg16:size=64,classes=10")
    assert graph.spec == "vgg16:classes=10,size=64"
    assert graph.param_count(13) == 512 * 2 * 2 * 4096 + 4096 and graph.param_count(15) == 4096 * 10 + 10
    assert graph.layers[0].flops_fwd == 2 * 9 * 3 * 64 * 64 * 64
    assert build_model(graph.spec) == graph


@pytest.mark.parametrize("spec, shown", [("vgg16:size=100", "size=100"), ("vgg16:size=0", "got 0"),
                                         ("vgg16:classes=0", "got 0"), ("vgg16:depth=19", "depth"),
                                         ("vgg16:size=2.5", "'2.5'")])
def test_bad_specs_raise_spec_error_naming_the_value(spec, shown):
    with pytest.raises(SpecError) as info:
        build_model(spec)
    assert shown in str(info.value)


def test_data_parallel_plan_of_vgg16_simulates_and_fits_a_16_gb_v100():
    built = build_plan(PlanInputs("vgg16", "4xV100", "1f1b", microbatch_size=8, global_batch=64, dp=4, pp=1))
    prediction = predict_built(built)
    # 16 bytes per parameter of fp32 Adam training state (4 weights + 4 gradients + 8 moments), plus activations
    assert prediction.peak_memory_bytes[0] > 16 * 138_357_544
    assert prediction.metrics["iteration_time_s"] > 0


def test_executor_refuses_a_vgg16_plan_with_one_line(tmp_path, capsys):
    pytest.importorskip("torch")
    from executor.run import main as executor_main
    from sim.run import main as sim_main

    assert sim_main(["--topology", "2xcpu", "--model", "vgg16:size=32,classes=10", "--microbatches", "2",
                     "--no-gantt", "--out", str(tmp_path / "plan")]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        executor_main(["--plan", str(tmp_path / "plan" / "plan.json"), "--out", str(tmp_path / "real")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: model 'vgg16' has no torch implementation"), err
    assert not (tmp_path / "real").exists()
