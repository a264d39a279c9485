"""``executor.run`` on 3D plans, real gloo processes: tensor parallelism (TP 2), data parallelism (DP 2, with ZeRO-1),
and each combined with a pipeline of 2, train like one process on the global batch, and their traces and
``compare.json`` show the collectives as ops of their own.

Tolerances. Data parallelism over 2 replicas is bitwise single-process training as
``executor.reference.train_reference(replicas=2)`` writes it: the same microbatches in the same order per replica,
and a two-process all-reduce (or reduce-scatter) adds the same two sums, in either order the same float. Adam's
elementwise update on a ZeRO slice is the same arithmetic element by element. Tensor parallelism is not bitwise:
the row-parallel Linears sum partial products across shards and the vocabulary-parallel cross entropy shifts and
sums its exponentials per shard, a different rounding from one matmul and one softmax. With SGD (linear in the
gradient) three steps differ by ~4e-9 here; the tolerance 1e-7 is the pipeline tests' (``test_run.py``), and the
weights move more than 100 times that.
"""

import json
from collections import Counter

import pytest
import torch

from executor.reference import train_reference
from sim.ir.plan import Plan
from sim.report.chrome_trace import read_chrome_trace
from sim.run import main as sim_main
from tests.executor.runs import assert_state_equals, execute, merged_state

# The reference runs with one intra-op thread, as the workers do (--threads 1): a CPU kernel's sums may depend on it.
pytestmark = pytest.mark.usefixtures("one_thread")

# Vocabulary 51: the two vocabulary shards are padded to 26 rows each.
SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=51"
WARMUP, ITERATIONS = 1, 2

# name, devices, sim.run flags, optimizer, data-parallel replicas, microbatches per replica, atol (None: bitwise)
CASES = [
    ("tp2", 2, ["--tp", "2", "-m", "2"], "sgd", 1, 2, 1e-7),
    ("tp2-pp2", 4, ["--tp", "2", "--pp", "2", "-m", "2"], "sgd", 1, 2, 1e-7),
    ("dp2", 2, ["--dp", "2", "--global-batch", "4"], "adam", 2, 2, None),
    ("dp2-zero1", 2, ["--dp", "2", "--global-batch", "4", "--zero", "1"], "adam", 2, 2, None),
    # ZeRO-2 sums the microbatches' reduced slices, not the gradients before one reduction: another order of adds.
    ("dp2-zero2", 2, ["--dp", "2", "--global-batch", "4", "--zero", "2"], "sgd", 2, 2, 1e-7),
    # ZeRO-3 (FSDP): each layer gathered for its forward and backward, its gradients reduce-scattered after it; with
    # a pipeline, recomputation and kept-gathered parameters, each stage gathered and reduce-scattered once per step
    # (GATHER_PARAMS and REDUCE_GRAD ops, torchtitan's FSDP under PP); and the same pipeline resharding after every
    # forward (the per-microbatch collectives inside F and B).
    ("dp2-zero3", 2, ["--dp", "2", "--global-batch", "4", "--zero", "3"], "sgd", 2, 2, 1e-7),
    ("dp2-pp2-zero3-recompute", 4, ["--dp", "2", "--pp", "2", "--global-batch", "4", "--zero", "3", "--recompute",
                                    "--no-reshard-after-forward"], "sgd", 2, 2, 1e-7),
    ("dp2-pp2-zero3-interleaved", 4, ["--dp", "2", "--pp", "2", "--global-batch", "8", "--zero", "3", "--schedule",
                                      "interleaved", "--chunks", "2"], "sgd", 2, 4, 1e-7),
    ("dp2-pp2-zero3-resharded", 4, ["--dp", "2", "--pp", "2", "--global-batch", "4", "--zero", "3",
                                    "--fsdp-reshard-after-forward", "always"], "sgd", 2, 2, 1e-7),
    # With --param-gather-overlap: the gather of the parameters the last step updated runs at the start of each
    # iteration, each vstage's first forward waiting for it (and once more after the last step, before the state is
    # saved).
    ("dp2-pp2-zero1-param-gather-overlap", 4, ["--dp", "2", "--pp", "2", "--global-batch", "4", "--zero", "1",
                                               "--param-gather-overlap"], "adam", 2, 2, None),
    # With --grad-overlap: each stage's reduction is issued right after its last backward (sim.plan.lower_collectives).
    ("dp2-pp2-overlap", 4, ["--dp", "2", "--pp", "2", "--global-batch", "4", "--grad-overlap"], "adam", 2, 2, None),
    # A device order (--devices, the search's placement): every process finds its coordinates through it.
    ("tp2-pp2-devices", 4, ["--tp", "2", "--pp", "2", "-m", "2", "--devices", "2,3,0,1"], "sgd", 1, 2, 1e-7),
]


