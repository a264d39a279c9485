"""Interleaved 1F1B (Megatron-LM, arXiv 2104.04473 §2.2.2) against hand-written orders and its closed forms.

Units: the ``uniform`` model gives every layer fwd 1 ms and bwd 2 ms per sample; with one layer per vstage a chunk's
F takes 1 ms and its B 2 ms, and a full stage (v chunks) t_f = v ms, t_b = 2v ms. ``Nxideal`` links are free.
"""

import pytest

from sim.core.errors import SpecError
from sim.engine.simpy_engine import simulate
from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.validate import validate
from sim.schedules import SCHEDULES


def _rows(programs):
    return [" ".join(op.id for op in program) for program in programs]


def _inputs(p, v, m, **kw):
    kw.setdefault("partition", "uniform")
    return PlanInputs(f"uniform:layers={p * v},fwd_ms=1,bwd_ms=2", f"{p}xideal", "interleaved", m, chunks=v, **kw)


def _simulate(inputs):
    built = build_plan(inputs)
    return built, simulate(built.plan, built.costs, built.topology)


def test_order_p2_v2_m4_by_hand():
    # k-th chunk-forward: chunk (k // p) mod v, microbatch (k // pv)·p + k mod p, i.e. (c, mb) = (0,0) (0,1) (1,0)
    # (1,1) (0,2) (0,3) (1,2) (1,3); backwards take the same microbatches with chunk v−1−c. vstage = c·p + r.
    # Warm-up: rank 0 2·1 + 1·2 = 4, rank 1 0 + 2 = 2, then F/B pairs, then the remaining backwards.
    assert _rows(SCHEDULES["interleaved"].build(2, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_single_rank_chunks_hand_over_in_memory():
    # p = 1: warm-up (v−1)·p = 2; chunk of forward k is k mod 3, microbatch k // 3; backward chunk 2 − k mod 3.
    assert _rows(SCHEDULES["interleaved"].build(1, 2, 3)) == ["0F0 1F0 2F0 2B0 0F1 1B0 1F1 0B0 2F1 2B1 1B1 0B1"]
    built = build_plan(PlanInputs("uniform:layers=3", "1xideal", "interleaved", 2, chunks=3, partition="uniform"))
    kinds = {op.kind for op in built.plan.programs[0]}
    assert not kinds & {OpKind.SEND_F, OpKind.RECV_F, OpKind.SEND_B, OpKind.RECV_B}
    assert built.plan.programs[0][1].id == "1F0" and built.plan.programs[0][1].deps == ("0F0",)


def test_exact_timeline_p2_v2_m4():
    # Worked by hand from the order above: an op starts when its rank is free and its producer has finished
    # (chunk F 1 ms, chunk B 2 ms). Iteration 27 ms = 3·(v·m + p − 1).
    expected = {
        0: "0F0@0 0F1@1 2F0@2 2F1@3 0F2@4 2B0@6 0F3@8 2B1@9 2F2@11 0B0@12 2F3@14 0B1@15 2B2@18 2B3@21 0B2@23 0B3@25",
        1: "1F0@1 1F1@2 3F0@3 3B0@4 3F1@6 3B1@7 1F2@9 1B0@10 1F3@12 1B1@13 3F2@15 3B2@16 3F3@18 3B3@19 1B2@21 1B3@23",
    }
    _, result = _simulate(_inputs(2, 2, 4))
    for rank, row in expected.items():
        got = " ".join(f"{s.op}@{round(s.start * 1e3)}" for s in result.trace.on_rank(rank, "compute")
                       if s.kind in ("F", "B"))
        assert got == row, rank
    assert result.trace.makespan == pytest.approx(27e-3, rel=1e-12)


@pytest.mark.parametrize("p", range(1, 7))
def test_bubble_fraction_formula_over_grid(p):
    # Megatron §2.2.2: iteration (m + (p−1)/v)(t_f + t_b) with t_f + t_b = 3v ms per full stage, so 3(vm + p − 1) ms,
    # and bubble ÷ total = (p−1)/(vm + p − 1).
    for v in (2, 3, 4):
        for m in (p, 2 * p, 3 * p, 4 * p):
            _, result = _simulate(_inputs(p, v, m))
            trace = result.trace
            busy = sum(s.duration for s in trace.spans if s.stream == "compute")
            assert trace.makespan == pytest.approx(3e-3 * (v * m + p - 1), rel=1e-12), (p, v, m)
            assert 1 - busy / (p * trace.makespan) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, v, m)


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 2, 4), (4, 3, 12), (2, 4, 4), (3, 2, 3), (6, 2, 12), (1, 3, 2)])
def test_peak_activation_memory(p, v, m):
    # Rank r holds its warm-up chunks plus the one forward of the first steady step: min(2(p−r−1) + (v−1)p + 1, mv)
    # chunk activations (Megatron's warm-up count). A one-layer chunk keeps its input and its output, 2 × 1 MB.
    built, result = _simulate(_inputs(p, v, m))
    chunk = 2e6
    for rank in range(p):
        state = sum(built.costs.state_bytes(s) for s in built.plan.placement.vstages_of(rank))
        held = min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
        assert result.peak_memory_bytes[rank] - state == held * chunk, rank
    if m * v >= p * v + p - 1:
        # hardware.md §5: the first rank holds p·A·(1 + (p−1)/(p·v)), A = v chunks = one full stage's activations.
        full_stage = v * chunk
        peak = result.peak_memory_bytes[0] - sum(built.costs.state_bytes(s) for s in (0, *range(p, p * v, p)))
        assert peak == pytest.approx(p * full_stage * (1 + (p - 1) / (p * v)), rel=1e-12)


