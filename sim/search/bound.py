"""A proven lower bound on a plan's iteration time and peak memory from its per-stage costs alone, without building
or lowering the plan: what lets the search screen every candidate of a cluster-scale space (:mod:`sim.search.screen`).

The engine (``sim.engine.simpy_engine``) runs each pipeline rank's program on one walker: compute ops (F, B, I, W, R,
OPT_STEP) and the tensor- and expert-parallel collectives after them (TP_*, EP_*) one after another, each starting
when the one before it has ended and its dependencies are met; a transfer takes at least its uncontended time
(links shared with other traffic only make it longer); and an optimizer step waits for its stage's gradient
reduction. So with the costs of one replica's cost view (:class:`sim.cost.cost_view.CostView`, the one cost oracle),
three chains bound the makespan from below, for every plan whatever the contention:

* **Fill and work.** Rank r cannot start before microbatch 0's forward has come through every vstage before its
  first (``head``: their forwards, collectives and sends), and then runs all its ops back to back (``work``); after
  its last backward its update waits for the reduction of the first vstage it reduces (``post``: the reduction, the
  updates, ZeRO's parameter gather after the last update). ``head + work + post``.
* **Drain** (gpipe, 1F1B, zero bubble, interleaved): rank r's last backward (B, or I under a split backward) is
  its lowest vstage's, of one microbatch, and ends after ``head`` and every forward, recompute and earlier
  backward of the rank; then that microbatch's input gradient goes back through every earlier vstage (each one's B
  or I and the collectives after it, and the sends), and rank 0 ends with its post (under a split backward after
  the W of that microbatch too). ``head + work before the last backward + drain + post of rank 0``. Under zero
  bubble the W ops may follow the last I, so none of them is counted there. For uniform stages and free links this
  is the classic (m + p − 1)(f + b) of GPipe and 1F1B (and its interleaved form with chunk times), exactly the
  engine's time.

Peak memory from below: a rank holds its stages' training state from the start (:func:`sim.cost.ledger.
resident_bytes`, the ledger's own rule) and, at the forward that puts the most microbatches in flight, the kept
activations of each (:func:`sim.cost.ledger.kept_bytes`): m under GPipe (every forward before the first backward),
min(p − r, m) under 1F1B and zero bubble (the warm-up forwards of rank r), one otherwise.

Costs the engine adds beyond these chains (contention, a later stage's warm-up delaying an earlier one under
unequal stages, context-parallel exchanges, the per-microbatch collectives of ZeRO-2 and 3) only make the bound
lower than the engine's time, never higher; ``tests/search/test_bound.py`` holds both bounds to the engine over
random plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.cost.cost_view import CostView
from sim.cost.ledger import kept_bytes, resident_bytes
from sim.ir.ops import Action, OpKind, collective_after

__all__ = ["StageTimes", "stage_times", "time_lower_bound", "memory_lower_bound", "DRAIN_SCHEDULES",
           "IN_FLIGHT"]

# The collective kinds after each compute kind, from the op table (``OpSemantics.follows``).
_TP_AFTER = collective_after(Action.TP_COLLECTIVE)
_EP_AFTER = collective_after(Action.EP_COLLECTIVE)

#: Schedules whose every rank runs its last backward (B, or I under a split backward) on its lowest vstage, for the
#: same microbatch on every rank, after all its forwards and earlier backwards (interleaved: the last
#: chunk-backward is chunk 0's of microbatch m - 1, sim.schedules.interleaved).
DRAIN_SCHEDULES = frozenset({"gpipe", "1f1b", "zb1p", "interleaved"})


def _warmup_in_flight(pipeline: int, rank: int, microbatches: int) -> int:
    return min(pipeline - rank, microbatches)


#: Microbatches a rank surely holds activations of at once, ``(p, rank, m) -> count``, per schedule; others: 1.
IN_FLIGHT = {
    "gpipe": lambda pipeline, rank, microbatches: microbatches,
    "1f1b": _warmup_in_flight,
    "zb1p": _warmup_in_flight,
}


@dataclass(frozen=True)
class StageTimes:
    """What one replica's ops of each vstage take, s (index = vstage).

    Attributes:
        forward_s: F and the collectives after it (TP_F, EP_F), per microbatch.
        backward_s: the backward on the drain chain (B, or I under a split backward) and the collectives after it
            (TP_B, EP_B), per microbatch.
        weight_backward_s: W per microbatch under a split backward (0 otherwise).
        recompute_s: R and its collectives (TP_R, EP_R) per microbatch under full recomputation (0 otherwise).
        send_forward_s: the activation's transfer to the next vstage's rank (0 on the same rank, or the last vstage).
        send_backward_s: the input gradient's transfer to the previous vstage's rank (0 likewise, or vstage 0).
        reduce_s: the gradient reduction the update waits for (0 when there is none, or when it overlaps the
            backward: ``grad_overlap``, ZeRO-2 and ZeRO-3 reduce during it).
        update_s: the optimizer step, per update.
        gather_s: ZeRO-1 and 2's all-gather of the updated parameters (0 otherwise).
        updates: optimizer steps per vstage per iteration (1; m under weight stashing).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    weight_backward_s: tuple[float, ...]
    recompute_s: tuple[float, ...]
    send_forward_s: tuple[float, ...]
    send_backward_s: tuple[float, ...]
    reduce_s: tuple[float, ...]
    update_s: tuple[float, ...]
    gather_s: tuple[float, ...]
    updates: int = 1


