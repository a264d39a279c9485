"""An oracle for the plan checks, written from the plan IR's definitions and not from ``sim.plan.validate``.

Where each rule comes from:

* ``sim.ir.plan`` and ``docs/concepts/plan-ir.md``: an op is ``(kind, vstage, mb)``, its string is its id and is
  unique within a plan; a virtual stage lives on exactly one rank (``Placement.vstage_to_rank``); a plan has one
  program per rank.
* ``sim.ir.ops``: L0 kinds are those ``OP_SEMANTICS`` marks ``scheduled``; every (vstage, mb) has one forward and a
  backward that is either one full B or one input-gradient I with one weight-gradient W, and at most one
  recomputation R, which rebuilds the forward's activations right before the backward; ``SEND_F`` of vstage v sends
  its forward output to v + 1's rank, ``SEND_B`` of v its input gradient to v - 1's rank, and a RECV names the
  receiving vstage; ``peer`` is the other rank of a SEND/RECV and ``pair`` the id they share; every ``deps`` entry is
  an op's id.
* ``sim.engine.simpy_engine`` (the engine's semantics, which the dry run shares): a rank walks its program in order;
  an op whose kind ``blocks`` holds the walker until it finishes, and starts once the walker reaches it and its deps
  are done; an issued op (``blocks`` false) is issued when the walker reaches it; a transfer happens once its SEND
  and RECV are both issued and the SEND's deps are done, and completes both; a copy or data-parallel collective
  completes once issued and its deps are done. Point-to-point transports match the messages between two ranks in
  the order they were posted (``sim.plan.validate.validate_l1``'s docstring states that rule).

Its design differs from the validator's on purpose, so that the two agreeing means something: it lists every rule a
plan breaks (:class:`Violation`, tagged with the rule) instead of stopping at the first; the L0 rules are stated
over the ops of each (vstage, mb) gathered in one place; the channel rule compares each message's rank among its
sender's posts with its rank among its receiver's; and deadlock freedom is an event replay over an explicit graph:
each op's completion is an event with the events it waits for (the walker, its deps, the other side of its
message), an event fires as soon as everything it waits for has fired, and the plan deadlocks exactly when some
event never fires. Plain dicts and lists, for the tests' small plans.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from sim.ir.ops import OP_SEMANTICS, Action, Op, OpKind
from sim.ir.plan import Plan

__all__ = ["Violation", "RULES", "reference_violations", "reference_accepts"]

# --- the rules, one tag each ---------------------------------------------------------------------------------------
RANK_COUNT = "rank-count"  # one program per rank the placement places a vstage on (0 .. highest)
VSTAGE_RANGE = "vstage-range"  # a compute op's vstage exists
MICROBATCH_RANGE = "microbatch-range"  # a compute op names one of the iteration's microbatches
PLACEMENT = "placement"  # a compute op runs on the rank its vstage is placed on
ONCE = "once"  # no (kind, vstage, mb) compute op twice
FORWARD = "forward"  # every (vstage, mb) has its forward
BACKWARD = "backward"  # ... and one backward: a full B, or an I with its W, not both
COMPUTE_ORDER = "compute-order"  # on the rank: F, then R, then B or I, then W
UNIQUE_ID = "unique-id"  # L1: an id names one op
DEP_EXISTS = "dep-exists"  # L1: every dep is the id of an op in the plan
ENDPOINT = "endpoint"  # L1: a SEND/RECV has a pair id and a peer that is another rank of the plan
MATCHED = "matched"  # L1: every SEND has exactly one RECV with its pair id, and the reverse; their peers agree
SAME_MESSAGE = "same-message"  # L1: a pair's RECV receives what its SEND sends (F to v + 1, B to v - 1, same mb)
CHANNEL_ORDER = "channel-order"  # L1: the k-th send posted from a to b is the k-th receive b posts from a
NO_DEADLOCK = "no-deadlock"  # L1: the untimed replay completes every op

#: Every rule, L0's first.
RULES = (RANK_COUNT, VSTAGE_RANGE, MICROBATCH_RANGE, PLACEMENT, ONCE, FORWARD, BACKWARD, COMPUTE_ORDER, UNIQUE_ID,
         DEP_EXISTS, ENDPOINT, MATCHED, SAME_MESSAGE, CHANNEL_ORDER, NO_DEADLOCK)

#: Within one (vstage, mb), each kind must come before these on its rank (an op that is absent constrains nothing).
_MUST_PRECEDE = {
    OpKind.F: (OpKind.R, OpKind.B, OpKind.I, OpKind.W),
    OpKind.R: (OpKind.B, OpKind.I, OpKind.W),
    OpKind.I: (OpKind.W,),
}

#: Which receive a send's message is for: its kind and the receiving vstage's offset from the sending one.
_RECEIVED_AS = {OpKind.SEND_F: (OpKind.RECV_F, +1), OpKind.SEND_B: (OpKind.RECV_B, -1)}


@dataclass(frozen=True)
class Violation:
    """One broken rule: its tag (one of :data:`RULES`) and the ops it concerns, in words."""

    rule: str
    detail: str


@dataclass(frozen=True)
class _Placed:
    """An op and where it stands: its rank and its position in that rank's program."""

    op: Op
    rank: int
    pos: int


