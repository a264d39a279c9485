"""Context parallelism's key/value exchange: what it costs on the topology and how much of it the attention hides.

Under context parallelism (``--cp C``; Liu et al., "Ring Attention with Blockwise Transformers", arXiv 2310.01889;
Llama 3 report, arXiv 2407.21783 §3.3.2; PyTorch's ``context_parallel``, which torchtitan uses) every rank holds
2 of the 2C chunks of each sequence, chunks c and 2C − 1 − c (the causal load balance: every rank gets the same share
of the causal attention), and runs everything but attention on its own tokens. Attention needs every earlier key, so
each rank's local keys and values reach the other C − 1 ranks, in one of two ways (``--cp-comm``):

* ``ring``: C steps; at step i a rank attends to the key/value shard it holds while passing it on to its successor
  and receiving the next from its predecessor, so each transfer hides under a step's attention. The backward passes
  the shards and their accumulated gradients (twice the bytes) the same way, and one last hop returns each shard's
  gradient to its owner.
* ``allgather``: the shards are all-gathered once, while the first step (the rank's own, causal block) computes,
  then the C − 1 other blocks follow (torchtitan's default, ``context_parallel_rotate_method = "allgather"``, and
  Llama 3's form). The backward gathers again under its first step and passes the key/value gradients back around
  the ring as above.

The attention kernels of the C steps are listed by :mod:`sim.cost.kernels.llama`; this module prices the transfers
(:class:`KvExchange`, on the first pipeline stage's CP groups, every tensor-parallel shard's group at once, sharing
links) and the time they add to a layer's forward or backward beyond the steps they overlap
(:func:`exposed_seconds`). The exchange is costed inside the layer's time, so it does not contend with other
collectives for links in the engine. On a device the roofline costs (a CPU rank of the executor), the attention is
not split into steps and the exchange is waited for in full: the executor's gathers there are blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.cost.collectives import collective_cost, concurrent_transfer
from sim.hw.topology import Topology
from sim.ir.parallel import CP_COMMS

__all__ = ["CP_COMMS", "KvExchange", "kv_exchange", "exposed_seconds"]


@dataclass(frozen=True)
class KvExchange:
    """The key/value exchange of one context-parallel block for one microbatch.

    Attributes:
        mode: one of :data:`CP_COMMS`.
        cp: the context-parallel degree C.
        shard_s: one ring hop of a rank's key/value shard, every rank sending at once, s.
        gather_s: the all-gather of every rank's shard over the group, s (0 under ``ring``).
    """

    mode: str
    cp: int
    shard_s: float
    gather_s: float

    def __post_init__(self) -> None:
        if self.mode not in CP_COMMS:
            raise SpecError(f"{{cp_comm}} must be one of {', '.join(CP_COMMS)}, got {self.mode!r}", "cp_comm")


def kv_exchange(topology: Topology, groups: tuple[tuple[int, ...], ...], shard_bytes: int, mode: str) -> KvExchange:
    """The exchange of ``groups`` (the concurrent CP groups, each in sequence-part order) passing ``shard_bytes`` per
    rank (its K and V for one microbatch), costed on ``topology``'s links by the flow model."""
    cp = len(groups[0])
    pairs = [(group[i], group[(i + 1) % cp]) for group in groups for i in range(cp)]
    shard_s, _ = concurrent_transfer(topology, pairs, shard_bytes)
    gather_s = collective_cost(topology, "all_gather", groups, shard_bytes * cp).seconds if mode == "allgather" \
        else 0.0
    return KvExchange(mode, cp, shard_s, gather_s)


def exposed_seconds(exchange: KvExchange, steps: list[float], backward: bool) -> float:
    """Seconds the exchange adds to the C attention ``steps`` (each step's kernel time, s, in order) of a forward or
    ``backward``: each transfer waits for nothing but the step before it, and a step waits for its shard (module
    docstring). A ring forward: step 0 is local, step i > 0 starts when shard i has arrived, i hops after the start,
    so the exposure is the recurrence ``done_i = max(done_(i-1), i·hop) + step_i`` minus the steps' sum; the backward
    hops carry the gradients too (two shards' bytes) and add one last hop. ``allgather``: the gather hides under step
    0 only; backward gradients travel as in the ring."""
    hop = exchange.shard_s
    if exchange.cp == 1:
        return 0.0
    if exchange.mode == "allgather":
        done = max(steps[0], exchange.gather_s)
        if not backward:
            return done + sum(steps[1:]) - sum(steps)
        ready = done  # every shard is here; each step's gradient leaves as the next step starts
        for i, step in enumerate(steps[1:], start=1):
            ready = max(ready, done + (i - 1) * hop) + step
        return ready + hop - sum(steps)
    per_hop = 2 * hop if backward else hop
    done = 0.0
    for i, step in enumerate(steps):
        done = max(done, i * per_hop) + step
    return done + (hop if backward else 0.0) - sum(steps)

