"""The collectives lowering pass: exact small programs, and every schedule with TP and DP validates and simulates."""

from __future__ import annotations

import pytest

from sim.core.errors import SpecError
from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"


def _text(plan) -> list[str]:
    return [" ".join(f"{op.id}{'<' + ','.join(op.deps) + '>' if op.deps else ''}" for op in program)
            for program in plan.programs]


def test_data_parallel_1f1b_reduces_after_the_backward_pass():
    # Megatron's default (and vTrain's runs): each stage's gradients are all-reduced once its rank's backward pass
    # is done, and the optimizer step waits for them.
    plan = build_plan(PlanInputs("uniform:layers=2", "8xideal", "1f1b", microbatches=2, dp=2, pp=2)).plan
    assert _text(plan) == [
        "0F0 0SEND_F0<0F0> 0F1 0SEND_F1<0F1> 0RECV_B0<1SEND_B0> 0B0<0RECV_B0> 0RECV_B1<1SEND_B1> 0B1<0RECV_B1> "
        "0REDUCE_GRAD<0B1> 0OPT_STEP<0REDUCE_GRAD>",
        "1RECV_F0<0SEND_F0> 1F0<1RECV_F0> 1B0 1SEND_B0<1B0> 1RECV_F1<0SEND_F1> 1F1<1RECV_F1> 1B1 1SEND_B1<1B1> "
        "1REDUCE_GRAD<1B1> 1OPT_STEP<1REDUCE_GRAD>",
    ]


def test_overlapped_reduction_is_issued_right_after_the_last_backward():
    # DDP's bucketed reduction starts with the last backward of the stage: the REDUCE_GRAD is issued right after it
    # (before the gradient is even sent on), the optimizer step still waits at the end.
    plan = build_plan(PlanInputs("uniform:layers=2", "8xideal", "1f1b", microbatches=2, dp=2, pp=2,
                                 grad_overlap=True)).plan
    assert _text(plan)[1] == ("1RECV_F0<0SEND_F0> 1F0<1RECV_F0> 1B0 1SEND_B0<1B0> 1RECV_F1<0SEND_F1> 1F1<1RECV_F1> "
                              "1B1 1REDUCE_GRAD<1B1> 1SEND_B1<1B1> 1OPT_STEP<1REDUCE_GRAD>")


def test_tensor_parallel_ops_follow_their_compute_and_sends_wait_for_them():
    # Megatron §3: the all-reduces complete a block's output (forward) and input gradient (backward), so what is
    # sent is ready only after them; a recompute repeats the forward's all-reduces, once the output gradient is there
    # (it rebuilds layer by layer inside the backward). ZeRO-1 gathers after the step.
    plan = build_plan(PlanInputs(GPT, "8xideal", "1f1b", microbatches=2, tp=2, dp=2, pp=2, zero=1,
                                 recompute=True)).plan
    assert _text(plan) == [
        "0F0 0TP_F0 0SEND_F0<0TP_F0> 0F1 0TP_F1 0SEND_F1<0TP_F1> 0RECV_B0<1SEND_B0> 0R0<0RECV_B0> 0TP_R0 0B0<0RECV_B0> "
        "0TP_B0 0RECV_B1<1SEND_B1> 0R1<0RECV_B1> 0TP_R1 0B1<0RECV_B1> 0TP_B1 0REDUCE_GRAD<0B1> 0OPT_STEP<0REDUCE_GRAD> "
        "0GATHER_PARAMS<0OPT_STEP>",
        "1RECV_F0<0SEND_F0> 1F0<1RECV_F0> 1TP_F0 1R0 1TP_R0 1B0 1TP_B0 1SEND_B0<1TP_B0> 1RECV_F1<0SEND_F1> "
        "1F1<1RECV_F1> 1TP_F1 1R1 1TP_R1 1B1 1TP_B1 1SEND_B1<1TP_B1> 1REDUCE_GRAD<1B1> 1OPT_STEP<1REDUCE_GRAD> "
        "1GATHER_PARAMS<1OPT_STEP>",
    ]


def test_a_vstage_handed_over_on_one_rank_waits_for_the_collective():
    plan = build_plan(PlanInputs(GPT, "2xideal", "interleaved", microbatches=2, chunks=2, tp=2, pp=1)).plan
    deps = {op.id: op.deps for op in plan.programs[0]}
    assert deps["1F0"] == ("0TP_F0",) and deps["0B0"] == ("1TP_B0",)


def test_zero_bubble_splits_keep_their_weight_half_on_the_input_half():
    plan = build_plan(PlanInputs(GPT, "8xideal", "zb1p", microbatches=4, tp=2, dp=2, pp=2)).plan
    for program in plan.programs:
        for op in program:
            if op.kind is OpKind.W:
                assert op.deps == () or all("I" in dep and "TP" not in dep for dep in op.deps)
            if op.kind is OpKind.REDUCE_GRAD:
                assert op.deps[0].endswith("W3")  # the vstage's last weight gradient


