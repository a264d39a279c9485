"""``executor.memory``: the CPU storage counter against closed forms and against the torch profiler's allocator
events; ``compare.json``'s per-rank memory from one real 2-rank run; the report's rank mapping; ``--measure-memory``
refused for a csp plan."""

import json

import pytest
import torch

from executor.compare import format_memory_line, memory_report
from executor.memory import CPU_METHOD, PeakMemory, StorageCounter, live_tensors
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.run import main as sim_main
from tests.executor.conftest import CSP_SPEC
from tests.executor.runs import execute, refused

FLOAT = 4  # bytes per fp32 element


def test_a_new_tensor_adds_its_bytes_and_freeing_it_takes_them_back():
    counter = StorageCounter()
    with counter:
        a = torch.empty(1000)
        assert counter.live_bytes == 1000 * FLOAT
        b = torch.zeros(250, dtype=torch.float64)
        assert counter.live_bytes == 1000 * FLOAT + 250 * 8
        del a
        assert counter.live_bytes == 250 * 8
        del b
        assert counter.live_bytes == 0
    assert counter.peak_bytes == 1000 * FLOAT + 250 * 8


def test_views_share_their_base_and_the_storage_goes_with_its_last_view():
    counter = StorageCounter()
    with counter:
        base = torch.ones(64, 32)
        views = [base[1:], base.t(), base.view(-1), base.reshape(32, 64), base.unsqueeze(0), base.narrow(0, 0, 8)]
        assert counter.live_bytes == 64 * 32 * FLOAT
        del base
        assert counter.live_bytes == 64 * 32 * FLOAT  # the views keep the storage alive
        del views
        assert counter.live_bytes == 0
    assert counter.peak_bytes == 64 * 32 * FLOAT


def test_peak_is_the_most_alive_at_once_and_reset_starts_from_now():
    counter = StorageCounter()
    with counter:
        for n in (100, 300, 200):
            t = torch.empty(n)
            del t
        assert (counter.live_bytes, counter.peak_bytes) == (0, 300 * FLOAT)
        kept = torch.empty(50)
        counter.reset_peak()
        assert counter.peak_bytes == 50 * FLOAT
        t = torch.empty(10)
        assert counter.peak_bytes == 60 * FLOAT
        del kept, t


def test_tracked_tensors_count_once_and_their_free_is_seen():
    weight, other = torch.empty(128), torch.empty(16)
    counter = StorageCounter()
    counter.track([weight, weight[4:], weight, other])
    assert counter.live_bytes == (128 + 16) * FLOAT
    with counter:
        del weight
        assert counter.live_bytes == 16 * FLOAT
        grown = torch.empty(4)
        torch.ones(1000, out=grown)  # an out= operator resizes its output's storage in place
        assert counter.live_bytes == (16 + 1000) * FLOAT
        del grown
    assert counter.live_bytes == 16 * FLOAT


def test_in_place_ops_add_nothing_and_other_devices_do_not_count():
    counter = StorageCounter()
    with counter:
        x = torch.zeros(100)
        x.add_(1).mul_(3)
        x[:10] = 7
        assert counter.live_bytes == 100 * FLOAT
        torch.empty(8, device="meta")
        assert counter.live_bytes == 100 * FLOAT
        del x


def _linear_step(linear, x):
    y = linear(x)
    y.backward(torch.ones_like(y))
    return y


def test_a_linear_forward_and_backward_by_hand():
    # Linear(64 -> 32) on x (8, 64), x needing no gradient. While the backward runs, the weights (32x64 + 32) and x
    # are there from the start, and the output y (8x32), the ones fed to backward (8x32) and the weight and bias
    # gradients (32x64 + 32) are added; afterwards the ones are gone with the call.
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    counter = StorageCounter()
    counter.track([*linear.parameters(), x])
    start = counter.live_bytes
    assert start == (32 * 64 + 32 + 8 * 64) * FLOAT
    grads = (32 * 64 + 32) * FLOAT
    with counter:
        y = _linear_step(linear, x)
        assert counter.live_bytes == start + 8 * 32 * FLOAT + grads
        del y
        assert counter.live_bytes == start + grads
    assert counter.peak_bytes == start + 2 * 8 * 32 * FLOAT + grads


def test_the_peak_equals_the_profilers_allocator_events_on_a_small_mlp():
    # The profiler's memory events come from the CPU allocator itself (each allocation and free, in bytes); their
    # running sum's maximum is the allocator's peak above the start, which the counter must reproduce when no kernel
    # allocates scratch of its own.
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))
    x = torch.randn(16, 32, requires_grad=True)
    _linear_step(mlp, x)  # first use out of the way (lazy initialisation of anything)
    mlp.zero_grad(set_to_none=True)
    x.grad = None

    counter = StorageCounter()
    counter.track([*mlp.parameters(), x])
    start = counter.live_bytes
    with counter:
        y = _linear_step(mlp, x)
        del y
    mlp.zero_grad(set_to_none=True)  # the same step again from the same state, under the profiler
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = _linear_step(mlp, x)
        del y
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running, peak = 0, 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    # What is left are the gradients of the weights and of x.
    assert running == (32 * 128 + 128 + 128 * 16 + 16 + 16 * 32) * FLOAT
    assert counter.peak_bytes - start == peak