def reference_accepts(plan: Plan) -> bool:
    """Whether the plan breaks none of the rules of its level."""
    return not reference_violations(plan)


def reference_violations(plan: Plan) -> list[Violation]:
    """Every rule the plan breaks: the L0 rules at both levels, the L1 ones on a lowered plan. The replay needs
    the message structure sound, so it runs only where no L1 rule before it is broken."""
    placed = [_Placed(op, rank, pos) for rank, program in enumerate(plan.programs) for pos, op in enumerate(program)]
    found = _compute_violations(plan, placed)
    if plan.level == "L1":
        structure = _message_violations(plan, placed)
        found += structure
        if not structure:
            found += [Violation(NO_DEADLOCK, f"{op_id} never completes") for op_id in _never_completing(plan)]
    return found


# --- L0: the compute ops of each (vstage, mb) ----------------------------------------------------------------------


def _compute_violations(plan: Plan, placed: list[_Placed]) -> list[Violation]:
    found: list[Violation] = []
    home = plan.placement.vstage_to_rank
    ranks_placed = max(home) + 1 if home else 0
    if plan.num_ranks != ranks_placed:
        found.append(Violation(RANK_COUNT, f"{plan.num_ranks} programs for the {ranks_placed} ranks placed"))
    cells: dict[tuple[int, int], dict[OpKind, list[_Placed]]] = defaultdict(lambda: defaultdict(list))
    for at in placed:
        op = at.op
        if not OP_SEMANTICS[op.kind].scheduled:
            continue  # sends, receives, collectives, copies and updates are the lowering's, checked in L1
        if op.vstage not in range(plan.num_vstages):
            found.append(Violation(VSTAGE_RANGE, f"{op} names vstage {op.vstage} of {plan.num_vstages}"))
            continue
        if op.mb is None or op.mb not in range(plan.num_microbatches):
            found.append(Violation(MICROBATCH_RANGE, f"{op} names microbatch {op.mb} of {plan.num_microbatches}"))
            continue
        if home[op.vstage] != at.rank:
            found.append(Violation(PLACEMENT, f"{op} on rank {at.rank}, its vstage on rank {home[op.vstage]}"))
        cells[(op.vstage, op.mb)][op.kind].append(at)
    for vstage in range(plan.num_vstages):
        for mb in range(plan.num_microbatches):
            found += _cell_violations(vstage, mb, cells.get((vstage, mb), {}))
    return found


def _cell_violations(vstage: int, mb: int, ops: dict[OpKind, list[_Placed]]) -> list[Violation]:
    """The rules of one (vstage, mb), given its compute ops by kind."""
    found = [Violation(ONCE, f"{copies[0].op} {len(copies)} times") for copies in ops.values() if len(copies) > 1]
    has = {kind: bool(ops.get(kind)) for kind in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)}
    cell = f"vstage {vstage} microbatch {mb}"
    if not has[OpKind.F]:
        found.append(Violation(FORWARD, f"{cell} has no F"))
    full_only = has[OpKind.B] and not has[OpKind.I] and not has[OpKind.W]
    split_only = not has[OpKind.B] and has[OpKind.I] and has[OpKind.W]
    if not (full_only or split_only):
        found.append(Violation(BACKWARD, f"{cell}: B {has[OpKind.B]}, I {has[OpKind.I]}, W {has[OpKind.W]}"))
    for first, thens in _MUST_PRECEDE.items():
        for earlier in ops.get(first, ()):
            for then in thens:
                for later in ops.get(then, ()):
                    if earlier.rank == later.rank and earlier.pos > later.pos:
                        found.append(Violation(COMPUTE_ORDER, f"{later.op} before {earlier.op}"))
    return found


# --- L1: ids, deps and the messages -------------------------------------------------------------------------------


