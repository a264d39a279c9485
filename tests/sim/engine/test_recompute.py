"""Activation recomputation (``--recompute``): the L0 pass, its cost in time and its saving in memory.

Units: ``uniform:fwd_ms=1,bwd_ms=2,act_mb=1`` with one layer per vstage: t_f = 1 ms, t_b = 2 ms, R = t_f. A stage keeps
per microbatch its input C = 1 MB (the checkpoint) and its output, A = 2 MB in all. ``Nxideal`` links are free.

Makespan oracle for GPipe and 1F1B with recomputation. The rebuild runs layer by layer inside the backward (Megatron's
uniform recomputation), so an R waits for the output gradient like its backward and the two act as one backward of
t_f + t_b. The plain schedules' (m + p − 1)(t_f + t_b) (GPipe §2.3) with that backward is
(m + p − 1)(2t_f + t_b): recomputation costs m + p − 1 forwards, not m, because it sits on the backward chain of every
stage (torchgpipe schedules "the recomputation at backpropagation": reference/schedules.md, Checkpointing).
"""

import pytest

from sim.engine.simpy_engine import simulate
from sim.ir.plan import OpKind, Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.lower import add_recompute
from sim.plan.validate import validate_l0
from sim.schedules import SCHEDULES

T_F, T_B = 1e-3, 2e-3
C, A = 1e6, 2e6  # checkpoint and full activations of one microbatch on a one-layer uniform stage, bytes
P = 10e6  # uniform:param_mb=10 -> one stage's weights, bytes (one layer per stage)
CASES = [("gpipe", 1), ("1f1b", 1), ("zb1p", 1), ("interleaved", 2)]


def _inputs(schedule, p, m, chunks=1, recompute=True):
    return PlanInputs(f"uniform:layers={p * chunks},fwd_ms=1,bwd_ms=2,act_mb=1", f"{p}xideal", schedule, m,
                      partition="uniform", chunks=chunks, recompute=recompute)


def _simulate(inputs):
    built = build_plan(inputs)
    return built, simulate(built.plan, built.costs, built.topology)


def _activation_peaks(built, result):
    """Peak memory per rank minus the rank's training state: the activations at their peak, bytes."""
    return [peak - sum(built.costs.state_bytes(v) for v in built.plan.placement.vstages_of(rank))
            for rank, peak in enumerate(result.peak_memory_bytes)]


@pytest.mark.parametrize("schedule, chunks", CASES)
def test_one_r_right_before_each_backward(schedule, chunks):
    p, m = 3, 6
    plain = build_plan(_inputs(schedule, p, m, chunks, recompute=False)).plan
    l0 = Plan(plain.schedule, "L0", plain.model, plain.topology, m, 1, "flush", plain.placement,
              SCHEDULES[schedule].build(p, m, chunks))
    with_r = add_recompute(l0)
    validate_l0(with_r)
    assert with_r.option("recompute") is True
    for before, after in zip(l0.programs, with_r.programs):
        # Dropping the R ops gives the original program back; each R sits right before its backward.
        assert tuple(op for op in after if op.kind is not OpKind.R) == before
        for pos, op in enumerate(after):
            if op.kind is OpKind.R:
                nxt = after[pos + 1]
                assert nxt.kind in (OpKind.B, OpKind.I) and (nxt.vstage, nxt.mb) == (op.vstage, op.mb)
    rs = sorted((op.vstage, op.mb) for program in with_r.programs for op in program if op.kind is OpKind.R)
    assert rs == [(v, mb) for v in range(p * chunks) for mb in range(m)]
    assert add_recompute(with_r).programs == with_r.programs  # already recomputed pairs are left alone


