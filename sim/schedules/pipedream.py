"""Async PipeDream: 1F1B without a flush, one weight update per minibatch, weight stashing (Narayanan et al.,
SOSP'19 §3.2–3.3).

The op order on each stage is 1F1B's (``p − r − 1`` warm-up forwards, then one forward one backward, then the
drain), but every microbatch is a minibatch of its own: the stage applies its gradient right after its backward
(``weight_policy = "stash"``, lowered by :func:`sim.ir.weight_versions.add_stash_optimizer_steps`), so in the steady
state no stage waits for a flush and the bubble shrinks towards 0 as minibatches grow (§3.2: "PipeDream [...]
keeps all workers busy in steady state"). The price is that in-flight minibatches started under older weights:
each stage keeps one stashed version per minibatch in flight, ``p − r`` on stage r (PipeDream's
``num_versions = warmup + 1``), and the simulator charges their memory. With vertical sync (plan option
``vertical_sync``) every stage uses the version stage 0 used for the same minibatch.

A plan covers ``m`` minibatches and drains at its end, so "no flush" holds within a plan; a long run is a long plan.

::

    p=2, m=4 (U = OPT_STEP of that minibatch)
    rank 0: F0 F1 B0 U0 F2 B1 U1 F3 B2 U2 B3 U3
    rank 1:    F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3
"""

from __future__ import annotations

from sim.schedules.one_f_one_b import one_f_one_b

__all__ = ["pipedream"]


def pipedream(num_stages: int, num_microbatches: int) -> tuple[tuple, ...]:
    """L0 programs of async PipeDream: the 1F1B order; the per-minibatch updates come with lowering.

    Args:
        num_stages: pipeline stages p (= ranks), ≥ 1.
        num_microbatches: minibatches m in the plan, ≥ 1.
    """
    return one_f_one_b(num_stages, num_microbatches)
