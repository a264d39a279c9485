"""Layer costs: roofline closed form, the kernel model for GPT layers on GPUs, synthetic times, measured-profile
override, memory terms."""

import json
from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.gpu_time import default_kernel_model, optimizer_seconds, transformer_layer_seconds
from sim.cost.kernels.vocab import embedding_kernels
from sim.cost.memory_sizes import state_bytes_per_param
from sim.cost.oracle import CostOracle
from sim.cost.profile import load_profile
from sim.hw.catalog import get_device
from sim.hw.topology import Topology
from sim.ir.plan import OpKind, Placement
from sim.models import build_model
from tests.sim.cost.nccl_closed_form import nccl_call_s


def test_roofline_of_a_gpt_block_is_compute_bound_on_a_cpu():
    # Off a GPU a GPT layer keeps the roofline: max(FLOPs / achieved FLOP/s, bytes / bandwidth) + launch overhead.
    graph = build_model("gpt:layers=2,hidden=2048,seq=1024,heads=16")
    cpu = get_device("cpu")
    assert not cpu.is_gpu
    costs = CostOracle(graph, 2).layer_costs(cpu)
    block = graph[1]
    flops_per_s = cpu.peak_flops * cpu.matmul_efficiency
    # Compute bound: the forward reads the weights and the input and writes the output, for 2 samples.
    moved = block.param_bytes + 2 * (graph.boundary_bytes(1) + block.activation_bytes)
    assert 2 * block.flops_fwd / flops_per_s > moved / cpu.memory_bandwidth
    assert costs.fwd[1] == pytest.approx(2 * block.flops_fwd / flops_per_s + cpu.launch_overhead_s, rel=1e-12)
    assert costs.bwd[1] == pytest.approx(2 * block.flops_bwd / flops_per_s + cpu.launch_overhead_s, rel=1e-12)
    # Adam reads and writes 16 bytes of state per parameter, memory bound.
    state = graph.param_count(1) * 16
    assert costs.opt[1] == pytest.approx(2 * state / cpu.memory_bandwidth + cpu.launch_overhead_s, rel=1e-12)


def test_roofline_of_a_convolution_on_v100():
    # A layer that is not a GPT layer keeps the roofline on a GPU too (cnn's conv1: 64 → 64 channels, 5 × 5, 256²);
    # cnn is fp32, so at the fp32 peak (tests/sim/cost/test_fp32_roofline.py has the literal closed form).
    graph = build_model("cnn:features=64,layers=3")
    v100 = get_device("V100")
    conv = graph[1]
    flops_per_s = v100.peak_fp32_flops * v100.matmul_efficiency
    moved = conv.param_bytes + 2 * (graph.boundary_bytes(1) + conv.activation_bytes)
    assert 2 * conv.flops_fwd / flops_per_s > moved / v100.memory_bandwidth  # compute bound
    costs = CostOracle(graph, 2).layer_costs(v100)
    assert costs.fwd[1] == pytest.approx(2 * conv.flops_fwd / flops_per_s + v100.launch_overhead_s, rel=1e-12)
    state = graph.param_count(1) * 16
    assert costs.opt[1] == pytest.approx(2 * state / v100.memory_bandwidth + v100.launch_overhead_s, rel=1e-12)


def test_gpt_layers_on_a_gpu_are_their_kernels():
    # On a GPU a GPT layer is its kernel sequence (sim.cost.gpu_time), with the oracle's kernel model;
    # every kernel runs at most at the achieved GEMM rate, so a block takes longer than its compute roofline.
    graph = build_model("gpt:layers=2,hidden=2048,seq=1024,heads=16")
    v100 = get_device("V100")
    oracle = CostOracle(graph, 2)
    costs, model = oracle.layer_costs(v100), oracle.kernel_model
    assert model == default_kernel_model()
    for i, layer in enumerate(graph.layers):
        seconds = transformer_layer_seconds(layer.transformer, 2, v100, model)
        assert (costs.fwd[i], costs.bwd[i]) == (seconds.fwd, seconds.bwd), layer.name
        assert costs.opt[i] == optimizer_seconds(graph.param_count(i), v100, model, graph.dtype_bytes), layer.name
    block = graph[1]
    flops_per_s = v100.peak_flops * v100.matmul_efficiency
    assert costs.fwd[1] > 2 * block.flops_fwd / flops_per_s
    assert costs.bwd[1] > 2 * block.flops_bwd / flops_per_s
    # The kernel model is the oracle's: one given explicitly replaces the built-in constants.
    slow_host = replace(model, host_issue_s=1.0)
    assert CostOracle(graph, 2, kernel_model=slow_host).layer_costs(v100).fwd[1] == \
        transformer_layer_seconds(block.transformer, 2, v100, slow_host).fwd > 1.0


