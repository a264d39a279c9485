"""The context-switch rules of one CSP stage (sim.csp.memory), without a simulation or ranks."""

from sim.csp.memory import StageMemory, StageState


def _memory(uses, budget, key_bytes=None):
    state = StageState()
    keys = {k for row in uses for k in row[0]}
    return StageMemory(0, 2, uses, key_bytes or dict.fromkeys(keys, 1), budget, state), state


def test_eviction_is_belady_then_lru_and_never_pinned():
    uses = [[frozenset("a")], [frozenset("b")], [frozenset("c")], [frozenset("a")], [frozenset("d")]]
    memory, state = _memory(uses, budget=2)
    state.arrived, state.upper = [0, 1, 2, 3, 4], 5
    for b in (0, 1):
        state.arrived.remove(b)
        memory.start(b)
        memory.apply(memory.demand(b))
    memory.finish(0)  # "a" is free again, "b" stays pinned by 1
    state.finished.add(0)
    state.arrived.remove(2)
    memory.start(2)
    plan = memory.demand(2)
    assert plan.missing == ("c",) and plan.victims == ("a",)  # the only unpinned key
    memory.apply(plan)
    memory.finish(1)
    memory.finish(2)
    state.finished |= {1, 2}
    # "a" is next used by 3, "b" and "c" never again: Belady evicts those first, the older one ("b") first.
    plan = memory.prefetch(3, ())
    assert plan.missing == ("a",) and plan.victims == ("b",)
    memory.apply(plan)
    assert memory.used <= memory.budget and memory.peak == 2


def test_a_prefetch_never_evicts_a_key_needed_first():
    memory, state = _memory([[frozenset("a")], [frozenset("b")], [frozenset("a")]], budget=1)
    state.arrived, state.upper = [0, 1, 2], 3
    state.arrived.remove(0)
    memory.start(0)
    memory.apply(memory.demand(0))
    memory.finish(0)
    state.finished.add(0)
    assert memory.prefetch(1, ()) is not None  # "a" is next needed by 2, after 1
    memory.apply(memory.prefetch(1, ()))
    assert memory.prefetch(2, ()) is None  # "b" is needed by 1, before 2: no room, dropped
    assert memory.predict(None) is None  # 1 is predicted and resident already


def test_admission_keeps_room_for_earlier_unfinished_subnets():
    memory, state = _memory([[frozenset("ab")], [frozenset("c")], [frozenset("d")]], budget=2)
    state.arrived, state.upper = [1, 2], 3
    # 0 has not arrived but is unfinished: 1 and 2 may start only if 0's two keys fit beside them; they do not.
    assert memory.admitted(state.arrived, state.unfinished()) == ()
    state.finished.add(0)
    assert memory.admitted(state.arrived, state.unfinished()) == (1, 2)
