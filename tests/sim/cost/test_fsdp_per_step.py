"""ZeRO-3 under a pipeline as torchtitan runs it (``Parallelism.fsdp_gathers_per_step``): the lowered plan's gathers
and reduce-scatters counted against the closed form (once per vstage per step; per microbatch where it reshards), the
iteration time against the schedule's closed form, the peak memory against ZeRO-1's plus the shards, the option's
resolution as torchtitan's, and nothing changed without a pipeline."""

from collections import Counter

import pytest

from sim.core.errors import SpecError
from sim.ir.parallel import resolve_reshard_after_forward
from sim.ir.plan import OpKind, Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

GPT = "gpt:layers=4,hidden=512,heads=8,seq=256,vocab=1000"
D, M = 4, 4


def _built(zero=3, schedule="1f1b", pp=2, chunks=1, topology="2x4xA100", **extra):
    return build_plan(PlanInputs(GPT, topology, schedule, microbatches=M, dp=D, pp=pp, zero=zero, chunks=chunks,
                                 **extra))


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_each_vstage_is_gathered_and_reduce_scattered_once_per_step(schedule, chunks):
    topology = "2x4xA100" if chunks == 1 else "4x2xA100"
    plan = _built(schedule=schedule, chunks=chunks, topology=topology, reshard_after_forward=False).plan
    assert plan.layout.fsdp_gathers_per_step
    for rank, program in enumerate(plan.programs):
        vstages = plan.placement.vstages_of(rank)
        counts = Counter((op.kind, op.vstage) for op in program)
        for v in vstages:  # closed form: one of each per vstage per step, m forwards and backwards between them
            assert counts[(OpKind.GATHER_PARAMS, v)] == 1 and counts[(OpKind.REDUCE_GRAD, v)] == 1
            assert counts[(OpKind.F, v)] == counts[(OpKind.B, v)] == M
            ids = [op.id for op in program]
            gather, reduce = ids.index(f"{v}GATHER_PARAMS"), ids.index(f"{v}REDUCE_GRAD")
            forwards = [i for i, op in enumerate(program) if op.kind is OpKind.F and op.vstage == v]
            backwards = [i for i, op in enumerate(program) if op.kind is OpKind.B and op.vstage == v]
            # Issued before the first forward, which waits for it; the reduction right after the last backward,
            # waiting for it; the update waits for the reduction.
            assert gather < forwards[0] and f"{v}GATHER_PARAMS" in program[forwards[0]].deps
            assert reduce == backwards[-1] + 1 and program[reduce].deps == (program[backwards[-1]].id,)
            assert program[ids.index(f"{v}OPT_STEP")].deps == (f"{v}REDUCE_GRAD",)
            assert all(f"{v}GATHER_PARAMS" not in program[i].deps for i in forwards[1:])
        # Every gather at the program's start, in the order of the vstages' first forwards.
        first = sorted(vstages, key=lambda v: next(i for i, op in enumerate(program)
                                                   if op.kind is OpKind.F and op.vstage == v))
        assert [op.vstage for op in program[:len(vstages)]] == first
        assert all(op.kind is OpKind.GATHER_PARAMS for op in program[:len(vstages)])
    assert Plan.loads(plan.dumps()) == plan


def test_resharding_keeps_the_gathers_inside_every_microbatch():
    # Closed form of the per-microbatch form: every layer gathered in each of the m forwards and m backwards and
    # reduce-scattered in each backward, all inside the F and B ops; no collective op of its own.
    built = _built(reshard_after_forward=True)
    plan, view = built.plan, predict_built(built).costs
    kinds = Counter(op.kind for program in plan.programs for op in program)
    assert kinds[OpKind.GATHER_PARAMS] == kinds[OpKind.REDUCE_GRAD] == 0
    assert kinds[OpKind.F] == kinds[OpKind.B] == M * plan.num_vstages
    kept = predict_built(_built(reshard_after_forward=False)).costs
    for v in range(plan.num_vstages):  # the per-step forward and backward carry no collective
        assert kept.compute_time(OpKind.F, v) < view.compute_time(OpKind.F, v)
        assert kept.compute_time(OpKind.B, v) < view.compute_time(OpKind.B, v)


def test_without_a_pipeline_nothing_changes():
    # pp 1: kept gathered means one gather fewer per microbatch inside the ops, as before: no step collectives.
    built = build_plan(PlanInputs(GPT, "1x4xA100", "1f1b", microbatches=M, dp=D, pp=1, zero=3,
                                  reshard_after_forward=False))
    assert not built.plan.layout.fsdp_gathers_per_step
    kinds = {op.kind for program in built.plan.programs for op in program}
    assert OpKind.GATHER_PARAMS not in kinds and OpKind.REDUCE_GRAD not in kinds


def _span(trace, rank, op):
    return next(s for s in trace.spans if s.rank == rank and s.op == op)


