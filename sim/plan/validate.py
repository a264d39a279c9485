"""Checks that a plan is executable before anything runs: counts, order, pairing, channel order and deadlock.

The invariants follow PyTorch's ``_validate_schedule`` (one F per (stage, mb), backward after forward, W after I,
each stage on one rank) and its lock-step dry run ``_simulate_comms_compute``; on a deadlock the message shows each
rank's program with the op it is stuck on, like PyTorch's ``_format_pipeline_order``. :func:`check_topology`
checks that the plan's topology has a device for every rank, which a hand-edited or foreign plan may not.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.plan import COMPUTE_KINDS, COPY_KINDS, RECV_KINDS, SEND_KINDS, Op, OpKind, Plan

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
    if plan.num_ranks > topology.num_ranks:
        raise PlanError(f"plan has {plan.num_ranks} rank programs but its topology {plan.topology!r} has "
                        f"{topology.num_ranks} device(s)")
    return topology


def validate_l0(plan: Plan) -> None:
    """Placement, counts and local order of the compute ops.

    For every (vstage, mb): exactly one F, and either one B or one I with one W; at most one R, after the F and
    before the backward. Each op sits on the rank its vstage is placed on, and on that rank F comes before R, R
    before B/I, I before W. Communication and optimizer ops are ignored here (they belong to L1).
    """
    to_rank = plan.placement.vstage_to_rank
    if plan.num_ranks != max(to_rank, default=-1) + 1:
        raise PlanError(f"plan has {plan.num_ranks} rank programs but places vstages on ranks {sorted(set(to_rank))}")
    counts: Counter[tuple[OpKind, int, int]] = Counter()
    position: dict[tuple[OpKind, int, int], int] = {}
    for rank, program in enumerate(plan.programs):
        for pos, op in enumerate(program):
            if op.kind not in COMPUTE_KINDS:
                continue
            if not 0 <= op.vstage < plan.num_vstages:
                raise PlanError(f"op {op.id} on rank {rank}: vstage {op.vstage} outside 0..{plan.num_vstages - 1}")
            if op.mb is None or not 0 <= op.mb < plan.num_microbatches:
                raise PlanError(
                    f"op {op.id} on rank {rank}: microbatch {op.mb} outside 0..{plan.num_microbatches - 1}"
                )
            if to_rank[op.vstage] != rank:
                raise PlanError(f"op {op.id} is on rank {rank} but vstage {op.vstage} is placed on rank "
                                f"{to_rank[op.vstage]}")
            key = (op.kind, op.vstage, op.mb)
            counts[key] += 1
            if counts[key] > 1:
                raise PlanError(f"op {op.id} appears twice on rank {rank}")
            position[key] = pos
    for v in range(plan.num_vstages):
        for mb in range(plan.num_microbatches):
            name = f"(vstage {v}, microbatch {mb})"
            f, b, i, w, r = (counts[(k, v, mb)] for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R))
            if f != 1:
                raise PlanError(f"{name} has no forward {Op(OpKind.F, v, mb)}")
            if b + i == 0:
                raise PlanError(f"{name} has no backward ({Op(OpKind.B, v, mb)} or {Op(OpKind.I, v, mb)})")
            if b and (i or w):
                raise PlanError(f"{name} has both a full backward B and a split backward I/W")
            if i != w:
                raise PlanError(f"{name} has {i} input-gradient op(s) I but {w} weight-gradient op(s) W")
            backward = OpKind.B if b else OpKind.I
            order = [OpKind.F] + ([OpKind.R] if r else []) + [backward] + ([OpKind.W] if w else [])
            for before, after in zip(order, order[1:]):
                if position[(before, v, mb)] > position[(after, v, mb)]:
                    raise PlanError(f"{Op(after, v, mb)} comes before {Op(before, v, mb)} on rank {to_rank[v]}")


def validate_l1(plan: Plan) -> None:
    """Pairing of sends and receives, existence of every dep, and consistent message order per channel.

    Point-to-point transports (gloo, NCCL) match messages between two ranks in the order they were posted, so the
    sends from rank a to rank b must appear in a's program in the same order as the matching receives in b's.
    """
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


def check_deadlock(plan: Plan) -> None:
    """Dry-run the L1 plan with zero-duration ops and raise :class:`PlanError` if it cannot finish.

    The semantics are the engine's (DESIGN §6): each rank walks its program in order; SEND/RECV and PREFETCH/EVICT
    are issued without blocking the rank; a transfer happens once its SEND and RECV are both issued and the SEND's
    deps are done, a copy once its deps are done; any other op blocks the rank until its deps are done.
    """
    index = plan.op_index()
    done: set[str] = set()
    issued: set[str] = set()
    pointer = [0] * plan.num_ranks
    pending_sends: dict[int, Op] = {}
    issued_recvs: dict[int, Op] = {}
    issued_copies: list[Op] = []
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(plan.programs):
            while pointer[rank] < len(program):
                op = program[pointer[rank]]
                if op.kind in SEND_KINDS:
                    pending_sends[op.pair] = op
                elif op.kind in RECV_KINDS:
                    issued_recvs[op.pair] = op
                elif op.kind in COPY_KINDS:
                    issued_copies.append(op)
                elif not all(dep in done for dep in op.deps):
                    break
                else:
                    done.add(op.id)
                issued.add(op.id)
                pointer[rank] += 1
                progress = True
        for pair_id in sorted(pending_sends):
            send = pending_sends[pair_id]
            if pair_id in issued_recvs and all(dep in done for dep in send.deps):
                done.update((send.id, issued_recvs.pop(pair_id).id))
                del pending_sends[pair_id]
                progress = True
        for copy in [c for c in issued_copies if all(dep in done for dep in c.deps)]:
            done.add(copy.id)
            issued_copies.remove(copy)
            progress = True
    if len(done) == len(index):
        return
    lines = ["plan deadlocks: no rank can make progress"]
    for rank, program in enumerate(plan.programs):
        pos = pointer[rank]
        if pos >= len(program):
            lines.append(f"  rank {rank}: finished")
            continue
        op = program[pos]
        shown = [o.id for o in program[max(0, pos - 3):pos]] + [f">>{op.id}<<"]
        shown += [o.id for o in program[pos + 1:pos + 3]]
        why = ", ".join(_describe_wait(plan, dep, issued) for dep in op.deps if dep not in done)
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
