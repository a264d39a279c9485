"""Checks that a plan is executable before anything runs: counts, order, pairing, channel order and deadlock.

The invariants follow PyTorch's ``_validate_schedule`` (one F per (stage, mb), backward after forward, W after I,
each stage on one rank) and its lock-step dry run ``_simulate_comms_compute``; on a deadlock the message shows each
rank's program with the op it is stuck on, like PyTorch's ``_format_pipeline_order``. :func:`check_topology`
checks that the plan's topology has a device for every rank, which a hand-edited or foreign plan may not.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from typing import Any

import numpy as np

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.ops import OP_SEMANTICS, RECV_KINDS, SCHEDULED_KINDS, SEND_KINDS, Action, Op, OpKind, op_id
from sim.ir.plan import Plan

__all__ = ["PlanError", "validate_l0", "validate_l1", "check_deadlock", "validate", "check_topology"]


class PlanError(SpecError):
    """The plan cannot run as written; the message says which op and why."""


def validate(plan: Plan) -> None:
    """Every check that applies to the plan's level; raises :class:`PlanError` on the first problem."""
    validate_l0(plan)
    if plan.level == "L1":
        validate_l1(plan)
        check_deadlock(plan)


def check_topology(plan: Plan) -> Topology:
    """The plan's topology, parsed, after checking it has a device for every rank the plan uses.

    Ranks are counted from the programs; :func:`validate_l0` ties the placement and :func:`validate_l1` the
    point-to-point peers to that count. A topology with more devices than the plan has ranks is accepted: ``sim.run``
    writes such plans from a schedule file with fewer ranks than ``--topology`` has devices (``sim.plan.build``), and
    then ranks ``0..num_ranks-1`` are the topology's first devices, the others idle.

    Raises:
        SpecError: the topology spec does not parse.
        PlanError: the plan has more ranks than the topology has devices.
    """
    topology = Topology.parse(plan.topology)
    if plan.world_size > topology.num_ranks:
        layout = plan.layout
        what = (f"{plan.num_ranks} rank programs" if plan.parallel is None else
                f"TP {layout.tp} × DP {layout.dp} × PP {layout.pp} = {layout.world_size} devices")
        raise PlanError(f"plan has {what} but its topology {plan.topology!r} has {topology.num_ranks} device(s)")
    return topology


def validate_l0(plan: Plan) -> None:
    """Placement, counts and local order of the compute ops.

    For every (vstage, mb): exactly one F, and either one B or one I with one W; at most one R, after the F and
    before the backward. Each op sits on the rank its vstage is placed on, and on that rank F comes before R, R
    before B/I, I before W. Communication and optimizer ops are ignored here (they belong to L1).

    Work and memory are linear in the plan: each compute op's position goes into a flat table per kind indexed by
    ``vstage · m + mb`` (8 bytes per (vstage, mb), where a dict of tuples took ~300), and the per-(vstage, mb)
    rules are checked over the tables at once with numpy. Only when they fail is each (vstage, mb) looked at in turn,
    in the order that names the first problem.
    """
    to_rank = plan.placement.vstage_to_rank
    if plan.num_ranks != max(to_rank, default=-1) + 1:
        raise PlanError(f"plan has {plan.num_ranks} rank programs but places vstages on ranks {sorted(set(to_rank))}")
    num_vstages, num_mbs = plan.num_vstages, plan.num_microbatches
    size = num_vstages * num_mbs
    # A plan has at least two compute ops per (vstage, mb); with fewer ops than cells some cell is empty, and the
    # cell-by-cell walk below finds it within (ops + 1) cells, so a sparse table suffices.
    dense = size <= sum(len(program) for program in plan.programs) + 64
    tables: dict[OpKind, Any] = {}
    for rank, program in enumerate(plan.programs):
        for pos, op in enumerate(program):
            kind = op.kind
            if kind not in SCHEDULED_KINDS:
                continue
            vstage, mb = op.vstage, op.mb
            if not 0 <= vstage < num_vstages:
                raise PlanError(f"op {op.id} on rank {rank}: vstage {vstage} outside 0..{num_vstages - 1}")
            if mb is None or not 0 <= mb < num_mbs:
                raise PlanError(f"op {op.id} on rank {rank}: microbatch {mb} outside 0..{num_mbs - 1}")
            if to_rank[vstage] != rank:
                raise PlanError(f"op {op.id} is on rank {rank} but vstage {vstage} is placed on rank "
                                f"{to_rank[vstage]}")
            table = tables.get(kind)
            if table is None:
                table = tables[kind] = array("q", [-1]) * size if dense else _Absent()
            key = vstage * num_mbs + mb
            if table[key] >= 0:
                raise PlanError(f"op {op.id} appears twice on rank {rank}")
            table[key] = pos
    if dense and _l0_cells_hold(tables, size):
        return
    empty = _Absent()
    f_at, b_at, i_at, w_at, r_at = (tables.get(k, empty) for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R))
    for v in range(num_vstages):
        for mb in range(num_mbs):
            key = v * num_mbs + mb
            name = f"(vstage {v}, microbatch {mb})"
            position = {OpKind.F: f_at[key], OpKind.B: b_at[key], OpKind.I: i_at[key], OpKind.W: w_at[key],
                        OpKind.R: r_at[key]}
            f, b, i, w, r = (position[k] >= 0 for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R))
            if not f:
                raise PlanError(f"{name} has no forward {Op(OpKind.F, v, mb)}")
            if not (b or i):
                raise PlanError(f"{name} has no backward ({Op(OpKind.B, v, mb)} or {Op(OpKind.I, v, mb)})")
            if b and (i or w):
                raise PlanError(f"{name} has both a full backward B and a split backward I/W")
            if i != w:
                raise PlanError(f"{name} has {int(i)} input-gradient op(s) I but {int(w)} weight-gradient op(s) W")
            backward = OpKind.B if b else OpKind.I
            order = [OpKind.F] + ([OpKind.R] if r else []) + [backward] + ([OpKind.W] if w else [])
            for before, after in zip(order, order[1:]):
                if position[before] > position[after]:
                    raise PlanError(f"{Op(after, v, mb)} comes before {Op(before, v, mb)} on rank {to_rank[v]}")


