"""The plan checks as they were before they were made linear in memory: dicts keyed by (kind, vstage, mb) tuples and
by op id, every id materialised. Kept as the oracle the tests compare ``sim.plan.validate`` with: same verdict, same
first problem, same message, on plans broken at random.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from sim.core.errors import SpecError
from sim.ir.plan import COPY_KINDS, RECV_KINDS, SCHEDULED_KINDS, SEND_KINDS, Op, OpKind, Plan
from sim.plan.validate import PlanError, _describe_wait

__all__ = ["reference_validate"]


def reference_validate(plan: Plan) -> None:
    """Every check that applies to the plan's level, in the order ``sim.plan.validate.validate`` runs them."""
    reference_l0(plan)
    if plan.level == "L1":
        reference_l1(plan)
        reference_deadlock(plan)


def _index(plan: Plan) -> dict[str, tuple[int, int]]:
    index: dict[str, tuple[int, int]] = {}
    for rank, program in enumerate(plan.programs):
        for pos, op in enumerate(program):
            if op.id in index:
                raise SpecError(f"op {op.id} appears twice (rank {index[op.id][0]} and rank {rank})")
            index[op.id] = (rank, pos)
    return index


def reference_l0(plan: Plan) -> None:
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
            if op.kind not in SCHEDULED_KINDS:
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


def reference_l1(plan: Plan) -> None:
    """Pairing of sends and receives, existence of every dep, and consistent message order per channel.

    Point-to-point transports (gloo, NCCL) match messages between two ranks in the order they were posted, so the
    sends from rank a to rank b must appear in a's program in the same order as the matching receives in b's.
    """
    index = _index(plan)
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


def reference_deadlock(plan: Plan) -> None:
    """Dry-run the L1 plan with zero-duration ops and raise :class:`PlanError` if it cannot finish.

    The semantics are the engine's (DESIGN §6): each rank walks its program in order; SEND/RECV and PREFETCH/EVICT
    are issued without blocking the rank; a transfer happens once its SEND and RECV are both issued and the SEND's
    deps are done, a copy once its deps are done; any other op blocks the rank until its deps are done.
    """
    index = _index(plan)
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