def test_iteration_time_is_the_pipeline_shifted_by_the_first_gather_then_the_reduction_and_update():
    """Closed form for 1F1B on two ranks. The pipeline's forwards and backwards cost what they cost without ZeRO
    (no collective inside them): ZeRO-0's plan on the same layout has the same ops and sends. Rank 0's first forward
    waits for its gather G0; rank 1's gather G1 runs meanwhile and is done before rank 0's first activation arrives,
    so every op of the pipeline is ZeRO-0's shifted by G0. Each rank's reduce-scatter S_r follows its last backward
    and its update U_r follows that: T = G0 + max_r(E_r + S_r + U_r), E_r the end of rank r's last backward in
    ZeRO-0's trace."""
    kept, plain = predict_built(_built(reshard_after_forward=False)), predict_built(_built(zero=0))
    view, trace, base = kept.costs, kept.trace, plain.trace
    gather = [view.collective_op(OpKind.GATHER_PARAMS, v).seconds for v in range(2)]
    reduce = [view.collective_op(OpKind.REDUCE_GRAD, v).seconds for v in range(2)]
    update = [view.compute_time(OpKind.OPT_STEP, v) for v in range(2)]
    assert gather[0] > 0 and reduce[0] > 0
    # The precondition: rank 1's gather is hidden behind rank 0's gather, first forward and send.
    assert gather[1] <= gather[0] + _span(base, 1, "1F0").start
    for rank in range(2):
        for span in base.spans:
            if span.rank == rank and span.kind in ("F", "B"):
                assert _span(trace, rank, span.op).start == pytest.approx(gather[0] + span.start, abs=1e-12)
    ends = [_span(base, r, f"{r}B{M - 1}").end for r in range(2)]
    expected = gather[0] + max(e + s + u for e, s, u in zip(ends, reduce, update))
    assert max(s.end for s in trace.spans) == pytest.approx(expected, rel=1e-12)


def test_peak_memory_is_zero1s_plus_the_shards():
    """Per step, a rank holds its stages' whole parameters from the first forward and whole gradients from the first
    backward, on top of its ZeRO-3 shards: where ZeRO-1 peaks after the first backward (1F1B with m = 4: every
    microbatch's forward after the first backward holds as many activations as the warm-up's), ZeRO-3's peak is
    ZeRO-1's plus the parameter and gradient shards, (P + G) / D, P and G the stage's whole bytes, plus what
    accumulating the whole gradients in fp32 (FSDP2's reduce dtype, torchtitan's) adds over the model's 2-byte ones:
    G once more."""
    kept, one, plain = (predict_built(_built(reshard_after_forward=False)), predict_built(_built(zero=1)),
                        predict_built(_built(zero=0)))
    whole = plain.costs  # without ZeRO: the stage's whole parameter and gradient bytes
    assert whole.graph.dtype_bytes == 2
    for rank in range(2):
        shards = (whole.param_bytes(rank) + whole.gradient_bytes(rank)) / D
        upcast = whole.gradient_bytes(rank) * (4 // whole.graph.dtype_bytes - 1)
        layers = len(range(*kept.plan.placement.vstage_layers[rank]))
        assert abs(kept.peak_memory_bytes[rank] - one.peak_memory_bytes[rank] - shards - upcast) <= 2 * layers


def test_the_option_resolves_as_torchtitan():
    # torchtitan/distributed/fsdp.py, get_fsdp_reshard_after_forward_policy: "default" is `not pp_enabled`.
    assert resolve_reshard_after_forward("default", zero=3, pp=2) is False
    assert resolve_reshard_after_forward("default", zero=3, pp=1) is True
    assert resolve_reshard_after_forward("default", zero=1, pp=2) is True  # meaningless below ZeRO-3
    assert resolve_reshard_after_forward("never", zero=3, pp=1) is False
    assert resolve_reshard_after_forward("always", zero=3, pp=4) is True
    with pytest.raises(SpecError, match="one of default, always, never"):
        resolve_reshard_after_forward("sometimes", zero=3, pp=2)
    assert _built(reshard_after_forward="default").plan.layout.fsdp_gathers_per_step
    assert not _built(reshard_after_forward="always").plan.layout.fsdp_gathers_per_step
    assert _built(zero=1, reshard_after_forward="default").plan.layout.reshard_after_forward is True
    with pytest.raises(SpecError, match="needs .*zero.* 3"):
        _built(zero=1, reshard_after_forward="never")


def test_the_command_line_default_is_torchtitans(tmp_path, capsys):
    from sim.run import main

    flags = ["--model", GPT, "--topology", "2x4xA100", "--dp", "4", "--pp", "2", "-m", "4", "--zero", "3",
             "--no-gantt"]
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    assert "GATHER_PARAMS" in (tmp_path / "a" / "plan.json").read_text()
    assert main([*flags, "--fsdp-reshard-after-forward", "always", "--out", str(tmp_path / "b")]) == 0
    assert "GATHER_PARAMS" not in (tmp_path / "b" / "plan.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main([*flags, "--fsdp-reshard-after-forward", "sometimes", "--out", str(tmp_path / "c")])
    assert refused.value.code == 2 and "'sometimes'" in capsys.readouterr().err


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2)])
def test_the_longest_path_evaluator_and_the_program_order_replay_agree_with_the_engine(schedule, chunks):
    # The benchmarks' evaluator and the ledger's replay read the same ops: a forward waiting for a data-parallel
    # collective, a reduction after a backward. Exact when no link is wanted twice at once, else a lower bound.
    from sim.bench.critical_path import compile_plan
    from sim.cost.ledger import program_order_peaks

    built = _built(schedule=schedule, chunks=chunks, topology="4x2xA100", reshard_after_forward=False)
    prediction, views = predict_built(built), built.views()
    compiled = compile_plan(built.plan, len(views))
    values = compiled.slot_values(views)
    makespan, engine = compiled.makespan(values), prediction.metrics["iteration_time_s"]
    assert makespan == engine if not compiled.contended(views, *compiled.times(values)) else makespan <= engine
    assert compiled.peak_memory(views) == prediction.peak_memory_bytes == program_order_peaks(built.plan, views)