def test_pass_takes_l0_only():
    built = build_plan(_inputs("1f1b", 2, 2))
    with pytest.raises(ValueError, match="L0"):
        add_recompute(built.plan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_makespan_is_the_plain_formula_with_a_backward_of_forward_plus_backward(schedule):
    for p in range(1, 7):
        for m in range(1, 13):
            _, result = _simulate(_inputs(schedule, p, m))
            assert result.trace.makespan == pytest.approx((m + p - 1) * (2 * T_F + T_B), rel=1e-12), (p, m)


def test_zb1p_makespan_with_recompute_reaches_the_first_rank_bound():
    # Rank 0 has F + R + I + W = 4 units per microbatch. Its first R waits for microbatch 0's gradient: the forward
    # crosses p ranks (p units), the last rank's R + I (2) and ranks p − 2 … 1 each R + I (2 each) bring it back at
    # 3p − 2; ZB-H1 lets rank 0 run only p forwards before (at most p microbatches in flight on rank 0), so it is idle
    # 2(p − 1) units, and the iteration takes at least 4m + 2(p − 1). The engine reaches the bound.
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            _, result = _simulate(_inputs("zb1p", p, m))
            assert result.trace.makespan == pytest.approx((4 * m + 2 * (p - 1)) * 1e-3, rel=1e-12), (p, m)


def test_r_costs_one_forward_on_the_compute_stream():
    _, result = _simulate(_inputs("1f1b", 3, 4))
    spans = [s for s in result.trace.spans if s.kind == "R"]
    assert len(spans) == 3 * 4
    assert all(s.stream == "compute" and s.duration == pytest.approx(T_F, rel=1e-12) for s in spans)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (6, 6), (1, 3)])
def test_peak_memory_gpipe_and_1f1b(p, m):
    # Without recomputation a rank holds k in-flight microbatches of A (GPipe k = m; 1F1B k = min(p − r, m),
    # Megatron §2.2.1). With it, k checkpoints, and right before one backward that microbatch's full A again:
    # (k − 1)·C + A (GPipe §2.3: "m stage inputs + one stage's intermediates").
    for schedule, held in (("gpipe", lambda r: m), ("1f1b", lambda r: min(p - r, m))):
        built, plain = _simulate(_inputs(schedule, p, m, recompute=False))
        assert _activation_peaks(built, plain) == [held(r) * A for r in range(p)]
        built, recomputed = _simulate(_inputs(schedule, p, m))
        assert _activation_peaks(built, recomputed) == [(held(r) - 1) * C + A for r in range(p)]


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (2, 3, 4), (3, 2, 3)])
def test_peak_memory_interleaved(p, v, m):
    # Rank r holds h = min(2(p−r−1) + (v−1)p + 1, mv) chunks (Megatron's warm-up + 1); with recomputation h − 1
    # chunk checkpoints and one chunk's full activations.
    built, result = _simulate(_inputs("interleaved", p, m, v))
    held = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
    assert _activation_peaks(built, result) == [(h - 1) * C + A for h in held]


@pytest.mark.parametrize("schedule, chunks", CASES)
@pytest.mark.parametrize("recompute", [False, True])
def test_same_inputs_give_byte_identical_plans_and_traces(schedule, chunks, recompute):
    inputs = PlanInputs("gpt:layers=8,hidden=256,seq=128,vocab=1000", "4xV100", schedule, 8, chunks=chunks,
                        recompute=recompute)
    (a, ra), (b, rb) = _simulate(inputs), _simulate(inputs)
    assert a.plan.dumps() == b.plan.dumps()
    assert ra.trace.spans == rb.trace.spans and ra.peak_memory_bytes == rb.peak_memory_bytes
    loaded = Plan.loads(a.plan.dumps())
    assert loaded == a.plan and loaded.option("recompute", False) is recompute
    assert ('"recompute": true' in a.plan.dumps()) is recompute


def _stash_inputs(p, m, recompute):
    return PlanInputs(f"uniform:layers={p},fwd_ms=1,bwd_ms=2,act_mb=1,param_mb=10", f"{p}xideal", "pipedream", m,
                      partition="uniform", recompute=recompute)


