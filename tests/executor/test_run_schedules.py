"""``executor.run`` on the rest of the schedule family, 2 and 4 CPU ranks: the same parameters as single-process
training (flush schedules) or as the delayed-update reference (async PipeDream)."""

import json

import pytest
import torch

from executor.reference import train_pipedream_reference, train_reference
from sim.ir.plan import Plan
from tests.executor.runs import SPEC, assert_state_equals, execute, merged_state, sim_plan

# 8 layers (embed, 6 blocks, head): interleaved with 2 chunks on 4 ranks needs 8 vstages of at least one layer.
SPEC8 = "gpt:heads=2,hidden=32,layers=6,seq=8,vocab=50"
# Grouped-query attention with Qwen 2's biases and Qwen 3's QK-norm, and one with a sliding window.
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=48,vocab=50,seq=8,qkv_bias=1,qk_norm=1"
LLAMA_WINDOW = "llama:layers=2,hidden=32,heads=4,kv_heads=1,ffn=48,vocab=50,seq=8,window=3"
# Mixtures of experts: GPT-OSS-style (biases, sinks, alternating windows, clamped experts) and DeepSeek-style (latent
# attention, a dense first layer, a shared expert, sigmoid routing).
MOE_SINKS = ("moe:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,"
             "expert_ffn=16,qk_norm=0,qkv_bias=1,o_bias=1,sinks=1,window=3,window_period=2,router_bias=1,"
             "expert_bias=1,swiglu_clamp=7")
MOE_LATENT = ("moe:layers=2,hidden=32,heads=4,head_dim=8,ffn=48,vocab=50,seq=8,experts=4,topk=2,expert_ffn=16,"
              "qk_norm=0,q_lora=16,kv_lora=12,rope_dim=4,v_dim=8,dense_layers=1,shared_experts=1,sigmoid=1")
ATOL = 1e-7  # SGD: pipelines only reorder the sum of microbatch gradients (tests/executor/test_run.py)


def _plan(tmp_path, ranks, m, *flags, model=SPEC):
    return sim_plan(tmp_path / "sim", ranks, m, *flags, model=model)


def _train(tmp_path, plan, warmup, iterations):
    out, state = tmp_path / "real", tmp_path / "state"
    result = execute(plan, out, "--warmup", str(warmup), "--iterations", str(iterations), "--optimizer", "sgd",
                     "--save-state", str(state), "--no-gantt", "--threads", "1")
    assert result.returncode == 0, result.stderr
    plan_obj = Plan.loads(plan.read_text())
    losses = json.loads((out / "metrics.json").read_text())["measurement"]["losses"]
    return plan_obj, merged_state(state, plan_obj.num_vstages), losses


def _assert_state(merged, reference_state, spec=SPEC):
    assert_state_equals(merged, reference_state, spec=spec, atol=ATOL)


# A zero-bubble-style schedule with two stages per rank (loop placement: stages 0 and 2 on rank 0), written the way
# torch.distributed.pipelining's ``_dump_csv`` writes a compute-only schedule: one row per rank, cells
# ``{stage}{action}{mb}``.
PYTORCH_CSV = """0F0,0F1,2F0,2F1,2I0,2W0,2I1,2W1,0I0,0W0,0I1,0W1
1F0,1F1,3F0,3F1,3I0,3W0,3I1,3W1,1I0,1W0,1I1,1W1
"""


def test_a_pytorch_multi_stage_schedule_file_runs_and_matches_single_process_training(tmp_path):
    csv = tmp_path / "zb_2rank_2stage.csv"
    csv.write_text(PYTORCH_CSV)
    plan_path = _plan(tmp_path, 2, 2, "--schedule-file", str(csv))
    plan, merged, losses = _train(tmp_path, plan_path, 1, 1)
    assert plan.placement.vstage_to_rank == (0, 1, 0, 1)
    reference = train_reference(SPEC, steps=2, num_microbatches=2, microbatch_size=1, optimizer="sgd")
    _assert_state(merged, reference.state)


