"""Lowering passes: L0 compute-only programs → L1 programs with communication, optimizer steps and explicit deps.

Each pass is a pure ``Plan -> Plan`` function (style guide §10.7, after PyTorch's ``_add_send_recv``). Both the
simulator and the executor run the lowered plan, so the dependencies they honour are the same edges, written once.

Placement rules (DESIGN §3):
    * A SEND goes right after the op that produces its tensor (the sender has it then).
    * A RECV goes right before the op that consumes it, not where the sender happens to be in its program. PyTorch
      places receives at the sender's position, which can leave a rank blocked on a receive long before it needs the
      data (pytorch/pytorch#188833; zero-bubble schedules use a "recv deadline" for the same reason).
    * Adjacent vstages on the same rank hand tensors over in memory: no SEND/RECV, only a dep edge.
    * Real transports (gloo, NCCL) match the messages of one directed channel (rank a → rank b) in posting order, so
      b must post its RECVs in the order a posts the SENDs. When b consumes the messages of a channel in another
      order than a sends them (schedules written for PyTorch's runtime, e.g. interleaved zero-bubble), a RECV moves
      up to just before the first consumer of a later message of its channel (:func:`order_receives`); posting a
      receive early costs nothing, since only its consumer waits for it. ``sim.plan.validate`` checks the result.
"""

from __future__ import annotations

from dataclasses import replace

from sim.ir.ops import INPUT_GRADIENT_KINDS, WEIGHT_GRADIENT_KINDS, op_id
from sim.ir.plan import RECV_KINDS, SEND_KINDS, Op, OpKind, Plan
from sim.ir.weight_versions import add_stash_optimizer_steps

__all__ = ["lower", "add_recompute", "add_send_recv", "order_receives", "add_optimizer_steps"]


def lower(plan: Plan) -> Plan:
    """Run every lowering pass on an L0 plan and return the L1 plan."""
    if plan.level != "L0":
        raise ValueError(f"lower() takes an L0 plan, got level {plan.level}")
    with_comms = order_receives(add_send_recv(plan))
    if plan.weight_policy in ("stash", "stream"):
        # Async PipeDream and PARTIME's stream: an update per microbatch (frame), right after its backward.
        return add_stash_optimizer_steps(with_comms)
    return add_optimizer_steps(with_comms)


def order_receives(plan: Plan) -> Plan:
    """Post each channel's RECVs in the order its SENDs are posted, moving a RECV earlier where needed.

    Walking a rank's program, a RECV of the j-th message of channel (src → rank) first posts every earlier message of
    that channel not yet posted, in channel order; a RECV already posted that way is dropped from its old place. A
    plan whose receives are already in channel order comes back unchanged.
    """
    sends: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> pair ids in the sender's posting order
    for src, program in enumerate(plan.programs):
        for op in program:
            if op.kind in SEND_KINDS:
                sends.setdefault((src, op.peer), []).append(op.pair)  # type: ignore[arg-type]
    programs = []
    for rank, program in enumerate(plan.programs):
        recv_of = {op.pair: op for op in program if op.kind in RECV_KINDS}
        position = {pair: i for (_, dst), pairs in sends.items() if dst == rank for i, pair in enumerate(pairs)}
        posted_upto: dict[int, int] = {}  # src -> how many of its messages to this rank are posted
        out: list[Op] = []
        for op in program:
            if op.kind not in RECV_KINDS:
                out.append(op)
                continue
            src, index = op.peer, position[op.pair]  # type: ignore[index]
            channel = sends[(src, rank)]  # type: ignore[index]
            for i in range(posted_upto.get(src, 0), index + 1):  # type: ignore[arg-type]
                out.append(recv_of[channel[i]])
            posted_upto[src] = max(posted_upto.get(src, 0), index + 1)  # type: ignore[arg-type]
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level=plan.level)


def add_recompute(plan: Plan) -> Plan:
    """Activation recomputation: an R right before the backward (B or I) of every (vstage, mb). L0 → L0.

    With recomputation a stage keeps only checkpoints from F to the backward, and re-runs the forward just before the
    backward to rebuild the rest (Chen et al., arXiv 1604.06174; GPipe §2.3 "re-materialization"); how many bytes
    that keeps and rebuilds is the memory ledger's (``sim.cost.ledger``: every layer's input, one layer at a time).
    The R goes on the same rank, immediately before the backward in program order. Since the rebuild runs layer by
    layer inside the backward, :func:`add_send_recv` makes it wait for the output gradient as the backward does; its
    duration is the stage's forward, drawn as one span before the backward's. (vstage, mb) pairs that already have
    an R (a hand-written schedule file) are left as they are. The plan's options record ``recompute = True`` so that the
    executor and ``plan.json`` readers know.
    """
    if plan.level != "L0":
        raise ValueError(f"add_recompute() takes an L0 plan, got level {plan.level}")
    have = {(op.vstage, op.mb) for program in plan.programs for op in program if op.kind is OpKind.R}
    programs = []
    for program in plan.programs:
        out: list[Op] = []
        for op in program:
            if op.kind in INPUT_GRADIENT_KINDS and (op.vstage, op.mb) not in have:
                out.append(Op(OpKind.R, op.vstage, op.mb))
            out.append(op)
        programs.append(tuple(out))
    options = tuple(sorted({**dict(plan.options), "recompute": True}.items()))
    return replace(plan.with_programs(tuple(programs), level="L0"), options=options)