@pytest.mark.parametrize("p, m", [(2, 3), (3, 5), (4, 7), (4, 12), (5, 9)])
def test_peak_memory_pipedream_with_recompute(p, m):
    """Async PipeDream: stashed weight versions plus the 1F1B activations, each at its own peak at one instant.

    Rank r runs w = p − r − 1 warm-up forwards, then F(k + w), R(k), B(k), OPT_STEP(k) (``test_pipedream``), and
    microbatch k uses the version made by max(0, k − w) updates. Two bounds hold at every instant:

    * versions: at most p − r copies of the stage's weights P (PipeDream's ``warmup + 1``; the step retires the version
      of its microbatch before it copies the new one, DESIGN §4 "p + stashed weight versions");
    * activations: at most p − r microbatches in flight (1F1B, hardware.md §5), of which only the one between its R
      and its B is whole (A); the others keep their checkpoint C: (p − r − 1)·C + A, as for 1F1B in
      ``test_peak_memory_gpipe_and_1f1b``.

    Both are reached together during R(w): microbatches w … 2w are in flight (needs 2w ≤ m − 1) and versions 0 … w
    are alive (version 0 until the step of microbatch w, version u ≥ 1 until the step of microbatch u + w ≤ m − 1).
    So for m ≥ 2p − 1 the peak above the training state is (p − r)·P + (p − r − 1)·C + A on rank r, and without
    recomputation (p − r)·(P + A).
    """
    assert m >= 2 * p - 1
    for recompute, activations in ((False, lambda r: (p - r) * A), (True, lambda r: (p - r - 1) * C + A)):
        built, result = _simulate(_stash_inputs(p, m, recompute))
        assert built.plan.weight_policy == "stash"
        assert _activation_peaks(built, result) == [(p - r) * P + activations(r) for r in range(p)], recompute


def _zb1p_peak(p, m, r, recompute):
    """Closed-form peak activations of rank r under ZB-H1 (see the test below), bytes."""
    w = p - r - 1
    # During I(k): microbatches max(0, k − r) … min(k + w, m − 1) are in flight; those up to k are whole (R rebuilt
    # them and their W has not run), the later ones hold only a checkpoint.
    whole = [min(k, r) + 1 for k in range(m)]
    checkpoints = [min(w, m - 1 - k) for k in range(m)]
    if not recompute:
        return max((h + c) * A for h, c in zip(whole, checkpoints))
    return max(h * A + c * C for h, c in zip(whole, checkpoints))


@pytest.mark.parametrize("p, m", [(4, 8), (3, 6), (4, 3), (2, 5), (5, 5)])
def test_peak_memory_zb1p_with_recompute(p, m):
    """ZB-H1 + recompute: only microbatches waiting for their R are small; from R to W a microbatch is whole.

    Rank r (``sim.schedules.zero_bubble``) runs w = p − r − 1 warm-up forwards, then for k = 0 … m − 1: F(k + w) while
    any is left, R(k), I(k), and from k = r on the W of the oldest microbatch, so the W of microbatch k − r runs right
    after I(k). A microbatch's activations live from F to W (the engine's convention, DESIGN §4): W needs each
    layer's input and output gradient, so what R rebuilt for I stays until W. The peak is during some I(k):
    microbatches max(0, k − r) … k are whole, min(k, r) + 1 of them, and k + 1 … min(k + w, m − 1) hold a
    checkpoint, min(w, m − 1 − k) of them (right after an F there is one whole fewer and one checkpoint more, which
    is less since C < A). Peak = max_k (min(k, r) + 1)·A + min(w, m − 1 − k)·C; for m ≥ p it is at k = r:
    (r + 1)·A + (p − r − 1)·C. Without recomputation every one is whole: min(p, m)·A for m ≥ p (the same as 1F1B's
    first stage, hardware.md §5).

    So recomputation saves (p − r − 1)(A − C) on rank r: nothing on the last rank. That is right for ZB-H1, not an
    artefact: the last rank runs F(k), R(k), I(k) back to back, so no microbatch ever waits there with only its
    checkpoint, and the microbatches whose W is deferred must keep what W reads (recomputing again before W would
    cost another forward and is not what ``--recompute`` does).
    """
    built, plain = _simulate(_inputs("zb1p", p, m, recompute=False))
    _, recomputed = _simulate(_inputs("zb1p", p, m))
    plain_peaks, recomputed_peaks = _activation_peaks(built, plain), _activation_peaks(built, recomputed)
    assert plain_peaks == [_zb1p_peak(p, m, r, False) for r in range(p)]
    assert recomputed_peaks == [_zb1p_peak(p, m, r, True) for r in range(p)]
    if m >= p:
        assert plain_peaks == [p * A] * p
        assert recomputed_peaks == [(r + 1) * A + (p - r - 1) * C for r in range(p)]
    assert recomputed_peaks[-1] == plain_peaks[-1]  # the last rank saves nothing