def test_embedding_lookup_is_memory_bound():
    # On a CPU, the roofline: the lookup moves its table's bytes and the activations and does no arithmetic.
    graph = build_model("gpt:layers=1,hidden=512,seq=64,vocab=1000")
    cpu = get_device("cpu")
    embed = graph[0]
    moved = embed.param_bytes + 1 * (graph.input_bytes + embed.activation_bytes)
    expected = moved / cpu.memory_bandwidth + cpu.launch_overhead_s
    assert CostOracle(graph, 1).layer_costs(cpu).fwd[0] == pytest.approx(expected)
    # On a GPU, its kernels; none of them is a GEMM, so it takes at least its bytes at the achieved bandwidth.
    v100 = get_device("V100")
    oracle = CostOracle(graph, 1)
    model = oracle.kernel_model
    lookup = embedding_kernels(1, 64, 512, 1000, 1, sequence_parallel=False, backward=False)
    assert all(kernel.kind != "gemm" for kernel in lookup)
    fwd = oracle.layer_costs(v100).fwd[0]
    assert fwd == transformer_layer_seconds(embed.transformer, 1, v100, model).fwd
    assert fwd >= sum(kernel.bytes for kernel in lookup) / (v100.memory_bandwidth * model.memory_efficiency)


def test_synthetic_times_scale_with_microbatch_size_on_any_device():
    graph = build_model("uniform:layers=2,fwd_ms=1.5,bwd_ms=3")
    for device in ("V100", "T4", "ideal"):
        costs = CostOracle(graph, 4).layer_costs(get_device(device))
        assert costs.fwd == (6e-3, 6e-3) and costs.bwd == (12e-3, 12e-3) and costs.opt == (0.0, 0.0)


def test_state_bytes_per_param():
    assert state_bytes_per_param(2) == 16  # fp16 weights + grads, fp32 master, m, v (ZeRO §3.1)
    assert state_bytes_per_param(4) == 16  # fp32 weights + grads + m + v, no master copy


def _profile(tmp_path, graph, device="v100-sxm2-32gb", **overrides):
    data = {
        "format": "pipedejavu-profile", "format_version": 1, "model": graph.spec, "device": device,
        "microbatch_size": 2,
        "layers": [{"name": layer.name, "fwd_s": 0.001 * (i + 1), "bwd_s": 0.002 * (i + 1)}
                   for i, layer in enumerate(graph.layers)],
    }
    data.update(overrides)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_profile_replaces_roofline_only_on_its_device(tmp_path):
    graph = build_model("gpt:layers=2,hidden=256,seq=64,vocab=1000")
    profile = load_profile(_profile(tmp_path, graph))
    measured = CostOracle(graph, 4, profile).layer_costs(get_device("V100"))
    assert measured.fwd == pytest.approx((0.002, 0.004, 0.006, 0.008))  # × 4/2 for the microbatch size
    assert measured.bwd == pytest.approx((0.004, 0.008, 0.012, 0.016))
    other = CostOracle(graph, 4, profile).layer_costs(get_device("A100"))
    assert other == CostOracle(graph, 4).layer_costs(get_device("A100"))