def _message_violations(plan: Plan, placed: list[_Placed]) -> list[Violation]:
    found: list[Violation] = []
    id_count = Counter(str(at.op) for at in placed)
    found += [Violation(UNIQUE_ID, f"{name} {count} times") for name, count in id_count.items() if count > 1]
    for at in placed:
        found += [Violation(DEP_EXISTS, f"{at.op} waits for {dep}") for dep in at.op.deps if dep not in id_count]

    # Each endpoint, under its pair id, and its ordinal on its channel (sender rank, receiver rank) among the
    # endpoints of its side, counted in program order.
    sends: dict[int, list[tuple[_Placed, int]]] = defaultdict(list)
    recvs: dict[int, list[tuple[_Placed, int]]] = defaultdict(list)
    posted: Counter[tuple[str, int, int]] = Counter()
    for at in placed:  # rank by rank, each in program order
        action = OP_SEMANTICS[at.op.kind].action
        if action not in (Action.SEND, Action.RECV):
            continue
        op = at.op
        if op.pair is None or op.peer is None or op.peer not in range(plan.num_ranks) or op.peer == at.rank:
            found.append(Violation(ENDPOINT, f"{op} on rank {at.rank}: pair {op.pair}, peer {op.peer}"))
            continue
        channel = (at.rank, op.peer) if action is Action.SEND else (op.peer, at.rank)
        key = (action.value, *channel)
        (sends if action is Action.SEND else recvs)[op.pair].append((at, posted[key]))
        posted[key] += 1

    for pair in sorted(set(sends) | set(recvs)):
        if len(sends[pair]) != 1 or len(recvs[pair]) != 1:
            names = [str(at.op) for at, _ in sends[pair] + recvs[pair]]
            found.append(Violation(MATCHED, f"pair {pair} has sends and receives {names}"))
            continue
        (send, send_ordinal), (recv, recv_ordinal) = sends[pair][0], recvs[pair][0]
        if send.op.peer != recv.rank or recv.op.peer != send.rank:
            found.append(Violation(MATCHED, f"{send.op} on rank {send.rank} → {send.op.peer}, {recv.op} on rank "
                                            f"{recv.rank} ← {recv.op.peer}"))
            continue
        expected = _receive_of(send.op)
        if expected is None or (recv.op.kind, recv.op.vstage, recv.op.mb) != expected:
            found.append(Violation(SAME_MESSAGE, f"{send.op} is received by {recv.op}"))
        if send_ordinal != recv_ordinal:
            found.append(Violation(CHANNEL_ORDER, f"{send.op} is send #{send_ordinal} from rank {send.rank} to "
                                                  f"{recv.rank}, {recv.op} receive #{recv_ordinal}"))
    return found


def _receive_of(send: Op) -> tuple[OpKind, int, int | None] | None:
    """The (kind, vstage, mb) of the receive of ``send``'s message."""
    if send.kind not in _RECEIVED_AS:
        return None
    kind, offset = _RECEIVED_AS[send.kind]
    return kind, send.vstage + offset, send.mb


# --- the replay ----------------------------------------------------------------------------------------------------


def _never_completing(plan: Plan) -> list[str]:
    """The ids of the ops an untimed replay of the plan never completes (none: it runs to the end).

    Every op's completion is an event. It waits for its rank's walker to reach the op, which is the completion of
    the last blocking op before it in the program (none for the first); then, by the op's action: a RECV completes
    with its transfer, so waits for its SEND; a SEND waits also for its deps and for the walker of the RECV's rank
    reaching the RECV (a rendezvous); any other op waits also for its deps. Requires the message rules to hold.
    """
    walker_at: dict[str, str | None] = {}
    for program in plan.programs:
        last_blocking = None
        for op in program:
            walker_at[op.id] = last_blocking
            if OP_SEMANTICS[op.kind].blocks:
                last_blocking = op.id
    by_pair: dict[tuple[Action, int], str] = {}
    for program in plan.programs:
        for op in program:
            action = OP_SEMANTICS[op.kind].action
            if action in (Action.SEND, Action.RECV):
                by_pair[(action, op.pair)] = op.id

    waits_for: dict[str, set[str]] = {}
    for program in plan.programs:
        for op in program:
            action = OP_SEMANTICS[op.kind].action
            if action is Action.RECV:
                before = {by_pair[(Action.SEND, op.pair)]}
            else:
                before = {walker_at[op.id], *op.deps}
                if action is Action.SEND:
                    before.add(walker_at[by_pair[(Action.RECV, op.pair)]])
            waits_for[op.id] = before - {None}

    unmet = {name: len(before) for name, before in waits_for.items()}
    woken_by: dict[str, list[str]] = defaultdict(list)
    for name, before in waits_for.items():
        for event in before:
            woken_by[event].append(name)
    ready = deque(name for name, count in unmet.items() if count == 0)
    while ready:
        for waiter in woken_by[ready.popleft()]:
            unmet[waiter] -= 1
            if unmet[waiter] == 0:
                ready.append(waiter)
    return [name for name, count in unmet.items() if count > 0]
