"""The CSP pipeline simulation (sim.csp.simulate) against closed forms, hand timelines and an independent event loop."""

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.csp.rules import csp_pick, sequential_versions, subnet_table, wait_list
from sim.csp.simulate import CspProblem, simulate_csp


def disjoint(n, p):
    return [[{("own", b, s)} for s in range(p)] for b in range(n)]


def identical(n, p):
    return [[{("shared", s)} for s in range(p)] for _ in range(n)]


def grid(result, p, slots, slot_s=1.0):
    """Per stage, the F/B ops by start slot, as in tests/sim/engine/test_simpy_engine.py."""
    rows = []
    for s in range(p):
        row = ["."] * slots
        for span in result.trace.on_rank(s, "compute"):
            if span.kind in ("F", "B"):
                row[round(span.start / slot_s)] = f"{span.kind}{span.mb}"
        rows.append(" ".join(f"{cell:2}" for cell in row).strip())
    return rows


def compute_spans(result):
    return {(s.kind, s.vstage, s.mb): (s.start, s.end) for s in result.trace.spans if s.stream == "compute"}


# --- (i) disjoint subnets: full pipeline overlap ---------------------------------------------------------------

def test_disjoint_timeline_p3_n4():
    # No conflicts, t_f = t_b = 1 s, unbounded lookahead: forwards are pushed eagerly, backward first when both are
    # ready (stage 2 at t=3 runs B0 before F1). Same makespan as 1F1B, (N + p - 1)(t_f + t_b) = 12 s.
    result = simulate_csp(CspProblem.uniform(3, disjoint(4, 3), 1.0, 1.0))
    assert grid(result, 3, 12) == [
        "F0 F1 F2 F3 .  B0 .  B1 .  B2 .  B3",
        ".  F0 F1 F2 B0 F3 B1 .  B2 .  B3 .",
        ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .",
    ]
    assert result.makespan == 12.0


@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (1.0, 3.0), (3.0, 1.0), (0.5, 1.25)])
def test_disjoint_subnets_reach_the_pipelined_makespan(t_f, t_b):
    # Any schedule needs (N + p - 1)(t_f + t_b): the last stage cannot start before (p - 1) t_f, does N (t_f + t_b)
    # of work, and its last backward still has p - 1 stages to go back through. With disjoint subnets csp_pick
    # always takes the first arrival, and without a window limit (lookahead >= N) the eager forwards keep the last
    # stage busy from (p - 1) t_f on, so the bound is met exactly.
    for p in range(1, 7):
        for n in range(1, 11):
            problem = CspProblem.uniform(p, disjoint(n, p), t_f, t_b, lookahead=n)
            result = simulate_csp(problem)
            assert result.makespan == pytest.approx((n + p - 1) * (t_f + t_b), rel=1e-12), (p, n)
            assert all(stall.blocked_s == 0 and stall.blocked_decisions == 0 for stall in result.stalls), (p, n)
            assert all(d.picked == d.arrived[0] for d in result.decisions)
            assert compute_spans(simulate_csp(CspProblem.uniform(p, identical(n, p), t_f, t_b, lookahead=n),
                                              sharing="none")) == compute_spans(result)


def test_window_of_p_is_not_always_enough():
    # Unlike 1F1B (at most p - s microbatches in flight on stage s), CSP bounds only the subnets in flight: with a
    # window of p, stage 0 starts F3 at t=10 when subnet 0 finishes, which delays B1 (arrived at 11) to 12 and
    # leaves stage 2 idle from 13 to 14. A window of N meets (N + p - 1)(t_f + t_b) = 18 s.
    assert simulate_csp(CspProblem.uniform(3, disjoint(4, 3), 2.0, 1.0, lookahead=3)).makespan == 19.0
    assert simulate_csp(CspProblem.uniform(3, disjoint(4, 3), 2.0, 1.0, lookahead=4)).makespan == 18.0


# --- (ii) identical subnets: one at a time ----------------------------------------------------------------------