class _Absent(dict):
    """A sparse position table: cells never set hold -1, as in the flat ones."""

    def __missing__(self, key: int) -> int:
        return -1


def _l0_cells_hold(tables: dict[OpKind, Any], size: int) -> bool:
    """Whether every (vstage, mb) cell of the flat position tables obeys :func:`validate_l0`'s rules (vectorised)."""
    missing = np.full(size, -1, dtype=np.int64)
    f, b, i, w, r = (np.frombuffer(tables[k], dtype=np.int64) if k in tables else missing
                     for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R))
    has_b, has_i, has_w, has_r = b >= 0, i >= 0, w >= 0, r >= 0
    backward = np.where(has_b, b, i)
    return bool((f >= 0).all() and (has_b | has_i).all() and not (has_b & (has_i | has_w)).any()
                and (has_i == has_w).all() and (f < np.where(has_r, r, backward)).all()
                and (~has_r | (r < backward)).all() and (~has_w | (i < w)).all())


def validate_l1(plan: Plan) -> None:
    """Pairing of sends and receives, existence of every dep, and consistent message order per channel.

    Point-to-point transports (gloo, NCCL) match messages between two ranks in the order they were posted, so the
    sends from rank a to rank b must appear in a's program in the same order as the matching receives in b's.

    One pass with small tables decides whether the plan passes (ids unique, every dep an op, SEND/RECV fields
    sane, each channel's sends and receives the same pairs in the same order, each pair's receive that of its send's
    message, which implies that every send has its receive with agreeing peers and vice versa); only a failing plan
    is walked again to name its first problem. No id → position index is built or cached on the plan (that took ~170
    bytes per op for as long as the plan lived).
    """
    if not _l1_holds(plan):
        _raise_l1_problem(plan)


def _l1_holds(plan: Plan) -> bool:
    wanted = {dep for program in plan.programs for op in program for dep in op.deps}
    num_vstages, num_mbs, num_ranks = plan.num_vstages, plan.num_microbatches, plan.num_ranks
    kinds = {kind: k for k, kind in enumerate(OpKind)}
    cells = num_vstages * (num_mbs + 1)  # mb None is column 0
    seen_cells = bytearray(len(kinds) * cells) if cells <= sum(map(len, plan.programs)) + 64 else bytearray()
    seen_ids: set[str] = set()  # ids outside the table
    sent: set[int] = set()
    received: set[int] = set()
    channel_sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    channel_recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    # A message's code: vstages -1 .. num_vstages (a send off either end) and mb None .. num_mbs, forward or backward.
    span = (num_vstages + 2) * (num_mbs + 2) * 2

    def message(kind: OpKind, vstage: int, mb: int | None) -> int:
        return ((vstage + 1) * (num_mbs + 2) + (0 if mb is None else mb + 1)) * 2 + (kind is OpKind.RECV_B)

    for rank, program in enumerate(plan.programs):
        for op in program:
            vstage, mb = op.vstage, op.mb
            this_id = op_id(op.kind, vstage, mb)
            wanted.discard(this_id)
            if seen_cells and 0 <= vstage < num_vstages and (mb is None or 0 <= mb < num_mbs):
                cell = kinds[op.kind] * cells + vstage * (num_mbs + 1) + (0 if mb is None else mb + 1)
                if seen_cells[cell]:
                    return False
                seen_cells[cell] = 1
            elif this_id in seen_ids:
                return False
            else:
                seen_ids.add(this_id)
            is_send = op.kind in SEND_KINDS
            if is_send or op.kind in RECV_KINDS:
                pair, peer = op.pair, op.peer
                if pair is None or peer is None or not 0 <= peer < num_ranks or peer == rank:
                    return False
                table = sent if is_send else received
                if pair in table:
                    return False
                table.add(pair)
                # Each channel entry is the pair id and the message as received (kind, vstage, mb) in one int, so
                # equal channels also mean every pair joins a send with the receive of its own message.
                if is_send:
                    received_as, step = _RECEIVED_AS[op.kind]
                    channel_sends[(rank, peer)].append(pair * span + message(received_as, vstage + step, mb))
                else:
                    channel_recvs[(peer, rank)].append(pair * span + message(op.kind, vstage, mb))
    if wanted:
        return False
    return all(channel_sends.get(key) == channel_recvs.get(key) for key in channel_sends.keys() | channel_recvs.keys())


