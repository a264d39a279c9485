"""NASPipe's CSP rule (sim.csp.rules): hand-written cases, and the reproducibility properties over random pipelines."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.csp.rules import (
    causal_deps,
    conflicts,
    csp_pick,
    predict_next,
    sequential_versions,
    subnet_table,
    wait_list,
)

# Stage 0: subnets 0 and 1 pick choice A of the block, 2 picks B. Stage 1: 1 and 2 share choice C.
OVERTAKE = subnet_table([[{"A"}, {"X"}], [{"A"}, {"C"}], [{"B"}, {"C"}]])


def test_first_runnable_in_arrival_order():
    assert csp_pick(0, [0, 1, 2], {0, 1, 2}, OVERTAKE) == 0
    # 0's forward has started, it is still unfinished: 1 shares A with it, 2 does not, so 2 overtakes 1.
    assert csp_pick(0, [1, 2], {0, 1, 2}, OVERTAKE) == 2
    assert conflicts(0, 1, {0, 1, 2}, OVERTAKE) == (0,)
    assert csp_pick(0, [1], {0, 1, 2}, OVERTAKE) is None
    assert csp_pick(0, [1], wait_list(3, finished={0}), OVERTAKE) == 1
    assert csp_pick(0, [], {0}, OVERTAKE) is None


def test_arrival_order_not_id_order_decides_among_runnable():
    table = subnet_table([[{"a"}], [{"b"}], [{"c"}]])
    assert csp_pick(0, [2, 1], {0, 1, 2}, table) == 2


def test_earlier_subnet_that_has_not_arrived_still_blocks():
    # 2 overtook 1 on stage 0 and reaches stage 1 first. NASPipe's wait_list holds every id below the highest seen,
    # so 1 (not arrived) blocks 2 on C. A list of only the subnets that entered stage 1 would let 2 read C before 1
    # updates it: the order the sequential run has would be broken.
    unfinished = wait_list(3, finished={0})
    assert unfinished == {1, 2}
    assert csp_pick(1, [2], unfinished, OVERTAKE) is None
    assert conflicts(1, 2, unfinished, OVERTAKE) == (1,)
    assert csp_pick(1, [2], {2}, OVERTAKE) == 2  # the unsafe variant


def test_later_subnet_never_blocks_an_earlier_one():
    table = subnet_table([[{"a"}], [{"a"}], [{"a"}]])
    assert csp_pick(0, [1, 2], {1, 2}, table) == 1
    assert conflicts(0, 1, {1, 2}, table) == ()
    assert conflicts(0, 2, {1, 2}, table) == (1,)


def test_keys_are_scoped_to_their_stage():
    table = subnet_table([[{"k"}, {"x"}], [{"y"}, {"k"}]])
    assert csp_pick(1, [1], {0, 1}, table) == 1
    assert csp_pick(0, [1], {0, 1}, table) == 1


def test_predict_next():
    table = subnet_table([[{"a"}], [{"a"}], [{"b"}]])
    # Backward of 0 running: once it (and its update) finishes, 1 may go.
    assert predict_next(0, [1], {0, 1}, 0, table) == 1
    assert csp_pick(0, [1], {0, 1}, table) is None
    # NASPipe's "#predict next forward": 0's forward was just picked, 0 stays unfinished, so 2 is next, not 1.
    assert predict_next(0, [0, 1, 2], {0, 1, 2}, 0, table, finishes=False) == 2
    assert predict_next(0, [1], {1}, None, table) == 1
    # A subnet whose gradient is already waiting finishes before the next forward decision: 1 is next after all.
    assert predict_next(0, [0, 1, 2], {0, 1, 2}, 0, table, finishes=False, finishing=[0]) == 1


def test_causal_deps_are_the_latest_earlier_user_per_key():
    table = subnet_table([[{"a", "b"}], [{"a"}], [{"b"}], [{"a", "b"}], [{"c"}]])
    assert causal_deps(0, 0, table) == ()
    assert causal_deps(0, 1, table) == (0,)
    assert causal_deps(0, 3, table) == (1, 2)
    assert causal_deps(0, 4, table) == ()


def test_sequential_versions_small_table():
    table = subnet_table([[{"a"}, {"x"}], [{"a", "b"}, {"x"}], [{"b"}, set()]])
    assert sequential_versions(table) == {
        (0, 0, "a"): (), (0, 1, "x"): (),
        (1, 0, "a"): (0,), (1, 0, "b"): (), (1, 1, "x"): (0,),
        (2, 0, "b"): (1,),
    }


def test_bad_input():
    with pytest.raises(ValueError, match=r"arrived subnet 1 is not in unfinished \[0\]"):
        csp_pick(0, [1], {0}, OVERTAKE)
    with pytest.raises(ValueError, match="subnet 1 has 1 stages, expected 2"):
        subnet_table([[{"a"}, {"b"}], [{"a"}]])
    with pytest.raises(ValueError, match="at least one subnet"):
        subnet_table([])


# --- an abstract pipeline: any interleaving of atomic steps, each stage obeying csp_pick -------------------------

@st.composite
def tables(draw):
    """Random subnet tables with 1-3 keys per stage, so conflicts are frequent; a subnet may use no key on a stage."""
    stages = draw(st.integers(1, 4))
    subnets = draw(st.integers(1, 8))
    pool = draw(st.integers(1, 3))
    keys = st.frozensets(st.integers(0, pool - 1), max_size=2)
    return subnet_table([[draw(keys) for _ in range(stages)] for _ in range(subnets)])


def run_abstract(uses, rng, lookahead):
    """Run the subnets through an asynchronous pipeline whose every step is chosen by ``rng``.

    Steps: a subnet enters stage 0 (while fewer than ``lookahead`` are in flight); a stage runs the forward csp_pick
    picks (reading the version logs of its layers); an activation or gradient in transit is delivered (in any order,
    so arrivals reorder); a backward whose gradient is there runs (reading the logs again); a finished backward's
    weight update runs (appending to the logs). Returns the logs, what every F and B read, and the steps taken.
    """
    n, p = len(uses), len(uses[0])
    arrived, upper, finished = [[] for _ in range(p)], [0] * p, [set() for _ in range(p)]
    grads, updates, transit = [[] for _ in range(p)], [[] for _ in range(p)], []
    logs, fwd_seen, bwd_seen = {}, {}, {}
    left, entered, in_flight, steps = [p] * n, 0, 0, 0

    def read(s, b):
        return {(b, s, key): tuple(logs.get((s, key), ())) for key in uses[b][s]}

    while True:
        actions = [("enter",)] if entered < n and in_flight < lookahead else []
        for s in range(p):
            pick = csp_pick(s, arrived[s], wait_list(upper[s], finished[s]), uses) if arrived[s] else None
            if pick is not None:
                actions.append(("F", s, pick))
            actions += [("B", s, b) for b in grads[s]] + [("U", s, b) for b in updates[s]]
        actions += [("deliver", i) for i in range(len(transit))]
        if not actions:
            break
        act = actions[rng.randrange(len(actions))]
        steps += 1
        if act[0] == "enter":
            arrived[0].append(entered)
            upper[0], entered, in_flight = entered + 1, entered + 1, in_flight + 1
        elif act[0] == "F":
            _, s, b = act
            arrived[s].remove(b)
            fwd_seen.update(read(s, b))
            transit.append(("F", s + 1, b) if s + 1 < p else ("G", s, b))
        elif act[0] == "deliver":
            kind, s, b = transit.pop(act[1])
            if kind == "F":
                arrived[s].append(b)
                upper[s] = max(upper[s], b + 1)
            else:
                grads[s].append(b)
        elif act[0] == "B":
            _, s, b = act
            grads[s].remove(b)
            bwd_seen.update(read(s, b))
            updates[s].append(b)
            if s > 0:
                transit.append(("G", s - 1, b))
        else:
            _, s, b = act
            updates[s].remove(b)
            for key in uses[b][s]:
                logs.setdefault((s, key), []).append(b)
            finished[s].add(b)
            left[b] -= 1
            in_flight -= left[b] == 0
    assert all(count == 0 for count in left), f"deadlock: subnets {[b for b in range(n) if left[b]]} unfinished"
    return logs, fwd_seen, bwd_seen, steps


@settings(max_examples=300, deadline=None)
@given(tables(), st.randoms(use_true_random=False), st.integers(1, 9))
def test_any_csp_pipeline_reproduces_sequential_training(uses, rng, lookahead):
    n, p = len(uses), len(uses[0])
    logs, fwd_seen, bwd_seen, steps = run_abstract(uses, rng, lookahead)
    # (d) no deadlock: every subnet went through every step (enter, p F, p B, p updates, 2p - 1 transfers).
    assert steps == n * (1 + 3 * p + 2 * p - 1)
    # (a) every layer's updates happen in subnet order, once per subnet that uses it.
    for (s, key), log in logs.items():
        assert log == [b for b in range(n) if key in uses[b][s]], (s, key)
    # (b) every forward, and its backward, sees exactly the updates of the earlier subnets that use the layer.
    expected = sequential_versions(uses)
    assert fwd_seen == expected
    assert bwd_seen == expected
    # (c) hence the same versions as one-at-a-time training, however the pipeline interleaves.
    assert run_abstract(uses, rng, 1)[1] == fwd_seen


@settings(max_examples=200, deadline=None)
@given(tables(), st.randoms(use_true_random=False))
def test_pick_is_the_first_arrival_without_conflicts(uses, rng):
    n, p = len(uses), len(uses[0])
    stage = rng.randrange(p)
    unfinished = {b for b in range(n) if rng.random() < 0.7}
    arrived = [b for b in unfinished if rng.random() < 0.6]
    rng.shuffle(arrived)
    pick = csp_pick(stage, arrived, unfinished, uses)
    blocked = [b for b in arrived if conflicts(stage, b, unfinished, uses)]
    if pick is None:
        assert blocked == arrived
    else:
        assert conflicts(stage, pick, unfinished, uses) == ()
        assert blocked[: arrived.index(pick)] == arrived[: arrived.index(pick)]
    # The subnet that all others wait for, the smallest unfinished one, is never blocked (no deadlock).
    if unfinished:
        assert conflicts(stage, min(unfinished), unfinished, uses) == ()