@pytest.mark.parametrize("p, n", [(1, 3), (2, 5), (4, 4), (5, 2)])
@pytest.mark.parametrize("t_u, t_c", [(0.0, 0.0), (0.5, 0.0), (0.25, 0.125)])
def test_identical_subnets_degrade_to_one_at_a_time(p, n, t_u, t_c):
    # Subnet b + 1 may not start F on stage 0 before subnet b's update there, the last op of b's round trip:
    # p t_f + (p-1) t_c forward, p t_b + (p-1) t_c back, t_u for stage 0's update (the other stages' updates overlap
    # the backward below them). Each subnet costs that in turn.
    t_f, t_b = 1.0, 2.0
    cycle = p * (t_f + t_b) + t_u + 2 * (p - 1) * t_c
    problem = CspProblem.uniform(p, identical(n, p), t_f, t_b, t_u, t_c, lookahead=4)
    csp = simulate_csp(problem)
    assert csp.makespan == pytest.approx(n * cycle, rel=1e-12)
    alone = simulate_csp(problem, one_at_a_time=True)
    assert alone.makespan == pytest.approx(n * cycle, rel=1e-12)
    assert compute_spans(alone) == compute_spans(csp)
    assert compute_spans(simulate_csp(CspProblem.uniform(p, disjoint(n, p), t_f, t_b, t_u, t_c, lookahead=4),
                                      sharing="all")) == compute_spans(csp)
    # (v) Stage 0 waits for each subnet's round trip: blocked from the end of F(0, b) to the arrival of B(0, b)
    # (with one stage B(0, b) is ready at once and goes first: no blocked decision).
    assert csp.stalls[0].blocked_decisions == (n - 1 if p > 1 else 0)
    assert csp.stalls[0].blocked_s == pytest.approx((n - 1) * (p - 1) * (t_f + t_b + 2 * t_c), rel=1e-12)
    assert all(stall.blocked_s == 0 for stall in csp.stalls[1:] + alone.stalls)


@st.composite
def problems(draw, integer_times=True):
    """Random CSP problems: few layer keys so conflicts are frequent; integer times so ties happen."""
    p = draw(st.integers(1, 4))
    n = draw(st.integers(1, 7))
    pool = draw(st.integers(1, 3))
    uses = [[draw(st.frozensets(st.integers(0, pool - 1), max_size=2)) for _ in range(p)] for _ in range(n)]
    positive = st.integers(1, 4).map(float)
    table = lambda values: [[draw(values) for _ in range(p)] for _ in range(n)]  # noqa: E731
    fwd, bwd, upd = table(positive), table(positive), table(st.integers(0, 2).map(float))
    transfer = draw(st.one_of(st.integers(0, 2).map(float),
                              st.just(lambda src, dst, b, kind: float((src + 2 * b + (kind == "B")) % 3))))
    return CspProblem(p, uses, fwd, bwd, upd, transfer, draw(st.integers(1, 8)))


@settings(max_examples=60, deadline=None)
@given(problems())
def test_one_at_a_time_makespan_is_the_sum_of_round_trips(problem):
    # Without overlap each subnet runs alone: F down the stages, B back, and it is done when the last of its
    # updates is (stage s's update starts when B(s) ends).
    p, total = problem.num_stages, 0.0
    for b in range(problem.num_subnets):
        t = 0.0
        for s in range(p):
            t += problem.fwd_s[b][s] + (problem.transfer_time(s, s + 1, b, "F") if s + 1 < p else 0.0)
        done = 0.0
        for s in reversed(range(p)):
            t += problem.bwd_s[b][s]
            done = max(done, t + problem.update_s[b][s])
            t += problem.transfer_time(s, s - 1, b, "B") if s > 0 else 0.0
        total += done
    assert simulate_csp(problem, one_at_a_time=True).makespan == pytest.approx(total, rel=1e-12)


# --- a hand example with a conflict on each stage -------------------------------------------------------------

def test_overtaking_subnet_waits_for_an_earlier_one_not_yet_arrived():
    # Stage 0: 0 and 1 share A, 2 uses B. Stage 1: 1 and 2 share C. t_f = t_b = 1 s, free transfers, no update cost.
    # Stage 0 runs F2 before F1 (1 waits for 0's update). F2 reaches stage 1 at t=2, but 1 has not arrived there and
    # shares C: stage 1 is blocked from t=3 (after B0) until F1 arrives at t=5.
    uses = [[{"A"}, {"X"}], [{"A"}, {"C"}], [{"B"}, {"C"}]]
    result = simulate_csp(CspProblem.uniform(2, uses, 1.0, 1.0))
    assert grid(result, 2, 10) == [
        "F0 F2 .  B0 F1 .  .  B1 .  B2",
        ".  F0 B0 .  .  F1 B1 F2 B2 .",
    ]
    assert [(d.time, d.stage, d.picked, d.arrived, d.edges) for d in result.decisions] == [
        (0.0, 0, 0, (0, 1, 2), ()),
        (1.0, 0, 2, (1, 2), ()),
        (1.0, 1, 0, (0,), ()),
        (2.0, 0, None, (1,), ((0, 1),)),
        (3.0, 1, None, (2,), ((1, 2),)),
        (4.0, 0, 1, (1,), ((0, 1),)),
        (5.0, 1, 1, (2, 1), ()),
        (7.0, 1, 2, (2,), ((1, 2),)),
    ]
    assert [(s.blocked_s, s.blocked_decisions) for s in result.stalls] == [(1.0, 1), (2.0, 1)]
    ops = {s.op for s in result.trace.spans}
    assert {"0F2", "1OPT_STEP2", "0SEND_F2", "1RECV_F2", "1SEND_B2", "0RECV_B2"} <= ops
    send = next(s for s in result.trace.spans if s.op == "0SEND_F2")
    recv = next(s for s in result.trace.spans if s.op == "1RECV_F2")
    assert (send.peer, recv.peer, send.pair, send.stream, recv.stream) == (1, 0, recv.pair, "send", "recv")