#: What a send's message is received as (``sim.ir.ops``): a forward output by the next vstage's RECV_F, an input
#: gradient by the previous vstage's RECV_B, both of the same microbatch. A pair joining other ops would feed one
#: microbatch's stage with another's tensor.
_RECEIVED_AS = {OpKind.SEND_F: (OpKind.RECV_F, +1), OpKind.SEND_B: (OpKind.RECV_B, -1)}


def _raise_l1_problem(plan: Plan) -> None:
    """Raise the :class:`PlanError` (or SpecError, for a duplicate id) naming a failing L1 plan's first problem."""
    index = plan.op_index()
    sends: dict[int, tuple[int, Op]] = {}
    recvs: dict[int, tuple[int, Op]] = {}
    for rank, program in enumerate(plan.programs):
        for op in program:
            for dep in op.deps:
                if dep not in index:
                    raise PlanError(f"op {op.id} on rank {rank} depends on {dep}, which is in no program")
            if op.kind in SEND_KINDS or op.kind in RECV_KINDS:
                if op.pair is None or op.peer is None:
                    raise PlanError(f"{op.id} on rank {rank} has no pair id or peer")
                if not 0 <= op.peer < plan.num_ranks or op.peer == rank:
                    raise PlanError(f"{op.id} on rank {rank} names peer {op.peer}")
                table = sends if op.kind in SEND_KINDS else recvs
                if op.pair in table:
                    raise PlanError(f"pair id {op.pair} used by both {table[op.pair][1].id} and {op.id}")
                table[op.pair] = (rank, op)
    for pair_id, (src, send) in sends.items():
        if pair_id not in recvs:
            raise PlanError(f"{send.id} on rank {src} (pair {pair_id}) has no matching receive")
        dst, recv = recvs[pair_id]
        if send.peer != dst or recv.peer != src:
            raise PlanError(f"{send.id} (rank {src} → {send.peer}) and {recv.id} (rank {dst} ← {recv.peer}) disagree")
        carried = _RECEIVED_AS[send.kind]
        if (recv.kind, recv.vstage, recv.mb) != (carried[0], send.vstage + carried[1], send.mb):
            raise PlanError(f"{send.id} and {recv.id} share pair id {pair_id}, but {send.id}'s message is received as "
                            f"{op_id(carried[0], send.vstage + carried[1], send.mb)}")
    for pair_id, (dst, recv) in recvs.items():
        if pair_id not in sends:
            raise PlanError(f"{recv.id} on rank {dst} (pair {pair_id}) has no matching send")
    channel_sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    channel_recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, program in enumerate(plan.programs):
        for op in program:
            if op.kind in SEND_KINDS:
                channel_sends[(rank, op.peer)].append(op.pair)
            elif op.kind in RECV_KINDS:
                channel_recvs[(op.peer, rank)].append(op.pair)
    for (src, dst), order in channel_sends.items():
        if order != channel_recvs[(src, dst)]:
            first = next(k for k, (a, b) in enumerate(zip(order, channel_recvs[(src, dst)])) if a != b)
            raise PlanError(
                f"messages on channel rank {src} → rank {dst} are sent in a different order than received: "
                f"send #{first} is {sends[order[first]][1].id} but receive #{first} is "
                f"{recvs[channel_recvs[(src, dst)][first]][1].id}"
            )