def test_plans_validate_on_real_topologies():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 4), (8, 2, 16)]:
        built = build_plan(PlanInputs("gpt:layers=16,hidden=256,seq=128,vocab=1000", f"{p}xV100", "interleaved", m,
                                      chunks=v, partition="uniform"))
        validate(built.plan)
        assert built.plan.placement.vstage_to_rank == tuple(k % p for k in range(p * v))
        assert built.plan.option("chunks") == v
        assert simulate(built.plan, built.costs, built.topology).trace.makespan > 0


def test_balanced_partition_on_loop_placement():
    # 16 equal layers over 4 ranks × 2 chunks: the only split whose slowest vstage has 2 layers is 2 each.
    built = build_plan(PlanInputs("uniform:layers=16", "4xideal", "interleaved", 8, chunks=2))
    assert built.plan.placement.layer_counts() == (2,) * 8
    counts = build_plan(PlanInputs("uniform:layers=16", "4xideal", "interleaved", 8, chunks=2,
                                   partition="1,3,2,2,2,2,2,2")).plan.placement.layer_counts()
    assert counts == (1, 3, 2, 2, 2, 2, 2, 2)


@pytest.mark.parametrize("inputs, needle", [
    (PlanInputs("uniform:layers=16", "4xideal", "interleaved", 6, chunks=2), "--microbatches 6 with 4 ranks"),
    (PlanInputs("uniform:layers=16", "4xideal", "interleaved", 8), "--chunks >= 2"),
    (PlanInputs("uniform:layers=16", "4xideal", "1f1b", 8, chunks=2), "chunks 2 needs an interleaved"),
    (PlanInputs("uniform:layers=16", "4xideal", "interleaved", 8, chunks=0), "chunks must be >= 1"),
    (PlanInputs("uniform:layers=6", "4xideal", "interleaved", 8, chunks=2), "more stages (8, 2 per device"),
    (PlanInputs("uniform:layers=16", "2xV100+2xA100", "interleaved", 8, chunks=2), "needs identical devices"),
    (PlanInputs("uniform:layers=16", "4xideal", "interleaved", 8, chunks=2, partition="4,4,4,4"), "the plan has 8"),
])
def test_bad_configurations_name_the_values(inputs, needle):
    with pytest.raises(SpecError) as info:
        build_plan(inputs)
    assert needle in str(info.value)


def test_heterogeneous_devices_take_uniform_or_explicit_partitions():
    built = build_plan(PlanInputs("uniform:layers=16", "2xV100+2xA100", "interleaved", 8, chunks=2,
                                  partition="uniform"))
    validate(built.plan)
    assert built.plan.placement.vstage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