# --- (iii), (iv): every run obeys the rule and is deterministic ------------------------------------------------

def reference_run(problem, window):
    """An independent event loop (no SimPy) of the same semantics, for positive F and B times: compute spans."""
    p, n, uses = problem.num_stages, problem.num_subnets, problem.uses
    heap, order = [], itertools.count()
    arrived, upper, finished = [[] for _ in range(p)], [0] * p, [set() for _ in range(p)]
    grads, busy, left, spans = [[] for _ in range(p)], [False] * p, [p] * n, {}
    state = {"next": 0, "in_flight": 0}

    def at(t, *event):
        heapq.heappush(heap, (t, next(order), event))

    def inject():
        while state["next"] < n and state["in_flight"] < window:
            arrived[0].append(state["next"])
            upper[0] = state["next"] = state["next"] + 1
            state["in_flight"] += 1

    inject()
    now = 0.0
    while True:
        for s in range(p):  # every stage decides after all events of the instant
            if busy[s]:
                continue
            if grads[s]:
                b = grads[s].pop(0)
                busy[s] = True
                at(now + problem.bwd_s[b][s], "B", s, b, now)
            elif arrived[s]:
                b = csp_pick(s, arrived[s], wait_list(upper[s], finished[s]), uses)
                if b is not None:
                    arrived[s].remove(b)
                    busy[s] = True
                    at(now + problem.fwd_s[b][s], "F", s, b, now)
        if not heap:
            return spans
        now = heap[0][0]
        while heap and heap[0][0] == now:
            kind, s, b, *start = heapq.heappop(heap)[2]
            if kind in ("F", "B", "OPT_STEP"):
                spans[(kind, s, b)] = (start[0], now)
            if kind == "F":
                busy[s] = False
                if s == p - 1:
                    grads[s].append(b)
                else:
                    at(now + problem.transfer_time(s, s + 1, b, "F"), "arrive_F", s + 1, b)
            elif kind == "B":
                if s > 0:
                    at(now + problem.transfer_time(s, s - 1, b, "B"), "arrive_B", s - 1, b)
                at(now + problem.update_s[b][s], "OPT_STEP", s, b, now)
            elif kind == "OPT_STEP":
                busy[s] = False
                finished[s].add(b)
                left[b] -= 1
                if left[b] == 0:
                    state["in_flight"] -= 1
                    inject()
            elif kind == "arrive_F":
                arrived[s].append(b)
                upper[s] = max(upper[s], b + 1)
            else:
                grads[s].append(b)