# How the dry run treats each action: a transfer's two sides pair up, other issued ops complete once their deps are
# done, blocking ops hold their rank until then. Derived from OP_SEMANTICS, so a kind with a new action fails below.
_SEND, _RECV, _ISSUED, _BLOCKS = "send", "recv", "issued", "blocks"
_RULES = {Action.SEND: _SEND, Action.RECV: _RECV, Action.HOST_COPY: _ISSUED, Action.DP_COLLECTIVE: _ISSUED,
          Action.COMPUTE: _BLOCKS, Action.TP_COLLECTIVE: _BLOCKS, Action.EP_COLLECTIVE: _BLOCKS}
_DRY_RUN = {kind: _RULES[semantics.action] for kind, semantics in OP_SEMANTICS.items() if semantics.action in _RULES}


def check_deadlock(plan: Plan) -> None:
    """Dry-run the L1 plan with zero-duration ops and raise :class:`PlanError` if it cannot finish.

    The semantics are the engine's (DESIGN §6): each rank walks its program in order; SEND/RECV and PREFETCH/EVICT
    are issued without blocking the rank; a transfer happens once its SEND and RECV are both issued and the SEND's
    deps are done, a copy once its deps are done; any other op blocks the rank until its deps are done. Data-parallel
    collectives (REDUCE_GRAD, GATHER_PARAMS) are issued like copies: every replica runs the same programs, so the
    members of a collective reach it alike and one replica's dry run stands for all.

    Only the ids some op depends on are tracked (``waited``, the plan's own dep strings, dropped when done), and what
    was issued is read off the program pointers when a deadlock is reported, so the dry run needs no copy of every
    op id.
    """
    unknown = sorted({op.kind.value for program in plan.programs for op in program if op.kind not in _DRY_RUN})
    if unknown:
        raise PlanError(f"the deadlock check has no rule for op kind(s) {', '.join(unknown)}")
    waited = {dep for program in plan.programs for op in program for dep in op.deps}
    completed = 0
    pointer = [0] * plan.num_ranks
    pending_sends: dict[int, Op] = {}
    issued_recvs: dict[int, Op] = {}
    issued_copies: list[Op] = []
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(plan.programs):
            position, length = pointer[rank], len(program)
            while position < length:
                op = program[position]
                rule = _DRY_RUN[op.kind]
                if rule is _SEND:
                    pending_sends[op.pair] = op  # type: ignore[index]
                elif rule is _RECV:
                    issued_recvs[op.pair] = op  # type: ignore[index]
                elif rule is _ISSUED:
                    issued_copies.append(op)
                elif op.deps and not waited.isdisjoint(op.deps):
                    break
                else:
                    waited.discard(op_id(op.kind, op.vstage, op.mb))
                    completed += 1
                position += 1
                progress = True
            pointer[rank] = position
        for pair_id in sorted(pending_sends):
            send = pending_sends[pair_id]
            if pair_id in issued_recvs and waited.isdisjoint(send.deps):
                waited.discard(send.id)
                waited.discard(issued_recvs.pop(pair_id).id)
                completed += 2
                del pending_sends[pair_id]
                progress = True
        ready = [c for c in issued_copies if waited.isdisjoint(c.deps)]
        for copy in ready:
            waited.discard(copy.id)
            issued_copies.remove(copy)
            completed += 1
            progress = True
    if completed == sum(len(program) for program in plan.programs):
        return
    issued = {op.id for rank, program in enumerate(plan.programs) for op in program[:pointer[rank]]}
    lines = ["plan deadlocks: no rank can make progress"]
    for rank, program in enumerate(plan.programs):
        pos = pointer[rank]
        if pos >= len(program):
            lines.append(f"  rank {rank}: finished")
            continue
        op = program[pos]
        shown = [o.id for o in program[max(0, pos - 3):pos]] + [f">>{op.id}<<"]
        shown += [o.id for o in program[pos + 1:pos + 3]]
        why = ", ".join(_describe_wait(plan, dep, issued) for dep in op.deps if dep in waited)
        lines.append(f"  rank {rank}: {' '.join(shown)}  waits for {why}")
    unmatched = [f"{op.id}→rank {op.peer}" for op in pending_sends.values()]
    if unmatched:
        lines.append(f"  sends waiting for their receive: {', '.join(sorted(unmatched))}")
    raise PlanError("\n".join(lines))


def _describe_wait(plan: Plan, dep: str, issued: set[str]) -> str:
    """One unmet dependency in words: for a receive, where its send is stuck."""
    rank, pos = plan.op_index()[dep]
    op = plan.programs[rank][pos]
    if op.kind in RECV_KINDS and op.deps:
        send = op.deps[0]
        state = "issued" if send in issued else "not reached yet"
        return f"{dep} (needs {send} from rank {op.peer}, {state})"
    return f"{dep} (rank {rank}, {'issued' if dep in issued else 'not reached yet'})"