@pytest.mark.parametrize("name,devices,flags,optimizer,replicas,m,atol", CASES, ids=[c[0] for c in CASES])
def test_a_3d_plan_trains_like_one_process_on_the_global_batch(tmp_path, name, devices, flags, optimizer,
                                                               replicas, m, atol):
    assert sim_main(["--topology", f"{devices}xcpu", "--model", SPEC, "--partition", "uniform", "--no-gantt",
                     "--out", str(tmp_path / "sim"), *flags]) == 0
    plan_path = tmp_path / "sim" / "plan.json"
    plan = Plan.loads(plan_path.read_text())
    assert plan.world_size == devices and plan.num_microbatches == m
    out, state = tmp_path / "real", tmp_path / "state"
    result = execute(plan_path, out, "--warmup", str(WARMUP), "--iterations", str(ITERATIONS), "--optimizer",
                     optimizer, "--save-state", str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr

    reference = train_reference(SPEC, steps=WARMUP + ITERATIONS, num_microbatches=m, microbatch_size=1,
                                optimizer=optimizer, replicas=replicas)
    merged = merged_state(state, plan.num_vstages)
    losses = json.loads((out / "metrics.json").read_text())["measurement"]["losses"]
    if atol is None:
        assert sorted(merged) == sorted(reference.state)
        for key, value in reference.state.items():
            assert torch.equal(merged[key], value), key
        assert [tuple(step) for step in losses] == list(reference.losses)
    else:
        assert_state_equals(merged, reference.state, spec=SPEC, atol=atol)
        for got, want in zip(losses, reference.losses, strict=True):
            assert got == pytest.approx(list(want), rel=1e-6)

    # One trace row per process; each ran its pipeline rank's whole program once.
    trace = read_chrome_trace(out / "trace.json")
    layout = plan.layout
    assert trace.num_ranks == devices and trace.meta["coords_of_rank"] == [list(layout.coords(r))
                                                                           for r in range(devices)]
    expected = Counter((r, op.id) for r in range(devices) for op in plan.programs[layout.coords(r)[0]])
    assert Counter((s.rank, s.op) for s in trace.spans) == expected
    # A TP span starts where its compute op's span ends: the op's time, split at the collectives' share.
    spans = {(s.rank, s.op): s for s in trace.spans}
    for span in trace.spans:
        if span.kind.startswith("TP_"):
            sources = {"TP_F": ("F",), "TP_R": ("R",), "TP_B": ("B", "I")}[span.kind]
            source = next(spans[(span.rank, span.op.replace(span.kind, k))] for k in sources
                          if (span.rank, span.op.replace(span.kind, k)) in spans)
            assert source.end == pytest.approx(span.start, abs=1e-9) and span.end > span.start
    # compare.json: predicted and measured means of every kind that ran, the collectives among them.
    compare = json.loads((out / "compare.json").read_text())
    kinds = {op.kind.value for program in plan.programs for op in program}
    collectives = kinds & {"TP_F", "TP_B", "REDUCE_GRAD", "GATHER_PARAMS"}
    # ZeRO-3 gathers and scatters inside F and B: no data-parallel op of its own, except under a pipeline without
    # resharding after the forward, where each stage is gathered and reduce-scattered once per step by its own ops
    data_parallel = ({"REDUCE_GRAD", "GATHER_PARAMS"} if layout.fsdp_gathers_per_step else set() if layout.zero == 3
                     else {"REDUCE_GRAD"} | ({"GATHER_PARAMS"} if layout.zero else set()))
    assert collectives == ({"TP_F", "TP_B"} if layout.tp > 1 else set()) | (data_parallel if layout.dp > 1 else set())
    for kind in kinds:
        assert compare["ops"][kind]["predicted_mean_s"] > 0 and compare["ops"][kind]["measured_mean_s"] > 0, kind
    assert compare["parallel"]["measured_rows"] == devices
    assert compare["parallel"]["predicted_rows"] == layout.pp  # identical replicas: one simulated


# Grouped-query attention (4 query heads over 2 key/value heads: one of each kind per shard) with Qwen 2's biases and
# Qwen 3's QK-norm; vocabulary 51, padded per shard.
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=48,vocab=51,seq=8,qkv_bias=1,qk_norm=1"


def _trains_like_one_process(tmp_path, spec: str, devices: int, flags: list[str], replicas: int, *,
                                   losses: bool = True) -> tuple[Plan, object]:
    """``sim.run`` makes the plan of ``flags``, ``executor.run`` trains it on ``devices`` CPU processes with SGD, and
    its saved state (and losses) equal single-process training on the global batch of ``replicas`` replicas; returns
    the plan and the run's output folder."""
    assert sim_main(["--topology", f"{devices}xcpu", "--model", spec, "--partition", "uniform", "--no-gantt",
                     "--out", str(tmp_path / "sim"), *flags]) == 0
    plan_path = tmp_path / "sim" / "plan.json"
    plan = Plan.loads(plan_path.read_text())
    out, state = tmp_path / "real", tmp_path / "state"
    result = execute(plan_path, out, "--warmup", str(WARMUP), "--iterations", str(ITERATIONS), "--optimizer", "sgd",
                     "--save-state", str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    # The plan's routing (balanced when it names none) and capacity factor, forced on the reference's mixtures too.
    reference = train_reference(spec, steps=WARMUP + ITERATIONS, num_microbatches=plan.num_microbatches,
                                microbatch_size=1, optimizer="sgd", replicas=replicas,
                                routing=plan.option("routing", "balanced"),
                                capacity_factor=plan.option("capacity_factor", 0.0))
    assert_state_equals(merged_state(state, plan.num_vstages), reference.state, spec=spec, atol=1e-7)
    if losses:
        measured = json.loads((out / "metrics.json").read_text())["measurement"]["losses"]
        for got, want in zip(measured, reference.losses, strict=True):
            assert got == pytest.approx(list(want), rel=1e-6)
    return plan, out


def test_a_llama_plan_with_tensor_parallelism_recomputation_and_a_pipeline_trains_like_one_process(tmp_path):
    _trains_like_one_process(tmp_path, LLAMA, 4, ["--tp", "2", "--pp", "2", "-m", "2", "--recompute"], 1)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_llama_plan_with_tensor_parallelism_and_sharded_data_parallelism_trains_like_one_process(tmp_path, zero):
    # TP 2 × DP 2 under ZeRO-2 and ZeRO-3 (FSDP: each layer's tensor shard sharded again over the replicas).
    _trains_like_one_process(tmp_path, LLAMA, 4, ["--tp", "2", "--dp", "2", "--zero", str(zero),
                                                        "--global-batch", "4"], 2, losses=False)


@pytest.mark.parametrize("flags, devices", [(["--cp", "2", "--dp", "1"], 2),
                                            (["--cp", "2", "--dp", "2", "--tp", "2", "--zero", "1"], 8),
                                            (["--cp", "2", "--pp", "2", "--dp", "1", "--zero", "3"], 4)])
def test_a_llama_plan_with_context_parallelism_trains_like_one_process(tmp_path, flags, devices):
    # Each sequence split over 2 processes (chunks 0+3 and 1+2 of 4), keys and values gathered for attention; with
    # DP and TP, and with a pipeline under FSDP. No sliding window (the split needs plain causal attention).
    replicas = int(flags[flags.index("--dp") + 1])
    _trains_like_one_process(tmp_path, LLAMA.replace("seq=8", "seq=16"), devices,
                                   [*flags, "--global-batch", str(2 * replicas), "--ignore-memory"], replicas)


def test_a_mixture_of_experts_with_data_parallelism_under_zero_1_trains_like_one_process(tmp_path):
    # Without expert parallelism every replica holds every expert: the experts' gradients reduce with the rest.
    moe = ("moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,"
           "expert_ffn=16,shared_experts=1")
    _trains_like_one_process(tmp_path, moe, 2, ["--dp", "2", "--zero", "1", "--global-batch", "4"], 2)


# Expert parallelism: 4 experts split over 2 processes, the tokens dispatched and combined by all-to-all. Not bitwise:
# an expert multiplies the rows of both replicas in one GEMM, and its weight gradient sums them in one product.
MOE_EP = ("moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,"
          "expert_ffn=16,shared_experts=1")


@pytest.mark.parametrize("flags, devices", [
    # 4 replicas, experts over 2: each block held twice, its gradients reduced over that pair; ZeRO-1 shards the
    # experts' optimizer state over the pair and the rest over all four; a skew routes 3/4 of the slots unevenly.
    (["--dp", "4", "--ep", "2", "--zero", "1", "--routing", "skew:1.5:3"], 4),
    # A pipeline of 2 with a split backward and recomputation (the rebuild runs the all-to-alls again), a capacity
    # factor that drops the hot experts' overflow, and DeepSeek-style sigmoid routing with a dense first layer.
    (["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "zb1p", "--recompute", "--routing", "skew:2:1",
      "--capacity-factor", "1.0"], 4),
    # Megatron-Core's all-gather dispatcher: every token gathered, the outputs reduce-scattered; with a capacity factor
    # (the dropped slots left out of the gathered routing map) and a skew.
    (["--dp", "2", "--ep", "2", "--ep-dispatcher", "all-gather", "--routing", "skew:1.5:3", "--capacity-factor",
      "1.0"], 2),
], ids=["dp4-ep2-zero1-skew", "pp2-dp2-ep2-zb1p-recompute-capacity", "dp2-ep2-all-gather-capacity"])
def test_a_mixture_with_expert_parallelism_trains_like_one_process(tmp_path, flags, devices):
    spec = MOE_EP if "--pp" not in flags else MOE_EP.replace("layers=2", "layers=3") + ",dense_layers=1,sigmoid=1"
    replicas = int(flags[flags.index("--dp") + 1])
    plan, out = _trains_like_one_process(tmp_path, spec, devices, [*flags, "--global-batch", str(2 * replicas)],
                                         replicas)
    kinds = {op.kind.value for program in plan.programs for op in program}
    assert {"EP_F", "EP_B"} <= kinds and ("EP_R" in kinds) is ("--recompute" in flags)
    # Each EP span starts where its compute op's span ends (the op's time split at its all-to-alls' share), and the
    # all-to-alls really ran: a mixture's forward exchanges counts, tokens and expert numbers, then outputs.
    trace = read_chrome_trace(out / "trace.json")
    spans = {(s.rank, s.op): s for s in trace.spans}
    sources = {"EP_F": ("F",), "EP_R": ("R",), "EP_B": ("B", "I")}
    drawn = [span for span in trace.spans if span.kind.startswith("EP_")]
    assert drawn
    for span in drawn:
        source = next(spans[(span.rank, span.op.replace(span.kind, k))] for k in sources[span.kind]
                      if (span.rank, span.op.replace(span.kind, k)) in spans)
        assert source.end == pytest.approx(span.start, abs=1e-9) and span.end >= span.start
    assert any(span.end > span.start for span in drawn if span.kind == "EP_F")
    compare = json.loads((out / "compare.json").read_text())
    for kind in ("EP_F", "EP_B"):
        assert compare["ops"][kind]["predicted_mean_s"] > 0 and compare["ops"][kind]["measured_mean_s"] > 0, kind