@settings(max_examples=150, deadline=None)
@given(problems(), st.booleans())
def test_every_run_obeys_csp_and_trains_as_sequentially(problem, one_at_a_time):
    result = simulate_csp(problem, one_at_a_time=one_at_a_time)
    uses, p, n = problem.uses, problem.num_stages, problem.num_subnets
    spans = compute_spans(result)
    # (iv) deterministic, and the same times as an independent implementation of the semantics.
    again = simulate_csp(problem, one_at_a_time=one_at_a_time)
    assert again.trace.spans == result.trace.spans and again.decisions == result.decisions
    assert again.stalls == result.stalls
    assert spans == reference_run(problem, 1 if one_at_a_time else problem.lookahead)
    # Every op ran once; nothing deadlocked.
    assert len(spans) == 3 * n * p
    # (iii) every decision is csp_pick's on the recorded state, and the state matches the trace.
    for d in result.decisions:
        assert csp_pick(d.stage, d.arrived, d.unfinished, uses) == d.picked
        assert all(spans[("OPT_STEP", d.stage, w)][1] > d.time for w in d.unfinished)
        seen = max(d.arrived) + 1
        if d.stage > 0:
            recvd = {s.mb for s in result.trace.on_rank(d.stage, "recv") if s.kind == "RECV_F" and s.end <= d.time}
            assert set(d.arrived) == {b for b in recvd if spans[("F", d.stage, b)][0] >= d.time}
            seen = max(recvd) + 1
        assert {w for w in range(seen) if spans[("OPT_STEP", d.stage, w)][1] > d.time} <= set(d.unfinished)
    picked = {(d.stage, d.picked): d.time for d in result.decisions if d.picked is not None}
    assert picked == {(s, b): spans[("F", s, b)][0] for s in range(p) for b in range(n)}
    # Backward first: no forward starts while a gradient is waiting on its stage.
    grad_ready = {(s, b): (spans[("F", s, b)][1] if s == p - 1 else
                           next(x.end for x in result.trace.spans if x.op == f"{s}RECV_B{b}"))
                  for s in range(p) for b in range(n)}
    for (s, b), (start, _) in ((key[1:], span) for key, span in spans.items() if key[0] == "F"):
        assert not any(grad_ready[(s, w)] <= start < spans[("B", s, w)][0] for w in range(n)), (s, b)
    # The weights each forward and backward see, read off the trace: the updates of the subnets that use the layer
    # and finished it before the op started. They equal one-at-a-time training's (NASPipe's reproducibility).
    for kind in ("F", "B"):
        seen = {(b, s, key): tuple(w for w in range(n) if key in uses[w][s] and
                                   spans[("OPT_STEP", s, w)][1] <= spans[(kind, s, b)][0])
                for b in range(n) for s in range(p) for key in uses[b][s]}
        assert seen == sequential_versions(uses)
    # Lower bounds: the busiest stage's work, and the longest round trip.
    work = max(sum(problem.fwd_s[b][s] + problem.bwd_s[b][s] + problem.update_s[b][s] for b in range(n))
               for s in range(p))
    trip = max(sum(problem.fwd_s[b]) + sum(problem.bwd_s[b]) for b in range(n))
    assert result.makespan >= max(work, trip) - 1e-9
    # (v) stall accounting: a stage is only blocked when it idles.
    for stall in result.stalls:
        busy = sum(end - start for (_, s, _), (start, end) in spans.items() if s == stall.stage)
        assert 0 <= stall.blocked_s <= result.makespan - busy + 1e-9


def test_conflicts_cause_stalls_and_disjoint_subnets_none():
    uses = subnet_table([[{"a"}, {"x", "y"}], [{"b"}, {"y"}], [{"a"}, {"z"}], [{"c"}, {"x"}]])
    problem = CspProblem.uniform(2, uses, 1.0, 2.0, 0.5)
    table = simulate_csp(problem)
    assert sum(s.blocked_decisions for s in table.stalls) > 0 and sum(s.blocked_s for s in table.stalls) > 0
    none = simulate_csp(problem, sharing="none")
    assert all(s.blocked_s == 0 and s.blocked_decisions == 0 for s in none.stalls)
    assert none.makespan <= table.makespan <= simulate_csp(problem, sharing="all").makespan


def test_bad_problems_are_rejected():
    uses = disjoint(2, 2)
    with pytest.raises(ValueError, match="fwd_s must be 2 subnets x 2 stages"):
        CspProblem(2, uses, [[1.0, 1.0]], [[1.0] * 2] * 2, [[0.0] * 2] * 2)
    with pytest.raises(ValueError, match="bwd_s must hold finite times >= 0 s"):
        CspProblem(2, uses, [[1.0] * 2] * 2, [[1.0, -1.0]] * 2, [[0.0] * 2] * 2)
    with pytest.raises(ValueError, match="lookahead must be >= 1, got 0"):
        CspProblem.uniform(2, uses, 1.0, 1.0, lookahead=0)
    with pytest.raises(ValueError, match="subnet 1 has 1 stages, expected 2"):
        CspProblem.uniform(2, [[{"a"}, {"b"}], [{"a"}]], 1.0, 1.0)
    with pytest.raises(ValueError, match="sharing must be one of"):
        simulate_csp(CspProblem.uniform(2, uses, 1.0, 1.0), sharing="some")
    with pytest.raises(ValueError, match=r"transfer_s\(0, 1, 0, 'F'\) = -1"):
        simulate_csp(CspProblem.uniform(2, uses, 1.0, 1.0, transfer_s=lambda *args: -1))