@pytest.mark.parametrize("overrides, message", [
    ({"format": "x"}, "pipedejavu-profile"),
    ({"format_version": 7}, "format_version 7"),
    ({"microbatch_size": 0}, "microbatch_size"),
    ({"layers": []}, "layers must be a non-empty list"),
    ({"layers": [{"name": "embed", "fwd_s": -1, "bwd_s": 0}]}, r"layers\[0\]: fwd_s"),
    ({"device": ""}, "device"),
])
def test_malformed_profiles_name_file_and_field(tmp_path, overrides, message):
    graph = build_model("gpt:layers=1,hidden=256,seq=64,vocab=1000")
    with pytest.raises(SpecError, match=message):
        load_profile(_profile(tmp_path, graph, **overrides))


def test_profile_for_another_model_is_rejected(tmp_path):
    profile = load_profile(_profile(tmp_path, build_model("gpt:layers=1,hidden=256,seq=64,vocab=1000")))
    with pytest.raises(SpecError, match="was measured for"):
        CostOracle(build_model("gpt:layers=2,hidden=256,seq=64,vocab=1000"), 1, profile).layer_costs(get_device("V100"))


def test_cost_model_sums_stage_layers_and_sizes_messages():
    graph = build_model("uniform:layers=4,fwd_ms=1,bwd_ms=2,act_mb=3,param_mb=1")
    placement = Placement(((0, 1), (1, 4)), (0, 1))
    costs = CostView(graph, Topology.parse("2xideal"), placement, microbatch_size=2)
    assert costs.compute_time(OpKind.F, 1) == pytest.approx(6e-3)
    assert costs.compute_time(OpKind.B, 1) == pytest.approx(12e-3)
    assert costs.compute_time(OpKind.I, 1) == costs.compute_time(OpKind.W, 1) == pytest.approx(6e-3)
    assert costs.message_bytes(OpKind.SEND_F, 0) == costs.message_bytes(OpKind.RECV_F, 1) == 6_000_000
    assert costs.message_bytes(OpKind.SEND_B, 1) == costs.message_bytes(OpKind.RECV_B, 0) == 6_000_000
    assert costs.activation_bytes(1) == 2 * (3e6 + 3 * 3e6)  # the received input plus each layer's output
    assert costs.state_bytes(0) == 500_000 * 16