def test_peak_memory_on_the_cpu_only_with_counting():
    off = PeakMemory(torch.device("cpu"), count_cpu=False)
    with off:
        off.start_measured()
        torch.empty(10)
    assert off.peak_bytes is None and off.method is None

    on = PeakMemory(torch.device("cpu"), count_cpu=True)
    with on:
        torch.empty(1000)  # before the measured iterations: not in the peak
        on.start_measured()
        kept = torch.empty(25)
    assert on.method == CPU_METHOD
    assert on.peak_bytes == on.counter.live_bytes  # type: ignore[union-attr]
    assert on.peak_bytes >= 25 * FLOAT
    assert any(t is kept for t in live_tensors())


def test_the_report_maps_every_process_to_its_pipeline_rank():
    plan = build_plan(PlanInputs("gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50", "4xcpu", "1f1b", microbatch_size=1,
                                 tp=2, global_batch=4, dp=1, pp=2)).plan
    # tp-dp-pp order: global ranks 0, 1 are pipeline rank 0's shards, 2, 3 pipeline rank 1's.
    report = memory_report(plan, [1000, 2000], [1100, 1000, None, 2500], "counted")
    rows = report["ranks"]
    assert [row["predicted_peak_memory_bytes"] for row in rows] == [1000, 1000, 2000, 2000]
    assert [row["relative_error"] for row in rows] == [pytest.approx(1000 / 1100 - 1), 0.0, None, pytest.approx(-0.2)]
    assert report["max_abs_relative_error"] == pytest.approx(0.2) and report["method"] == "counted"
    assert format_memory_line(report) == ("peak memory per rank, predicted / measured: rank 0 0.0 / 0.0 MB (-9.1%), "
                                          "rank 1 0.0 / 0.0 MB (+0.0%), rank 2 0.0 / -, rank 3 0.0 / 0.0 MB (-20.0%)")
    with pytest.raises(ValueError, match="3 predicted peaks for 2 pipeline ranks"):
        memory_report(plan, [1, 2, 3], [1, 2, 3, 4], None)
    unmeasured = memory_report(plan, [1_500_000, 2_000_000], [None] * 4, None)
    assert format_memory_line(unmeasured).startswith("peak memory per rank: predicted 1.5, 1.5, 2.0, 2.0 MB; not")


def test_every_replica_simulated_maps_each_replica_to_its_own_peaks():
    plan = build_plan(PlanInputs("gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50", "2xcpu", "1f1b", dp=2,
                                 global_batch=4)).plan
    report = memory_report(plan, [10, 20], [10, 40], None)  # one pipeline rank, two replicas simulated one by one
    assert [row["predicted_peak_memory_bytes"] for row in report["ranks"]] == [10, 20]


def test_a_two_rank_run_reports_each_ranks_predicted_and_measured_peak(tmp_path):
    built = build_plan(PlanInputs("gpt:layers=4,hidden=256,seq=128,vocab=1000", "2xcpu", "1f1b", microbatches=2))
    plan = tmp_path / "plan.json"
    plan.write_text(built.plan.dumps())
    out = tmp_path / "real"
    result = execute(plan, out, "--iterations", "1", "--warmup", "1", "--measure-memory", "--no-gantt")
    assert result.returncode == 0, result.stderr
    memory = json.loads((out / "compare.json").read_text())["memory"]
    assert memory["method"] == CPU_METHOD
    state = [built.costs.state_bytes(v) for v in range(2)]  # the weights alone are a quarter of it
    for rank, row in enumerate(memory["ranks"]):
        assert set(row) == {"rank", "predicted_peak_memory_bytes", "measured_peak_memory_bytes", "relative_error"}
        assert row["rank"] == rank
        assert row["predicted_peak_memory_bytes"] > state[rank]
        assert row["measured_peak_memory_bytes"] > state[rank] // 4
        measured, predicted = row["measured_peak_memory_bytes"], row["predicted_peak_memory_bytes"]
        assert row["relative_error"] == pytest.approx(predicted / measured - 1)
    assert "peak memory per rank, predicted / measured: rank 0 " in result.stdout


def test_measure_memory_is_refused_for_a_csp_plan(tmp_path, capsys):
    assert sim_main(["--topology", "2xcpu", "--schedule", "csp", "--model", CSP_SPEC, "--subnets", "2",
                     "--partition", "uniform", "--no-gantt", "--out", str(tmp_path / "sim")]) == 0
    err = refused(capsys, tmp_path / "sim" / "plan.json", tmp_path / "out", "--measure-memory")
    assert "--measure-memory does not apply to a csp plan" in err, err