def stage_times(view: CostView, *, split_backward: bool, recompute_full: bool, updates: int = 1) -> StageTimes:
    """The :class:`StageTimes` of ``view``'s plan (its placement and layout), from the view's own costs.

    Args:
        view: one replica's cost view.
        split_backward: the schedule splits the backward into I and W (zero bubble).
        recompute_full: full recomputation (an R before every backward).
        updates: optimizer steps per vstage per iteration.
    """
    layout, placement = view.layout, view.placement
    to_rank = placement.vstage_to_rank
    vstages = range(len(to_rank))
    tp, ep = layout.tp > 1, layout.ep * layout.etp > 1

    def collectives(source: OpKind, v: int) -> float:
        """The TP and EP collectives that follow a ``source`` op of ``v`` (the op table's ``follows``), s."""
        return ((view.collective_op(_TP_AFTER[source], v).seconds if tp else 0.0)
                + (view.collective_op(_EP_AFTER[source], v).seconds if ep else 0.0))

    backward_kind = OpKind.I if split_backward else OpKind.B
    forward = tuple(view.compute_time(OpKind.F, v) + collectives(OpKind.F, v) for v in vstages)
    backward = tuple(view.compute_time(backward_kind, v) + collectives(backward_kind, v) for v in vstages)
    weight = tuple(view.compute_time(OpKind.W, v) if split_backward else 0.0 for v in vstages)
    recompute = tuple(view.compute_time(OpKind.R, v) + collectives(OpKind.R, v)
                      if recompute_full else 0.0 for v in vstages)
    send_forward = tuple(view.message(OpKind.SEND_F, v, to_rank[v], to_rank[v + 1]).seconds
                         if v + 1 < len(to_rank) and to_rank[v + 1] != to_rank[v] else 0.0 for v in vstages)
    send_backward = tuple(view.message(OpKind.SEND_B, v, to_rank[v], to_rank[v - 1]).seconds
                          if v > 0 and to_rank[v - 1] != to_rank[v] else 0.0 for v in vstages)
    reduces = layout.data_ranks > 1 and layout.zero in (0, 1) and not layout.grad_overlap and updates == 1
    reduce = tuple(view.collective_op(OpKind.REDUCE_GRAD, v).seconds if reduces else 0.0 for v in vstages)
    gathers = layout.data_ranks > 1 and layout.zero in (1, 2)
    gather = tuple(view.collective_op(OpKind.GATHER_PARAMS, v).seconds if gathers else 0.0 for v in vstages)
    update = tuple(view.compute_time(OpKind.OPT_STEP, v) for v in vstages)
    return StageTimes(forward, backward, weight, recompute, send_forward, send_backward, reduce, update, gather,
                      updates)


def time_lower_bound(schedule: str, microbatches: int, vstage_to_rank: Sequence[int], times: StageTimes) -> float:
    """A lower bound on the engine's iteration time of a plan with these stage costs, s (module docstring)."""
    m, to_rank = microbatches, tuple(vstage_to_rank)
    pipeline = max(to_rank) + 1
    # head[v]: the earliest vstage v's first forward can start (microbatch 0 through every earlier vstage).
    head = [0.0] * len(to_rank)
    for v in range(1, len(to_rank)):
        head[v] = head[v - 1] + times.forward_s[v - 1] + times.send_forward_s[v - 1]
    per_microbatch = [times.forward_s[v] + times.backward_s[v] + times.weight_backward_s[v] + times.recompute_s[v]
                      for v in range(len(to_rank))]
    best = 0.0
    for rank in range(pipeline):
        own = [v for v, r in enumerate(to_rank) if r == rank]
        work = m * sum(per_microbatch[v] for v in own) + times.updates * sum(times.update_s[v] for v in own)
        # The rank reduces and steps its vstages in reverse order (sim.plan.lower_collectives): the first update
        # waits for the highest vstage's reduction, and the lowest vstage's parameter gather comes last.
        post = times.reduce_s[own[-1]] + times.gather_s[own[0]]
        best = max(best, head[own[0]] + work + post)
    if schedule not in DRAIN_SCHEDULES or times.updates != 1:
        return best
    first_of_0 = [v for v, r in enumerate(to_rank) if r == 0]
    post_0 = (times.weight_backward_s[0] + times.reduce_s[first_of_0[-1]]
              + sum(times.update_s[v] for v in first_of_0) + times.gather_s[first_of_0[0]])
    drain = [0.0] * len(to_rank)  # drain[v]: from vstage v's backward of the microbatch to vstage 0's
    for v in range(1, len(to_rank)):
        drain[v] = drain[v - 1] + times.send_backward_s[v] + times.backward_s[v - 1]
    for rank in range(pipeline):
        own = [v for v, r in enumerate(to_rank) if r == rank]
        before_last = m * sum(times.forward_s[v] + times.backward_s[v] + times.recompute_s[v] for v in own)
        best = max(best, head[own[0]] + before_last + drain[own[0]] + post_0)
    return best


def memory_lower_bound(view: CostView, schedule: str, microbatches: int, *, recompute_full: bool,
                       stashing: bool = False) -> tuple[int, ...]:
    """A lower bound on each pipeline rank's peak memory in ``view``'s replica, bytes (module docstring)."""
    placement = view.placement
    pipeline = max(placement.vstage_to_rank) + 1
    in_flight = IN_FLIGHT.get(schedule, lambda pipeline, rank, microbatches: 1)
    peaks = []
    for rank in range(pipeline):
        vstages = placement.vstages_of(rank)
        held = max(kept_bytes(view, v, recomputed=recompute_full) for v in vstages)
        count = in_flight(pipeline, rank, microbatches) if len(vstages) == 1 else 1
        peaks.append(resident_bytes(view, vstages, stashing=stashing) + count * held)
    return tuple(peaks)