def add_send_recv(plan: Plan) -> Plan:
    """Insert SEND_F/RECV_F and SEND_B/RECV_B around the compute ops and write the data dependencies.

    Forward of (v, mb) needs the forward output of (v − 1, mb); the input-gradient backward (B or I) of (v, mb) needs
    the input gradient of (v + 1, mb); a W needs the I of the same (v, mb). An R right before the backward of its
    (v, mb) needs what that backward needs (it rebuilds layer by layer inside it); any other R, program order only.
    """
    to_rank = plan.placement.vstage_to_rank
    last = plan.num_vstages - 1
    pair_ids: dict[tuple[OpKind, int, int], int] = {}
    # (vstage, mb) whose backward is split into I + W: their input gradient comes from the I, otherwise from the B.
    split = {(op.vstage, op.mb) for program in plan.programs for op in program if op.kind is OpKind.I}
    F, B, I, R, SEND_F, SEND_B, RECV_F, RECV_B = (  # noqa: N806, E741 - locals: this loop runs for every op
        OpKind.F, OpKind.B, OpKind.I, OpKind.R, OpKind.SEND_F, OpKind.SEND_B, OpKind.RECV_F, OpKind.RECV_B)

    def pair(kind: OpKind, sender_vstage: int, mb: int) -> int:
        # Ids are handed out in the order the lowering first meets each transfer, which is fixed by the programs.
        return pair_ids.setdefault((kind, sender_vstage, mb), len(pair_ids))

    def gradient_source(rank: int, v: int, mb: int, append) -> str:
        """The op id the backward of (v, mb) reads its output gradient from, appending the RECV_B when remote."""
        if to_rank[v + 1] == rank:
            return op_id(I if (v + 1, mb) in split else B, v + 1, mb)
        append(Op(RECV_B, v, mb, peer=to_rank[v + 1], pair=pair(SEND_B, v + 1, mb),
                  deps=(op_id(SEND_B, v + 1, mb),)))
        return op_id(RECV_B, v, mb)

    rebuilds_in_backward = plan.weight_policy != "stream"
    programs = []
    for rank, program in enumerate(plan.programs):
        out: list[Op] = []
        append = out.append
        # (vstage, mb) whose output gradient an R right before the backward already waited for (see below).
        # A stream's R is its drain step's forward of the stage's current input (``sim.schedules.partime``), not a
        # rebuild for a backward: it runs on program order as before.
        gradient_of: dict[tuple[int, int], str] = {}
        for pos, op in enumerate(program):
            kind, v, mb = op.kind, op.vstage, op.mb
            assert mb is not None, f"L0 op {op.id} without a microbatch"
            following = program[pos + 1] if pos + 1 < len(program) else None
            if (kind is R and rebuilds_in_backward and v < last and following is not None
                    and following.kind in INPUT_GRADIENT_KINDS and following.vstage == v and following.mb == mb):
                # An R right before its backward rebuilds one layer at a time inside that backward (Megatron's
                # uniform recomputation, torchtitan's per-block AC: each layer re-runs when autograd reaches it),
                # so it cannot start before the output gradient is there: it waits for it like the backward does.
                gradient_of[(v, mb)] = source = gradient_source(rank, v, mb, append)
                append(Op(kind, v, mb, deps=(source,)))
            elif kind is F and v > 0:
                if to_rank[v - 1] == rank:
                    append(Op(kind, v, mb, deps=(op_id(F, v - 1, mb),)))
                else:
                    recv_id = op_id(RECV_F, v, mb)
                    append(Op(RECV_F, v, mb, peer=to_rank[v - 1], pair=pair(SEND_F, v - 1, mb),
                              deps=(op_id(SEND_F, v - 1, mb),)))
                    append(Op(kind, v, mb, deps=(recv_id,)))
            elif (kind is B or kind is I) and v < last:
                source = gradient_of.pop((v, mb), None) or gradient_source(rank, v, mb, append)
                append(Op(kind, v, mb, deps=(source,)))
            else:
                append(Op(kind, v, mb))
            if kind is F and v < last and to_rank[v + 1] != rank:
                append(Op(SEND_F, v, mb, peer=to_rank[v + 1], pair=pair(SEND_F, v, mb), deps=(op_id(kind, v, mb),)))
            if (kind is B or kind is I) and v > 0 and to_rank[v - 1] != rank:
                append(Op(SEND_B, v, mb, peer=to_rank[v - 1], pair=pair(SEND_B, v, mb), deps=(op_id(kind, v, mb),)))
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level="L1")


def add_optimizer_steps(plan: Plan) -> Plan:
    """Append one OPT_STEP per vstage right after the last op that produces its weight gradient (B or W).

    This is the synchronous flush of GPipe and PipeDream-Flush: the weights of a stage change once per iteration,
    after every microbatch has contributed its gradient.
    """
    programs = []
    for program in plan.programs:
        last_grad: dict[int, int] = {}
        for pos, op in enumerate(program):
            if op.kind in WEIGHT_GRADIENT_KINDS:
                last_grad[op.vstage] = pos
        # A SEND_B right after the last B still belongs before the step, so the gradient leaves as early as possible.
        insert_after: dict[int, list[int]] = {}
        for vstage, pos in last_grad.items():
            while pos + 1 < len(program) and program[pos + 1].kind is OpKind.SEND_B:
                pos += 1
            insert_after.setdefault(pos, []).append(vstage)
        out: list[Op] = []
        for pos, op in enumerate(program):
            out.append(op)
            for vstage in sorted(insert_after.get(pos, ())):
                out.append(Op(OpKind.OPT_STEP, vstage))
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level=plan.level)
