"""The engine on tensor × data × pipeline plans: closed forms, the symmetry argument, replicas that differ, memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.core.errors import SpecError
from sim.cost.gpu_time import default_kernel_model, kernel_seconds
from sim.cost.kernels.block import layer_step_kernels
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.ir.plan import OpKind
from sim.models import build_model
from sim.models.sharding import Sharding
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict, predict_built
from tests.sim.cost.nccl_closed_form import nccl_call_s

GPT = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=4096"


def _predict(**kwargs):
    built = build_plan(PlanInputs(**kwargs))
    return built, predict_built(built)


def _hop(topology: Topology, a: int, b: int) -> tuple[float, float]:
    """(α, B): summed latency (s) and narrowest bandwidth (bytes/s) of the route a → b."""
    path = topology.path(a, b)
    return sum(link.spec.latency for link in path), min(link.spec.bandwidth for link in path)


def test_gradient_all_reduce_is_the_ring_closed_form():
    # 8 GPUs on one NVSwitch: every ring hop is gpu → switch → gpu. Ring all-reduce of S bytes on n devices:
    # 2(n-1)/n · S/B + 2(n-1)·α (Patarasuk & Yuan; the NCCL ring). 100 MB makes the ring beat the tree. The
    # all-reduce is one NCCL call of 2(n-1) steps over NVLink, at its cheapest protocol.
    built, prediction = _predict(model="uniform:layers=4,param_mb=25", topology="8xA100", schedule="1f1b",
                                 microbatches=2, dp=8, pp=1)
    alpha, bandwidth = _hop(built.topology, 0, 1)
    n, size = 8, 4 * 25 * 10**6
    spans = [s for s in prediction.trace.spans if s.kind == "REDUCE_GRAD"]
    assert len(spans) == 1
    link = 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * alpha
    assert spans[0].duration == pytest.approx(nccl_call_s(link, 2 * (n - 1), "nvlink"), rel=1e-12)


def test_tensor_parallel_ops_are_the_layers_all_reduces_in_turn():
    # Two shards: a ring all-reduce of S bytes is S/B + 2α. TP_F of a microbatch runs every forward all-reduce of
    # the stage's layers (Megatron: two per block, b·s·h fp16 values each), TP_B every backward one. Each
    # all-reduce is its own NCCL call of 2 steps over NVLink.
    built, prediction = _predict(model=GPT, topology="2xA100", schedule="1f1b", microbatches=2, microbatch_size=2,
                                 tp=2, pp=1)
    alpha, bandwidth = _hop(built.topology, 0, 1)
    graph = build_model(GPT, Sharding(tp=2))

    def expected(forward: bool) -> float:
        total = 0.0
        for layer in graph.layers:
            count = layer.tp_comm_fwd_count if forward else layer.tp_comm_bwd_count
            nbytes = layer.tp_comm_fwd_bytes if forward else layer.tp_comm_bwd_bytes
            if count:
                total += count * nccl_call_s(2 * nbytes // count / bandwidth + 2 * alpha, 2, "nvlink")
        return total

    blocks = [layer for layer in graph.layers if layer.kind == "decoder"]
    assert all(layer.tp_comm_fwd_count == 2 and layer.tp_comm_fwd_bytes == 2 * (2 * 512 * 1024) for layer in blocks)
    for kind, forward in (("TP_F", True), ("TP_B", False)):
        spans = [s for s in prediction.trace.spans if s.kind == kind]
        assert len(spans) == 2
        assert all(s.duration == pytest.approx(expected(forward), rel=1e-12) for s in spans)


CASES = [
    ("8xA100", {"tp": 2, "dp": 2, "pp": 2}, "1f1b", 1),
    ("2x8xA100", {"tp": 2, "dp": 2, "pp": 4}, "interleaved", 2),
    ("2x8xA100", {"tp": 1, "dp": 4, "pp": 4, "rank_order": "dp-tp-pp"}, "zb1p", 1),
    ("16xV100", {"tp": 2, "dp": 4, "pp": 2, "zero": 1}, "gpipe", 1),
    ("4x4xV100-PCIE", {"dp": 4, "pp": 4}, "pipedream", 1),
]


@pytest.mark.parametrize(("topology", "layout", "schedule", "chunks"), CASES)
def test_one_replica_stands_for_identical_ones_exactly(topology, layout, schedule, chunks):
    built = build_plan(PlanInputs(GPT, topology, schedule, microbatch_size=2, global_batch=32, chunks=chunks,
                                  **layout))
    symmetric = predict(built.plan, topology=built.topology)
    full = predict(built.plan, topology=built.topology, simulate_all=True)
    pipeline = built.plan.num_ranks
    assert symmetric.trace.num_ranks == pipeline
    assert full.trace.num_ranks == pipeline * built.plan.layout.dp
    first = [(s.op, s.rank, s.start, s.end) for s in full.trace.spans if s.rank < pipeline]
    assert first == [(s.op, s.rank, s.start, s.end) for s in symmetric.trace.spans]
    for replica in range(1, built.plan.layout.dp):
        mine = sorted((s.op, s.rank - replica * pipeline, s.start, s.end) for s in full.trace.spans
                      if replica * pipeline <= s.rank < (replica + 1) * pipeline)
        assert mine == sorted(first)
    assert full.metrics["iteration_time_s"] == symmetric.metrics["iteration_time_s"]
    assert full.link_bytes == symmetric.link_bytes


def test_replicas_on_different_devices_are_simulated_in_full_and_wait_for_each_other():
    # Replica 0 on the V100 server, replica 1 on the A100 server: the faster replica's reduction of each stage
    # starts only when the slower one has finished that stage's backward pass.
    built, prediction = _predict(model=GPT, topology="4xV100+4xA100", schedule="1f1b", microbatches=4, dp=2, pp=4,
                                 rank_order="tp-pp-dp")
    trace = prediction.trace
    assert trace.num_ranks == 8
    assert trace.devices[:4] == ("v100-sxm2-32gb",) * 4 and trace.devices[4:] == ("a100-sxm4-80gb",) * 4
    for stage in range(4):
        ranks = (stage, stage + 4)
        last_backward = max(s.end for s in trace.spans if s.rank in ranks and s.kind == "B")
        reduce = [s for s in trace.spans if s.rank in ranks and s.kind == "REDUCE_GRAD"]
        assert len(reduce) == 2 and reduce[0].start == reduce[1].start >= last_backward
    # The first reduction to run waited for nothing else.
    first = min((s for s in trace.spans if s.kind == "REDUCE_GRAD"), key=lambda s: s.start)
    stage = first.rank % 4
    assert first.start == max(s.end for s in trace.spans if s.rank in (stage, stage + 4) and s.kind == "B")
    alone, _ = _predict(model=GPT, topology="4xV100", schedule="1f1b", microbatches=4)
    assert prediction.metrics["iteration_time_s"] > predict(alone.plan).metrics["iteration_time_s"]


def test_tensor_parallel_groups_over_mixed_devices_are_refused():
    with pytest.raises(SpecError, match=r"mixes a100-sxm4-80gb, v100-sxm2-32gb"):
        _predict(model=GPT, topology="4xV100+4xA100", schedule="1f1b", microbatches=4, tp=2, pp=4,
                 rank_order="pp-tp-dp")


def test_zero_1_keeps_one_dth_of_the_optimizer_state():
    # ZeRO §5.1 (P_os): (2 + 2 + K/N_d)·Ψ bytes with K = 12, against 16·Ψ without; activations are the same.
    kwargs = dict(model=GPT, topology="8xA100", schedule="1f1b", microbatches=4, dp=4, pp=2)
    plain, with_zero = _predict(**kwargs)[1], _predict(**kwargs, zero=1)[1]
    graph = build_model(GPT)
    for rank, (start, end) in enumerate(_predict(**kwargs)[0].plan.placement.vstage_layers):
        params = sum(graph.param_count(i) for i in range(start, end))
        saved = plain.peak_memory_bytes[rank] - with_zero.peak_memory_bytes[rank]
        assert saved == 12 * params - 3 * params  # 12Ψ of optimizer state, of which 12Ψ/4 stay
    assert any(s.kind == "GATHER_PARAMS" for s in with_zero.trace.spans)
    assert not any(s.kind == "GATHER_PARAMS" for s in plain.trace.spans)


def test_selective_recompute_trades_the_attention_memory_for_its_flops():
    # Korthikanti et al. §5: the backward re-runs QK^T and attention over V, 4·s²·h FLOPs per sample and block, and
    # nothing of the attention core (5·a·s² bytes per sample and block) is kept. On the cpu device a GPT layer is a
    # roofline, compute bound here, so the backward grows by exactly those FLOPs.
    kwargs = dict(model=GPT, topology="2xcpu", schedule="1f1b", microbatches=4, pp=2)
    built, none = _predict(**kwargs)
    selective = _predict(**kwargs, recompute="selective")[1]
    device = built.topology.devices[0]
    s, h = 512, 1024
    blocks = built.plan.placement.vstage_layers[0][1] - 1  # stage 0 is the embedding and blocks
    extra = blocks * 4 * s * s * h / (device.peak_flops * device.matmul_efficiency)
    b_none = next(x.duration for x in none.trace.spans if x.op == "0B0")
    b_selective = next(x.duration for x in selective.trace.spans if x.op == "0B0")
    assert b_selective - b_none == pytest.approx(extra, rel=1e-9)
    assert none.peak_memory_bytes[0] > selective.peak_memory_bytes[0]
    assert selective.metrics["plan"]["recompute"] == "selective"


def test_selective_recompute_on_a_gpu_reruns_the_attention_core_kernels():
    # The kernel model, sim.cost.gpu_time: on a GPU the backward starts with the recomputed attention core's kernels.
    # With no host time (a kernel model whose host and gap terms are 0, so the GPU never waits) they add exactly their
    # GPU time, which is at least their FLOPs at the achieved GEMM rate: Korthikanti's 4·s²·h per sample and block.
    model = replace(default_kernel_model(), host_issue_s=0.0, host_collective_s=0.0, kernel_gap_s=0.0)
    kwargs = dict(model=GPT, topology="2xA100", schedule="1f1b", microbatches=4, pp=2, kernel_model=model)
    built, none = _predict(**kwargs)
    selective = _predict(**kwargs, recompute="selective")[1]
    device = built.topology.devices[0]
    s, h, a = 512, 1024, 16
    plain, again = (layer_step_kernels(1, s, h, a, 1, sequence_parallel=False, recompute=mode)[1]
                    for mode in ("none", "selective"))
    rerun = again[: len(again) - len(plain)]
    assert again[len(rerun):] == plain and len(rerun) > 0
    blocks = built.plan.placement.vstage_layers[0][1] - 1
    b_none = next(x.duration for x in none.trace.spans if x.op == "0B0")
    b_selective = next(x.duration for x in selective.trace.spans if x.op == "0B0")
    added = blocks * sum(kernel_seconds(kernel, device, model) for kernel in rerun)
    assert b_selective - b_none == pytest.approx(added, rel=1e-9)
    assert added >= blocks * 4 * s * s * h / (device.peak_flops * device.matmul_efficiency)
    assert none.peak_memory_bytes[0] > selective.peak_memory_bytes[0]


def test_overlapped_buckets_are_ddps_without_zero_and_megatrons_under_zero_1():
    # Without ZeRO, PyTorch DDP's 25 MiB; under ZeRO-1 (Megatron-Core's distributed optimizer with bucket_size unset)
    # max(40,000,000, 1,000,000 x D) parameters of the model's precision: 40 M parameters at D = 2 and 8, 64 M at 64.
    def bucket(dp, zero, topology):
        built = build_plan(PlanInputs("uniform:layers=4,param_mb=25,fwd_ms=20,bwd_ms=40", topology, "1f1b", 2, dp=dp,
                                      pp=1, zero=zero, grad_overlap=True, global_batch=2 * dp))
        view = built.views()[0]
        return view.gradient_bucket_bytes(), built.graph.dtype_bytes, view.gradient_buckets(0)[0]

    assert bucket(2, 0, "2xA100")[0] == 25 * 2**20
    size, dtype_bytes, count = bucket(2, 1, "2xA100")
    assert size == 40_000_000 * dtype_bytes
    assert count == -(-4 * 25 * 10**6 // size)  # 100 MB of gradients, whole buckets
    assert bucket(8, 1, "8xA100")[0] == 40_000_000 * dtype_bytes
    assert bucket(64, 1, "8x8xA100")[0] == 64_000_000 * dtype_bytes


@pytest.mark.parametrize("zero, overlap", [(0, "grad_overlap"), (1, "grad_overlap"), (1, "param_gather_overlap")])
def test_a_named_bucket_size_replaces_the_frameworks_rule(zero, overlap):
    # --grad-bucket-size (Megatron's --ddp-bucket-size): 7 M parameters a bucket, under either overlap and ZeRO
    # stage: the 100 MB of gradients (4 layers of 25 MB) in whole buckets of 7 M parameters of the model's dtype,
    # each costed as one collective of the bucket's bytes over the data-parallel group.
    model = "uniform:layers=4,param_mb=25,fwd_ms=20,bwd_ms=40"
    built = build_plan(PlanInputs(model, "2xA100", "1f1b", 2, dp=2, pp=1, zero=zero, global_batch=4,
                                  grad_bucket_params=7_000_000, **{overlap: True}))
    view = built.views()[0]
    size = 7_000_000 * built.graph.dtype_bytes
    assert view.gradient_bucket_bytes() == size
    count, each = view.gradient_buckets(0)
    assert count == -(-4 * 25 * 10**6 // size)
    name = "all_reduce" if zero == 0 else "reduce_scatter"
    assert each == pytest.approx(view.oracle.collective(name, built.plan.layout.dp_groups(0), size).seconds,
                                 rel=1e-12)
    assert built.plan.layout.to_json()["grad_bucket_params"] == 7_000_000
    assert Parallelism.from_json(built.plan.layout.to_json(), 1, "plan") == built.plan.layout


def test_a_bucket_size_without_an_overlap_is_refused():
    with pytest.raises(SpecError, match="needs grad_overlap or param_gather_overlap"):
        build_plan(PlanInputs("uniform:layers=4", "2xA100", "1f1b", 2, dp=2, pp=1, grad_bucket_params=1000))
    with pytest.raises(SpecError, match="got -1"):
        build_plan(PlanInputs("uniform:layers=4", "2xA100", "1f1b", 2, dp=2, pp=1, grad_overlap=True,
                              grad_bucket_params=-1))


def test_overlapped_gradient_reduction_streams_behind_the_last_backward():
    # PyTorch DDP: gradients are all-reduced in 25 MiB buckets as the backward makes them. With the backward's
    # gradients ready at an even rate over [b0, b1], bucket k of K is ready at b0 + k(b1 - b0)/K and buckets are
    # reduced one at a time (T_b each): the last ends at max_k (ready_k + (K - k + 1)·T_b).
    kwargs = dict(model="uniform:layers=4,param_mb=25,fwd_ms=20,bwd_ms=40", topology="2xA100", schedule="1f1b",
                  microbatches=2, dp=2, pp=1)
    built, overlapped = _predict(**kwargs, grad_overlap=True)
    alpha, bandwidth = _hop(built.topology, 0, 1)
    total, bucket = 4 * 25 * 10**6, 25 * 2**20
    buckets = -(-total // bucket)
    assert buckets == 4
    # Ring all-reduce on two devices, S/B + 2α, as one NCCL call of 2 steps over NVLink per bucket.
    bucket_s = nccl_call_s(bucket / bandwidth + 2 * alpha, 2, "nvlink")
    spans = {s.op: s for s in overlapped.trace.spans}
    b0, b1 = spans["0B1"].start, spans["0B1"].end
    ready = [b0 + k * (b1 - b0) / buckets for k in range(1, buckets + 1)]
    reduce = spans["0REDUCE_GRAD"]
    assert reduce.start == pytest.approx(ready[0], rel=1e-12)
    assert reduce.end == pytest.approx(max(r + (buckets - k) * bucket_s for k, r in enumerate(ready)), rel=1e-12)
    plain = _predict(**kwargs)[1]
    assert overlapped.metrics["iteration_time_s"] < plain.metrics["iteration_time_s"]
    assert spans["0OPT_STEP"].start == reduce.end


def test_an_overlapped_parameter_gather_costs_what_the_first_forward_cannot_hide():
    # Megatron-Core gathers bucket by bucket, each bucket's wait dispatching the next: K buckets of T seconds under a
    # forward of f leave T + (K - 1)·max(0, T - f/K) exposed. 1 GB of parameters (4 layers of 250 MB) in buckets of
    # 40 M parameters over two A100s: several buckets; a plain ZeRO-1 plan's gather (after the step) costs the whole
    # all-gather.
    kwargs = dict(model="uniform:layers=4,param_mb=250,fwd_ms=20,bwd_ms=40", topology="2xA100", schedule="1f1b",
                  microbatches=2, dp=2, pp=1, zero=1, global_batch=4)
    built = build_plan(PlanInputs(**kwargs, param_gather_overlap=True))
    view = built.views()[0]
    total = view.param_bytes(0)
    bucket = min(view.gradient_bucket_bytes(), total)
    count = -(-total // bucket)
    groups = built.plan.layout.dp_groups(0)
    each = view.oracle.collective("all_gather", groups, bucket).seconds
    forward = view.compute_time(OpKind.F, 0)
    assert count > 1
    assert view.collective_op(OpKind.GATHER_PARAMS, 0).seconds == pytest.approx(
        each + (count - 1) * max(0.0, each - forward / count), rel=1e-12)
    plain = build_plan(PlanInputs(**kwargs)).views()[0]
    assert plain.collective_op(OpKind.GATHER_PARAMS, 0).seconds == pytest.approx(
        plain.oracle.collective("all_gather", groups, total).seconds, rel=1e-12)
