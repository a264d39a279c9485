"""The profiler: what each layer time contains, the written profile, its use by sim.run, and the one-line errors."""

import json
import multiprocessing
import re
import time
import types

import pytest
import torch

import profiles.layer_inputs as layer_inputs
import profiles.layer_timing as layer_timing
from executor.nn.stages import build_layers
from executor.provenance import catalog_id_for_gpu, cpu_model, software_versions
from profiles.layer_timing import median_time_s, time_layers
from profiles.measure import main
from sim.cost.oracle import CostOracle
from sim.cost.p2p_fit import fit_latency_bandwidth
from sim.cost.profile import load_profile
from sim.hw.catalog import get_device
from sim.models import build_model
from sim.models.sharding import Sharding
from sim.run import main as sim_run_main

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=50"
CNN = "cnn:layers=3,features=4,kernel=3,size=8"
QUICK = ["--repeats", "2", "--warmup", "1"]
SLOW_S = 0.05  # an injected delay far above any layer time of the tiny models here (< 1 ms each)


@pytest.fixture(autouse=True)
def restore_threads():
    """The profiler sets torch's thread count for the whole process; give the next test back what it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --- the timing helper ----------------------------------------------------------------------------------------------


def test_median_skips_the_warmup_runs_and_does_not_time_the_setup(monkeypatch):
    # A clock that only the calls move (real sleeps were read up to 5 ms late on a loaded machine): each run takes
    # its duration, each setup 0.03 s.
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(layer_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    durations = iter([0.2, 0.001, 0.010, 0.002])  # one slow warm-up run, then three timed ones
    median = median_time_s(lambda _: advance(next(durations)), warmup=1, repeats=3, sync=lambda: None,
                           setup=lambda: advance(0.03))
    # 0.002 is the median of the timed runs only; counting the warm-up gives 0.006, timing the setup 0.032.
    assert median == pytest.approx(0.002, abs=1e-12)


def test_median_passes_the_setup_result_to_the_run():
    seen = []
    median_time_s(seen.append, warmup=1, repeats=2, sync=lambda: None, setup=lambda: len(seen))
    assert seen == [0, 1, 2]


# --- what a layer's times contain -----------------------------------------------------------------------------------


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: it shows whether a backward pass went through it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLOW_S)
        return grad


def test_the_last_layer_times_include_the_loss_forward_and_backward(monkeypatch, one_thread):
    # One thread (one_thread), as the profiler's default on cpu: with two, a kernel waits at its barrier for a sibling
    # thread the OS has descheduled, and on a loaded 2-core machine that stretched sub-ms layers past SLOW_S.
    real_loss = layer_inputs.loss_fn(GPT)

    def slow_loss(out, targets):
        time.sleep(SLOW_S)
        return real_loss(_SlowBackward.apply(out), targets)

    monkeypatch.setattr(layer_inputs, "loss_fn", lambda spec: slow_loss)
    # Five repeats: a median of five stays below SLOW_S unless three runs of a layer hit a VM scheduling hiccup.
    measured = time_layers(GPT, warmup=1, repeats=5)
    *body, head = measured
    assert head.name == "head"
    assert head.fwd_s >= SLOW_S  # the loss runs in the last stage's forward op
    assert head.bwd_s >= SLOW_S  # and its backward op starts from the loss, through the loss's graph
    assert all(m.fwd_s < SLOW_S and m.bwd_s < SLOW_S for m in body)  # no other layer pays for the loss


@pytest.mark.parametrize("spec", [GPT, CNN])
def test_every_layer_but_the_first_backpropagates_to_its_input(monkeypatch, spec):
    input_grads: dict[int, int] = {}

    def record_input_grad(i):
        def pre_hook(module, args):
            x = args[0]
            input_grads.setdefault(i, 0)
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda grad: input_grads.__setitem__(i, input_grads[i] + 1))
        return pre_hook

    def hooked_build_layers(spec, *, seed):
        layers = build_layers(spec, seed=seed)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(record_input_grad(i))
        return layers

    monkeypatch.setattr(layer_inputs, "build_layers", hooked_build_layers)
    time_layers(spec, warmup=1, repeats=2)
    n = len(build_model(spec))
    assert input_grads[0] == 0  # token ids or images: no gradient, as in the executor's first stage
    assert all(input_grads[i] >= 3 for i in range(1, n))  # at least every backward run (1 warm-up + 2 timed)


@pytest.mark.parametrize("spec", [GPT, CNN])
def test_layer_sizes_are_those_of_the_fp32_tensors(spec):
    graph = build_model(spec)
    measured = time_layers(spec, microbatch_size=3, optimizer="sgd", warmup=0, repeats=1)
    assert [m.name for m in measured] == [layer.name for layer in graph.layers]
    assert [m.param_bytes for m in measured] == [4 * graph.param_count(i) for i in range(len(graph))]
    # The executor's layer outputs have activation_bytes / dtype_bytes elements per sample, in fp32. GPT's last
    # graph layer folds in the loss (4 bytes), so the comparison stops before it; its real output is the logits.
    n = len(graph) - 1 if spec.startswith("gpt") else len(graph)
    for i in range(n):
        assert measured[i].activation_bytes == 3 * 4 * graph.layers[i].activation_bytes // graph.dtype_bytes
    if spec.startswith("gpt"):
        assert measured[-1].activation_bytes == 3 * 16 * 50 * 4  # (n, seq, vocab) fp32 logits
    assert all(m.fwd_s > 0 and m.bwd_s > 0 and m.opt_s > 0 for m in measured)


# --- the CLI, end to end --------------------------------------------------------------------------------------------


def test_the_written_profile_loads_and_drives_the_simulator(tmp_path, capsys):
    out = tmp_path / "sub" / "gpt.json"
    assert main(["--model", GPT, *QUICK, "--p2p-max-bytes", str(2**22), "--p2p-repeats", "15",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    graph = build_model(GPT)
    profile = load_profile(out)
    assert profile.model == graph.spec != GPT  # the canonical spec, defaults filled in and keys sorted
    assert profile.device == "cpu" and profile.microbatch_size == 1
    assert [t.name for t in profile.layers] == [layer.name for layer in graph.layers]
    assert all(t.fwd_s > 0 and t.bwd_s > 0 and t.opt_s > 0 for t in profile.layers)
    data = json.loads(out.read_text())
    assert [entry["param_bytes"] for entry in data["layers"]] == [4 * graph.param_count(i) for i in range(len(graph))]
    p2p = data["p2p"]
    assert (p2p["backend"], p2p["device"]) == ("gloo", "cpu")
    assert "two CPU processes" in data["method"]["p2p"] and p2p["sizes_bytes"] == [2**k for k in range(10, 23)]
    assert len(p2p["one_way_s"]) == len(p2p["one_way_min_s"]) == 13
    assert all(0 < fastest <= median for fastest, median in zip(p2p["one_way_min_s"], p2p["one_way_s"]))
    # The fit itself is tested in test_p2p; here only that a fit, when the host's noise allows one, is the fit of
    # the written medians and reaches the simulator (a failed fit is a warning and leaves the keys out).
    if "latency_s" in p2p:
        assert (p2p["latency_s"], p2p["bandwidth_bytes_per_s"]) == pytest.approx(
            fit_latency_bandwidth(p2p["sizes_bytes"], p2p["one_way_s"]))
        assert (profile.p2p_latency_s, profile.p2p_bandwidth) == (p2p["latency_s"], p2p["bandwidth_bytes_per_s"])
    else:
        assert "fit failed" in data["method"]["p2p"] and profile.p2p_latency_s is None
    assert data["optimizer"] == "adam"
    assert data["method"]["repeats"] == 2 and data["method"]["warmup"] == 1 and data["method"]["p2p_repeats"] == 15
    assert data["machine"]["threads"] == 1 and data["machine"]["gpu"] is None and data["machine"]["cores"] >= 1
    assert data["machine"]["cpu"] == cpu_model() and data["software"] == software_versions()
    assert data["software"]["torch"] == torch.__version__ and data["software"]["cuda"] == torch.version.cuda
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["date"])
    assert "host_copy" not in data  # CUDA only
    assert "block1" in printed and "p2p" in printed

    # The simulator takes these times, scaled to its microbatch size, on cpu ranks.
    costs = CostOracle(graph, 2, profile).layer_costs(get_device("cpu"))
    assert costs.fwd == pytest.approx([2 * t.fwd_s for t in profile.layers])
    assert costs.opt == pytest.approx([t.opt_s for t in profile.layers])
    run_dir = tmp_path / "run"
    assert sim_run_main(["--topology", "2xcpu", "--model", GPT, "--profile", str(out), "--microbatches", "4",
                         "--no-gantt", "--out", str(run_dir)]) == 0
    assert json.loads((run_dir / "metrics.json").read_text())["iteration_time_s"] > 0
    assert multiprocessing.active_children() == []  # the two ping-pong ranks are gone


def test_a_tensor_parallel_shard_is_measured_as_a_rank_of_the_group_holds_it(tmp_path, capsys):
    out = tmp_path / "gpt-tp2.json"
    assert main(["--model", GPT, *QUICK, "--tp", "2", "--no-p2p", "--out", str(out)]) == 0
    assert "one shard of tensor-parallel 2" in capsys.readouterr().out
    data, profile = json.loads(out.read_text()), load_profile(out)
    assert data["tensor_parallel"] == profile.tensor_parallel == 2
    # each layer's parameters are the shard's: the sharded graph's counts, in fp32 (Megatron's split of a GPT block,
    # the vocabulary split by rows; sim.models.sharding)
    shard = build_model(GPT, Sharding(tp=2))
    assert [entry["param_bytes"] for entry in data["layers"]] == [4 * shard.param_count(i) for i in range(len(shard))]
    whole = build_model(GPT)
    assert shard.param_count(1) < whole.param_count(1)
    # a profile of whole layers says so by leaving the field out
    assert "tensor_parallel" not in json.loads((_whole_profile(tmp_path)).read_text())


def test_a_tp_plan_takes_only_a_profile_of_its_own_shards_and_then_predicts_the_executors_peak(tmp_path):
    from experiments.memory_real import run_case
    from sim.core.errors import SpecError
    from sim.plan.build import build_plan
    from sim.plan.inputs import PlanInputs

    spec = "gpt:layers=3,hidden=128,heads=2,seq=64,vocab=500"
    shards, whole = tmp_path / "tp2.json", tmp_path / "whole.json"
    for out, flags in ((shards, ["--tp", "2"]), (whole, [])):
        assert main(["--model", spec, *QUICK, *flags, "--no-p2p", "--out", str(out)]) == 0
    plan = PlanInputs(spec, "2xcpu", "1f1b", microbatches=3, tp=2, pp=1, profile=str(shards))
    with pytest.raises(SpecError, match=r"measured whole layers; tp 2 runs shards of 2 \(measure them with python "
                                        r"-m profiles.measure --tp 2\)"):
        build_plan(PlanInputs(**{**plan.__dict__, "profile": str(whole)}))
    with pytest.raises(SpecError, match="measured the shards of --tp 2; tp 1 runs whole layers"):
        build_plan(PlanInputs(spec, "1xcpu", "1f1b", microbatches=3, profile=str(shards)))
    with pytest.raises(SpecError, match="measured shards without sequence parallelism"):
        build_plan(PlanInputs(**{**plan.__dict__, "sequence_parallel": True}))
    # the executor's two ranks each peak where the ledger, sized by the shard's profile, says (the suite's target is
    # 5 %; within 1 % here: a shard measured alone holds what the rank's own layers hold)
    case = run_case(tmp_path / "runs", "tp2", plan, iterations=2, warmup=1)
    assert [r["rank"] for r in case["ranks"]] == [0, 1]
    assert all(abs(r["relative_error"]) < 0.01 for r in case["ranks"]), case["ranks"]
    assert multiprocessing.active_children() == []


def _whole_profile(tmp_path):
    out = tmp_path / "gpt.json"
    assert main(["--model", GPT, *QUICK, "--no-p2p", "--out", str(out)]) == 0
    return out


def test_no_p2p_writes_no_p2p_and_says_why(tmp_path, capsys):
    out = tmp_path / "cnn.json"
    assert main(["--model", CNN, *QUICK, "--optimizer", "sgd", "--threads", "2", "--no-p2p", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "p2p" not in data and "skipped" in data["method"]["p2p"]
    assert data["optimizer"] == "sgd" and data["machine"]["threads"] == 2
    assert [entry["name"] for entry in data["layers"]] == ["conv0", "conv1", "conv2"]
    assert load_profile(out).p2p_latency_s is None
    assert "p2p: skipped" in capsys.readouterr().out


BAD_ARGS = [
    (["--model", "nosuch:layers=2"], "unknown model"),
    (["--model", "uniform:layers=4"], "no torch implementation"),
    (["--model", "gpt:layers=0"], "layers"),
    (["--model", GPT, "--repeats", "0"], "--repeats must be >= 1"),
    (["--model", GPT, "--warmup", "-1"], "--warmup must be >= 0"),
    (["--model", GPT, "--microbatch-size", "0"], "--microbatch-size must be >= 1"),
    (["--model", GPT, "--threads", "0"], "--threads must be >= 1"),
    (["--model", GPT, "--p2p-repeats", "0"], "--p2p-repeats must be >= 1"),
    (["--model", GPT, "--p2p-timeout", "0"], "--p2p-timeout must be > 0"),
    (["--model", GPT, "--optimizer", "rmsprop"], "invalid choice"),
    (["--model", GPT, "--device", "tpu"], "invalid choice"),
    (["--model", GPT, "--device-name", "nosuch-gpu"], "unknown device"),
    (["--model", GPT, "--p2p-max-bytes", "1500"], "at least two message sizes"),
    (["--model", GPT, "--repeats", "two"], "invalid int"),
    (["--model", GPT, "--tp", "0"], "--tp must be >= 1"),
    (["--model", GPT, "--tp", "3"], "tp=3 must divide"),
    (["--model", CNN, "--tp", "2"], "--tp 2: the executor splits only gpt and llama layers"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGS + [pytest.param(
    ["--model", GPT, "--device", "cuda"], "no CUDA device",
    marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
)])
def test_bad_input_is_one_error_line_exit_2_and_no_file(tmp_path, capsys, argv, message):
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert list(tmp_path.iterdir()) == []


def test_missing_out_or_a_directory_as_out_is_an_error(tmp_path, capsys):
    for argv in (["--model", GPT], ["--model", GPT, "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out, message", [
    ("/proc/pipedejavu.json", "--out '/proc/pipedejavu.json': cannot write in '/proc'"),  # was: 11 s, then a traceback
    ("/dev/null", "--out '/dev/null' exists and is not a regular file"),  # the rename would replace the device node
    ("f/p.json", "--out 'f/p.json': '{tmp}/f' is not a directory"),
    ("p" * 300 + ".json", "a file name may have at most 255"),
    ("", "--out is empty"),
])
def test_an_unusable_out_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys, out, message):
    import profiles.measure

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    monkeypatch.setattr(profiles.measure, "time_layers", lambda *args, **kwargs: pytest.fail("it measured"))
    with pytest.raises(SystemExit) as info:
        main(["--model", GPT, "--no-p2p", "--out", out])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


# --- CUDA device names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu_name, catalog_id", [
    ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
    ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
    ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
    ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
    ("Tesla T4", "t4-16gb"),
    ("NVIDIA A10", "a10-24gb"),
    ("NVIDIA GeForce RTX 3090", "rtx3090-24gb"),
    ("NVIDIA GeForce RTX 4090", "rtx4090-24gb"),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", None),
    ("NVIDIA A10G", None),
    ("Tesla V100S-PCIE-32GB", None),
])
def test_cuda_device_names_map_to_catalog_ids(gpu_name, catalog_id):
    assert catalog_id_for_gpu(gpu_name) == catalog_id
    if catalog_id is not None:
        assert get_device(catalog_id).name == catalog_id  # the id exists in profiles/hardware/devices.yaml