def test_pipedream_replicas_reduce_every_microbatch_before_its_update():
    # PipeDream's replicated stages (SOSP'19 §3.2): each update is preceded by the all-reduce of its gradient.
    plan = build_plan(PlanInputs("uniform:layers=2", "8xideal", "pipedream", microbatches=2, dp=2, pp=2)).plan
    assert _text(plan)[1] == ("1RECV_F0<0SEND_F0> 1F0<1RECV_F0> 1B0 1SEND_B0<1B0> 1REDUCE_GRAD0<1B0> "
                              "1OPT_STEP0<1REDUCE_GRAD0> 1RECV_F1<0SEND_F1> 1F1<1RECV_F1> 1B1 1SEND_B1<1B1> "
                              "1REDUCE_GRAD1<1B1> 1OPT_STEP1<1REDUCE_GRAD1>")


@pytest.mark.parametrize(("flag", "value"), [("zero", 1), ("grad_overlap", True)])
def test_zero_and_overlap_with_weight_stashing_are_refused(flag, value):
    with pytest.raises(SpecError, match=r"is modelled for schedules that update once per iteration, not pipedream"):
        build_plan(PlanInputs("uniform:layers=4", "8xideal", "pipedream", microbatches=4, dp=2, pp=4,
                              **{flag: value}))


@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1)])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_every_flush_schedule_combines_with_tp_and_dp(schedule, chunks, recompute):
    built = build_plan(PlanInputs("gpt:layers=8,hidden=256,heads=4,seq=64,vocab=512", "2x8xA100", schedule,
                                  microbatch_size=2, global_batch=32, chunks=chunks, tp=2, dp=2, pp=4,
                                  recompute=recompute, sequence_parallel=recompute == "selective"))
    plan = built.plan
    kinds = {op.kind for program in plan.programs for op in program}
    assert {OpKind.TP_F, OpKind.TP_B, OpKind.REDUCE_GRAD} <= kinds
    assert (OpKind.TP_R in kinds) == (recompute == "full")
    prediction = predict(plan, topology=built.topology, oracle=built.costs.oracle)
    counts = {kind: found["count"] for kind, found in prediction.metrics["ops"].items()}
    # One span per op of the simulated replica (its programs), so every collective ran.
    assert counts == {kind.value: sum(op.kind is kind for p in plan.programs for op in p) for kind in kinds}
    assert prediction.metrics["throughput_samples_per_s"] == pytest.approx(32 / prediction.metrics[
        "iteration_time_s"], rel=1e-12)


def test_an_overlapped_parameter_gather_runs_before_each_vstages_first_forward():
    # Megatron-Core's overlap_param_gather under ZeRO-1: the gather of what the last step updated leads this step's
    # forward (one iteration stands for all), instead of following the optimizer step.
    plan = build_plan(PlanInputs("uniform:layers=2", "8xideal", "1f1b", microbatches=2, dp=2, pp=2, zero=1,
                                 param_gather_overlap=True)).plan
    assert _text(plan) == [
        "0GATHER_PARAMS 0F0<0GATHER_PARAMS> 0SEND_F0<0F0> 0F1 0SEND_F1<0F1> 0RECV_B0<1SEND_B0> 0B0<0RECV_B0> "
        "0RECV_B1<1SEND_B1> 0B1<0RECV_B1> 0REDUCE_GRAD<0B1> 0OPT_STEP<0REDUCE_GRAD>",
        "1GATHER_PARAMS 1RECV_F0<0SEND_F0> 1F0<1RECV_F0,1GATHER_PARAMS> 1B0 1SEND_B0<1B0> 1RECV_F1<0SEND_F1> "
        "1F1<1RECV_F1> 1B1 1SEND_B1<1B1> 1REDUCE_GRAD<1B1> 1OPT_STEP<1REDUCE_GRAD>"]
    # Interleaved: a rank's two vstages gathered in the order of their first forwards.
    interleaved = build_plan(PlanInputs("uniform:layers=4", "8xideal", "interleaved", microbatches=4, dp=2, pp=2,
                                        chunks=2, zero=1, param_gather_overlap=True)).plan
    first = [op.id for op in interleaved.programs[0][:2]]
    assert first == ["0GATHER_PARAMS", "2GATHER_PARAMS"]
    for program in interleaved.programs:
        forwards = {}
        for op in program:
            if op.kind is OpKind.F:
                forwards.setdefault(op.vstage, op)
        assert all(f"{v}GATHER_PARAMS" in op.deps for v, op in forwards.items())


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_an_overlapped_parameter_gather_needs_the_distributed_optimizer(zero):
    with pytest.raises(SpecError, match="param_gather_overlap overlaps the distributed optimizer's parameter "
                                        "all-gather with the next forward; it needs zero 1"):
        build_plan(PlanInputs("uniform:layers=2", "8xideal", "1f1b", microbatches=2, dp=2, pp=2, zero=zero,
                              param_gather_overlap=True))