def _pytorch_schedule_csv(path, schedule_class, ranks, stages_per_rank, m):
    """Write the schedule PyTorch itself generates, with its own ``_dump_csv``, without a process group: the stages
    are autospec mocks carrying only what the schedule constructor reads (as PyTorch's schedule visualizer does)."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    stages = []
    for k in range(stages_per_rank):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.stage_index, stage.num_stages = k * ranks, ranks * stages_per_rank  # rank 0's stages, loop placement
        stage.group_size, stage.group_rank = ranks, 0
        stage.is_first, stage.is_last = stage.stage_index == 0, stage.stage_index == ranks * stages_per_rank - 1
        stage.submod = torch.nn.Identity()
        stages.append(stage)
    schedule_class(stages, n_microbatches=m, loss_fn=lambda output, target: output)._dump_csv(str(path))


def test_pytorchs_own_interleaved_zero_bubble_schedule_runs_and_matches_single_process_training(tmp_path):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    csv = tmp_path / "pytorch_izb.csv"
    _pytorch_schedule_csv(csv, ScheduleInterleavedZeroBubble, ranks=2, stages_per_rank=2, m=4)
    assert "UNSHARD" in csv.read_text() and "2I0" in csv.read_text()  # PyTorch's lowered compute_comms form
    plan, merged, losses = _train(tmp_path, _plan(tmp_path, 2, 4, "--schedule-file", str(csv)), 1, 1)
    assert plan.placement.vstage_to_rank == (0, 1, 0, 1)
    reference = train_reference(SPEC, steps=2, num_microbatches=4, microbatch_size=1, optimizer="sgd")
    _assert_state(merged, reference.state)
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)


@pytest.mark.parametrize("ranks,flags,spec", [
    (2, ["--schedule", "interleaved", "--chunks", "2"], SPEC),
    (4, ["--schedule", "interleaved", "--chunks", "2"], SPEC8),
    (2, ["--schedule", "zb1p"], SPEC),
    (4, ["--schedule", "zb1p"], SPEC),
    (2, ["--schedule", "gpipe", "--recompute"], SPEC),
    (2, ["--schedule", "1f1b", "--recompute"], SPEC),
    (2, ["--schedule", "interleaved", "--chunks", "2", "--recompute"], SPEC),
    (2, ["--schedule", "zb1p", "--recompute"], SPEC),
    (2, ["--schedule", "1f1b", "--recompute"], LLAMA),
    (2, ["--schedule", "zb1p"], LLAMA_WINDOW),
    (2, ["--schedule", "1f1b", "--recompute"], MOE_SINKS),
    (2, ["--schedule", "zb1p"], MOE_LATENT),
    (2, ["--schedule", "1f1b", "--recompute", "selective"], MOE_LATENT),
    (2, ["--schedule", "dualpipev"], SPEC),
    (2, ["--schedule", "dualpipev", "--recompute"], MOE_LATENT),
], ids=["interleaved-2", "interleaved-4", "zb1p-2", "zb1p-4", "gpipe-recompute-2", "1f1b-recompute-2",
        "interleaved-recompute-2", "zb1p-recompute-2", "llama-1f1b-recompute-2", "llama-window-zb1p-2",
        "moe-sinks-1f1b-recompute-2", "moe-latent-zb1p-2", "moe-latent-1f1b-selective-2", "dualpipev-2",
        "moe-latent-dualpipev-recompute-2"])
def test_flush_schedules_equal_single_process_training(tmp_path, ranks, flags, spec):
    m, warmup, iterations = 4, 1, 1
    plan, merged, losses = _train(tmp_path, _plan(tmp_path, ranks, m, *flags, model=spec), warmup, iterations)
    kinds = {op.kind.value for program in plan.programs for op in program}
    if "zb1p" in flags:
        assert {"I", "W"} <= kinds and "B" not in kinds
    if "interleaved" in flags:
        assert plan.placement.vstage_to_rank == tuple(list(range(ranks)) * 2)
    if "dualpipev" in flags:  # a V: the last rank turns in memory; full and split backwards both run
        assert plan.placement.vstage_to_rank == tuple(range(ranks)) + tuple(reversed(range(ranks)))
        assert {"B", "I", "W"} <= kinds
    # selective recomputation is no op of the plan: it changes what a block keeps, not the math
    assert ("R" in kinds) is ("--recompute" in flags and "selective" not in flags)
    reference = train_reference(spec, steps=warmup + iterations, num_microbatches=m, microbatch_size=1,
                                optimizer="sgd")
    _assert_state(merged, reference.state, spec)
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)


@pytest.mark.parametrize("ranks,vertical_sync,recompute", [
    (2, False, False), (2, True, False), (4, False, False), (2, False, True),
])
def test_pipedream_equals_the_delayed_update_reference(tmp_path, ranks, vertical_sync, recompute):
    m, warmup, iterations = 4, 1, 1
    flags = (["--schedule", "pipedream"] + (["--vertical-sync"] if vertical_sync else [])
             + (["--recompute"] if recompute else []))
    plan, merged, losses = _train(tmp_path, _plan(tmp_path, ranks, m, *flags), warmup, iterations)
    assert ("R" in {op.kind.value for program in plan.programs for op in program}) is recompute

    # PipeDream §3.3 in closed form: under 1F1B, stage s runs minibatch k with the weights after k - (p - s - 1)
    # of the iteration's updates (its warm-up forwards ran before any); vertical sync uses stage 0's version.
    def version(s, k):
        return max(0, k - (ranks - 1 - (0 if vertical_sync else s)))

    reference = train_pipedream_reference(SPEC, stage_layers=plan.placement.vstage_layers, version=version,
                                          iterations=warmup + iterations, minibatches=m, microbatch_size=1,
                                          optimizer="sgd")
    _assert_state(merged, reference.state)
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)


def test_dualpipev_on_four_ranks_equals_single_process_training(tmp_path):
    # 8 vstages in a V on 4 ranks (rank r holds r and 7 - r): the middle ranks send and receive in both directions, the
    # last rank turns in memory; m = 2p = 8 microbatches, the fewest DualPipeV takes.
    ranks, m = 4, 8
    plan, merged, losses = _train(tmp_path, _plan(tmp_path, ranks, m, "--schedule", "dualpipev", model=SPEC8), 1, 1)
    assert plan.placement.vstage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    reference = train_reference(SPEC8, steps=2, num_microbatches=m, microbatch_size=1, optimizer="sgd")
    _assert_state(merged, reference.state, SPEC8)
    for got, want in zip(losses, reference.losses, strict=True):
        assert got == pytest.approx(list(want), rel=1e-6)
