"""Weight stashing (async PipeDream): where the per-microbatch updates go and which weight version each op uses.

PipeDream (Narayanan et al., SOSP'19 §3.3) pipelines minibatches without a flush: every stage updates its weights
after each minibatch's backward, so at any moment a stage has several minibatches in flight that started under
different weights. *Weight stashing* keeps, for each in-flight minibatch, the version its forward used and runs the
backward with that same version, so each gradient is a true gradient of some weights; the update is applied to the
latest weights. *Vertical sync* (§3.3, optional) additionally makes every stage use, for minibatch k, the version
that the first stage used for k, so all stages agree on one version per minibatch.

In the IR (DESIGN §3, ``weight_policy = "stash"``) a microbatch is PipeDream's minibatch, and the update is an
``OPT_STEP`` op carrying the microbatch whose gradient it applies (``2OPT_STEP5``), right after that microbatch's
backward (and its SEND_B) on the stage. Which version an F uses follows from the program order, so it is not stored
in the plan: :func:`weight_versions` derives it, and the simulator (stashed-version memory) and the executor (which
weights to run) both call it.
"""

from __future__ import annotations

from sim.ir.plan import Op, OpKind, Plan

__all__ = ["add_stash_optimizer_steps", "weight_versions", "VERTICAL_SYNC_OPTION"]

#: The plan option that turns vertical sync on.
VERTICAL_SYNC_OPTION = "vertical_sync"


def add_stash_optimizer_steps(plan: Plan) -> Plan:
    """Put ``OPT_STEP(v, mb)`` right after the op that finishes mb's weight gradient on v (B, or W when split).

    A SEND_B directly after that op stays before the step, so the gradient leaves as early as possible (as in the
    flush policy's pass).
    """
    programs = []
    for program in plan.programs:
        out: list[Op] = []
        pending: list[Op] = []
        split = {(o.vstage, o.mb) for o in program if o.kind is OpKind.W}
        for op in program:
            if pending and op.kind is not OpKind.SEND_B:
                out.extend(pending)
                pending = []
            out.append(op)
            if op.kind is OpKind.W or (op.kind is OpKind.B and (op.vstage, op.mb) not in split):
                pending.append(Op(OpKind.OPT_STEP, op.vstage, op.mb))
        out.extend(pending)
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level=plan.level)


def weight_versions(plan: Plan) -> dict[tuple[int, int], int]:
    """For each (vstage, mb), the number of updates in the weights its forward (and backward) use.

    Without vertical sync: the OPT_STEPs of that vstage that come before its F in the program. With vertical sync
    (``plan.option("vertical_sync")``): the version vstage 0 used for the same microbatch, on every vstage; a stage
    that is further along keeps that older version for it.

    Raises:
        ValueError: the plan is not a stash plan with its OPT_STEPs, or (vertical sync) a stage would need a version it
            has not made yet.
    """
    if plan.weight_policy != "stash" or not any(op.kind is OpKind.OPT_STEP for program in plan.programs
                                                for op in program):
        raise ValueError(f"weight versions exist for stash plans with their updates (lowered, or after "
                         f"add_stash_optimizer_steps), got a {plan.level} {plan.weight_policy} plan"
                         f"{'' if plan.weight_policy != 'stash' else ' without OPT_STEP ops'}")
    own: dict[tuple[int, int], int] = {}
    made: dict[tuple[int, int], int] = {}  # (v, mb) -> updates made on v before its F ran
    for program in plan.programs:
        updates: dict[int, int] = {}
        for op in program:
            if op.kind is OpKind.OPT_STEP:
                updates[op.vstage] = updates.get(op.vstage, 0) + 1
            elif op.kind is OpKind.F:
                assert op.mb is not None
                own[(op.vstage, op.mb)] = made[(op.vstage, op.mb)] = updates.get(op.vstage, 0)
    if not plan.option(VERTICAL_SYNC_OPTION, False):
        return own
    synced = {(v, mb): own[(0, mb)] for v, mb in own}
    for key, version in synced.items():
        if version > made[key]:
            raise ValueError(f"vertical sync: vstage {key[0]} would need version {version} for microbatch "
                             f"{key[1]} before making it ({made[key]} updates so far)")
    return synced
