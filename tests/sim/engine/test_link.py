"""``sim.engine.comm.Link`` against its oracle, SimPy's ``Resource(capacity=1)``: the same requests, holds and other
events give the same grants, at the same times, in the same order."""

from __future__ import annotations

import random

import pytest
import simpy

from sim.engine.comm import Link


def _replay(seed: int, use_link: bool) -> list[tuple[float, str]]:
    """Random users of one mutex, with arrival times and holds on a coarse grid (ties everywhere, zero-length
    holds included) and bystander processes whose events interleave with theirs; returns ``(time, what)`` in the
    order things happened."""
    rng = random.Random(seed)
    env = simpy.Environment()
    mutex = Link(env) if use_link else simpy.Resource(env, capacity=1)
    log: list[tuple[float, str]] = []

    def user(name: str, arrive: int, hold: int):
        yield env.timeout(arrive)
        if use_link:
            yield mutex.request()  # type: ignore[union-attr]
            log.append((env.now, f"{name} granted"))
            yield env.timeout(hold)
            mutex.release()  # type: ignore[union-attr]
        else:
            with mutex.request() as request:  # type: ignore[union-attr]
                yield request
                log.append((env.now, f"{name} granted"))
                yield env.timeout(hold)
        log.append((env.now, f"{name} released"))

    def bystander(name: str, times: list[int]):
        for step in times:
            yield env.timeout(step)
            log.append((env.now, f"{name} ticks"))

    for i in range(rng.randint(2, 12)):
        env.process(user(f"u{i}", rng.randint(0, 4), rng.choice([0, 0, 1, 2, 3])))
    for i in range(rng.randint(0, 3)):
        env.process(bystander(f"b{i}", [rng.randint(0, 2) for _ in range(6)]))
    env.run()
    return log


@pytest.mark.parametrize("seed", range(300))
def test_a_link_grants_as_simpys_resource_does(seed):
    assert _replay(seed, use_link=True) == _replay(seed, use_link=False)