def test_profile_p2p_fit_replaces_link_model_between_its_devices(tmp_path):
    graph = build_model("gpt:layers=2,hidden=64,seq=16,vocab=50")
    path = _profile(tmp_path, graph, device="cpu", p2p={"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9})
    topology = Topology.parse("2xcpu")
    placement = Placement(((0, 2), (2, 4)), (0, 1))
    costs = CostView(graph, topology, placement, microbatch_size=2, profile=load_profile(path))
    assert costs.oracle.transfer_time(10**6, 0, 1) == pytest.approx(1e-4 + 1e-3)
    assert costs.oracle.transfer_time(10**6, 1, 1) == 0.0
    plain = CostView(graph, topology, placement, microbatch_size=2)
    assert plain.oracle.transfer_time(10**6, 0, 1) == topology.transfer_time(10**6, 0, 1)
    # A profile measured on another device leaves the link model alone.
    other = _profile(tmp_path, graph, device="v100-sxm2-32gb", p2p={"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9})
    assert CostView(graph, topology, placement, 2, load_profile(other)).oracle.transfer_time(10**6, 0, 1) == \
        topology.transfer_time(10**6, 0, 1)


def test_profile_p2p_from_host_loopback_is_not_used_for_gpu_links(tmp_path):
    """A one-GPU profile's p2p was measured between CPU processes (p2p.device "cpu"): GPU links keep the link model."""
    graph = build_model("gpt:layers=2,hidden=64,seq=16,vocab=50")
    topology = Topology.parse("2xV100")
    placement = Placement(((0, 2), (2, 4)), (0, 1))
    fit = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    device = topology.devices[0].name
    host = load_profile(_profile(tmp_path, graph, device=device, p2p={**fit, "device": "cpu"}))
    assert host.p2p_latency_s is None and host.p2p_bandwidth is None
    # The link model, as one NCCL message between GPUs of an NVLink server (one step, the cheapest protocol).
    oracle = CostView(graph, topology, placement, 2, host).oracle
    assert oracle.transfer_time(10**6, 0, 1) == pytest.approx(
        nccl_call_s(topology.transfer_time(10**6, 0, 1), 1, "nvlink"), rel=1e-12)
    gpu = load_profile(_profile(tmp_path, graph, device=device, p2p={**fit, "device": "cuda"}))
    assert CostView(graph, topology, placement, 2, gpu).oracle.transfer_time(10**6, 0, 1) == pytest.approx(1e-4 + 1e-3)


def test_cost_model_names_the_ranks_its_profile_applies_to(tmp_path):
    """The profile's device matches ranks 0-1 and 4-5 of 2xV100+2xA100+2xV100; the A100s in between keep the
    roofline, and measured p2p is used only where two of the ranks considered are on the profile's device."""
    graph = build_model("gpt:layers=4,hidden=64,seq=16,vocab=50")
    topology = Topology.parse("2xV100+2xA100+2xV100")
    v100 = topology.devices[0].name
    placement = Placement(tuple((i, i + 1) for i in range(6)), tuple(range(6)))
    fit = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    costs = CostView(graph, topology, placement, 2, load_profile(_profile(tmp_path, graph, device=v100, p2p=fit)))
    assert costs.profiled_ranks() == (0, 1, 4, 5)
    assert costs.profiled_ranks(4) == (0, 1) and costs.profiled_ranks(1) == (0,)
    assert costs.uses_measured_p2p() and costs.uses_measured_p2p(2) and not costs.uses_measured_p2p(1)
    # The same rule as the costs themselves: measured on the V100s, roofline on the A100s, p2p only V100 to V100.
    profile = load_profile(_profile(tmp_path, graph, device=v100))
    measured = CostOracle(graph, 2, profile).layer_costs(topology.devices[0])
    # (Backward times: a rank's forward also carries the kernel model's per-microbatch framework time.)
    assert [costs.compute_time(OpKind.B, v) for v in (0, 4)] == pytest.approx([measured.bwd[0], measured.bwd[4]])
    a100 = CostOracle(graph, 2).layer_costs(topology.devices[2])
    assert costs.compute_time(OpKind.B, 2) == pytest.approx(a100.bwd[2])
    assert measured.bwd[2] != pytest.approx(a100.bwd[2])  # so the check above tells the two apart
    assert costs.oracle.transfer_time(10**6, 1, 4) == pytest.approx(1e-4 + 1e-3)
    # V100 to A100, another server: the link model as one NCCL message over the network.
    assert costs.oracle.transfer_time(10**6, 1, 2) == pytest.approx(
        nccl_call_s(topology.transfer_time(10**6, 1, 2), 1, "net"), rel=1e-12)
    no_fit = CostView(graph, topology, placement, 2, load_profile(_profile(tmp_path, graph, device=v100)))
    assert no_fit.profiled_ranks() == (0, 1, 4, 5) and not no_fit.uses_measured_p2p()
    roofline = CostView(graph, topology, placement, 2)
    assert roofline.profiled_ranks() == () and not roofline.uses_measured_p2p()


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8), (4, 2)])
def test_freeing_stage_outputs_lowers_each_ranks_peak_by_its_in_flight_boundaries(pp, microbatches):
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs
    from sim.predict import predict_built

    def peaks(free):
        built = build_plan(PlanInputs(model="llama:layers=8,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=256",
                                      topology=f"{pp}xH100", pp=pp, microbatches=microbatches, microbatch_size=2,
                                      partition="uniform", deallocate_pipeline_outputs=free))
        devices = predict_built(built, check_memory=False).metrics["devices"]
        return [device["peak_memory_bytes"] for device in devices], built.graph.boundary_bytes(2)

    (kept, boundary), (freed, _) = peaks(False), peaks(True)
    # 1F1B: rank r holds min(pp - r, microbatches) forwards at its peak (Megatron's warm-up), each sending one
    # boundary of 2 samples; the last rank sends nothing
    for rank in range(pp):
        in_flight = min(pp - rank, microbatches) if rank < pp - 1 else 0
        assert kept[rank] - freed[rank] == in_flight * 2 * boundary, rank
