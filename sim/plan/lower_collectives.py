"""Lowering pass: the collectives of tensor and data parallelism, written into the L1 programs.

Both the simulator and the executor run these ops, so where a collective sits and what waits for it is decided
once, here:

* **Expert parallelism** (the moe family). Each forward, recompute and input-gradient backward is followed, after its
  TP op, by its expert all-to-alls, ``EP_F``, ``EP_R`` and ``EP_B``: the token dispatch and combine of every MoE
  layer of the stage (Megatron-Core's all-to-all token dispatcher), which the compute stream waits for like the TP
  op; a stage without MoE layers has them at no cost.
  With ``ep_overlap`` (``--ep-overlap``, the plan option :data:`EP_OVERLAP_OPTION`) an EP op does not hold the
  compute stream: the rank goes on with its next compute op (another microbatch's, or another vstage's) while the
  all-to-alls run, as DualPipe overlaps one chunk's dispatch and combine with another chunk's forward or backward
  (DeepSeek-V3, arXiv 2412.19437 §3.2.1) and Megatron-Core's EP overlap pairs one microbatch's forward with
  another's backward. What needs the exchanged tokens still waits for them: the SEND and the next vstage (as above)
  and the same microbatch's later compute ops of the vstage (its recompute and backward), which get the EP op in
  their deps. The overlap is taken at op granularity (a whole vstage's exchange beside the next op); the SMs the
  communication kernels occupy meanwhile (DualPipe: 20 of an H800's 132, §3.2.2) are not taken from the compute.
* **Tensor parallelism** (Megatron-LM, Shoeybi et al., arXiv 1909.08053 §3). Each forward, recompute and
  input-gradient backward of a stage is followed by its tensor-parallel collectives, ``TP_F``, ``TP_R`` and
  ``TP_B``: every all-reduce of its layers (two per transformer block in each direction; reduce-scatter plus
  all-gather under sequence parallelism). They run on the compute stream, which waits for them, as Megatron's f and
  g operators do; whatever consumed the op's output (the SEND of the activation or gradient, the next vstage on the
  same rank) now waits for the collective instead, since the output is complete only after it.
* **Data parallelism.** After the rank's last backward, each of its vstages reduces its gradients across replicas
  (``REDUCE_GRAD``: an all-reduce, or a reduce-scatter under ZeRO-1), then steps its optimizer (``OPT_STEP``,
  which waits for the reduction) and, under ZeRO-1, all-gathers the updated parameters (``GATHER_PARAMS``). This is
  Megatron's default, the one the vTrain measurements use (``use_gradient_bucket: false``): the reduction starts
  when the whole backward pass of the rank is done. The reductions are issued without blocking the rank, on the
  ``collective`` stream, so a rank with several vstages reduces them back to back while nothing waits.
  With ``grad_overlap`` (PyTorch DDP's bucketed all-reduce; Megatron's ``--overlap-grad-reduce``) each vstage's
  REDUCE_GRAD is issued right after its last backward op instead, and the engine lets its buckets stream behind
  that op (``sim.engine.comm``); the optimizer steps still come last. With ``param_gather_overlap`` (ZeRO-1,
  Megatron-Core's ``overlap_param_gather``) the all-gather of the parameters the last step updated runs ahead of
  this step's forward instead of after the optimizer step: a GATHER_PARAMS per vstage at the start of the program
  (in the order of the vstages' first forwards), which the vstage's first forward waits for, costed as the part of
  the bucket-by-bucket gather that forward cannot hide (:meth:`sim.cost.cost_view.CostView.overlapped_gather_s`).
  One iteration stands for every one: the gather at its start is the one that followed the previous step.
* **ZeRO-2** keeps only this replica's share of the gradients, so each microbatch's gradients are reduce-scattered
  as soon as its backward of the vstage has made them (ZeRO §5.2): a REDUCE_GRAD per (vstage, microbatch) right
  after its last backward op, and the update waits for all of them; then the all-gather of the updated parameters,
  as under ZeRO-1.
* **ZeRO-3 (FSDP)** gathers each layer's parameters and scatters its gradients inside the forward and backward
  (``sim.cost.fsdp`` costs them there), and the update steps on the local shard: no REDUCE_GRAD or GATHER_PARAMS op.
  A split backward (I and W) is refused: the W would gather the layer's parameters once more, which is not modelled.
* **ZeRO-3 under a pipeline without resharding after the forward** (``Parallelism.fsdp_gathers_per_step``), as
  torchtitan and PyTorch's pipelining run it: each vstage's parameters are all-gathered once per step, by a
  GATHER_PARAMS issued at the start of the rank's program (in the order of the vstages' first forwards) that the
  vstage's first forward waits for; they stay gathered for every microbatch; the gradients accumulate whole over the
  microbatches and are reduce-scattered once, by a REDUCE_GRAD right after the vstage's last backward op, which its
  update waits for. The sources: ``torch/distributed/pipelining/stage.py`` (``backward_maybe_with_nosync`` sets
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` for each microbatch's backward;
  ``_post_backward`` sets them back and runs each FSDP group's ``post_backward``, the reduce-scatter, once), and
  ``torch/distributed/pipelining/schedules.py`` (the single-stage schedules, ``Schedule1F1B``, ``ScheduleGPipe``,
  call ``stage.perform_reduce_grad`` once after their loop, right after the stage's last backward; the runtime of the
  multi-stage ones runs a REDUCE_GRAD action that ``_add_reduce_grad`` puts right after each stage's last
  microbatch's backward; ``_add_unshard_reshard``: UNSHARD, the all-gather, issued ahead of a stage's compute for up
  to three stages, which its FORWARD waits for, ``_assert_unsharded``). Issuing every vstage's gather at the start
  is that prefetch for a rank's (at most a few) vstages; FSDP2 without the runtime's UNSHARD gathers at the first
  forward's pre-hook instead, later. Under a
  pipeline with resharding after the forward the per-microbatch form above stays, though PyTorch's pipelining would
  defer its reduce-scatters to the step's end there too: not modelled.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.ir.ops import WEIGHT_GRADIENT_KINDS, Action, collective_after, op_id
from sim.ir.parallel import Parallelism
from sim.ir.plan import Op, OpKind, Plan

__all__ = ["add_collectives", "check_data_parallel", "EP_OVERLAP_OPTION"]

#: The plan option of ``--ep-overlap`` (module docstring): expert all-to-alls beside the next compute op.
EP_OVERLAP_OPTION = "ep_overlap"

# Which collective kind follows each compute kind, from the op table (``OpSemantics.follows``).
_TP_AFTER = collective_after(Action.TP_COLLECTIVE)
_EP_AFTER = collective_after(Action.EP_COLLECTIVE)


def add_collectives(plan: Plan) -> Plan:
    """Insert the plan's tensor- and data-parallel collectives into its L1 programs (a pure-pipeline plan comes back
    unchanged).

    Raises:
        SpecError: ZeRO-1 or overlapped reduction with per-microbatch updates (``stash``), or data parallelism with
            a weight policy this pass does not know.
    """
    if plan.level != "L1":
        raise ValueError(f"add_collectives() takes an L1 plan, got level {plan.level}")
    layout = plan.layout
    check_data_parallel(layout, plan.schedule, plan.weight_policy,
                        split_backward=any(op.kind is OpKind.I for program in plan.programs for op in program))
    after = ([_TP_AFTER] if layout.tp > 1 else []) + ([_EP_AFTER] if layout.ep * layout.etp > 1 else [])
    if after:
        plan = _add_model_parallel(plan, after, overlap_ep=bool(plan.option(EP_OVERLAP_OPTION, False)))
    if layout.data_ranks > 1:
        if plan.weight_policy == "stash":
            return _add_stash_reductions(plan)
        if layout.fsdp_gathers_per_step:
            return _add_fsdp_per_step(plan)
        plan = _add_data_parallel(plan, layout.zero, layout.grad_overlap, layout.param_gather_overlap)
    return plan


def check_data_parallel(layout: Parallelism, schedule: str, weight_policy: str, *, split_backward: bool) -> None:
    """Refuse the data-parallel layouts this pass does not model for a schedule (checked before anything is built,
    by :func:`add_collectives` and by the search's screen).

    Raises:
        SpecError: ZeRO or overlapped reduction with per-microbatch updates (``stash``), data parallelism with a
            weight policy other than ``flush`` or ``stash``, ZeRO-3 with a split backward.
    """
    if layout.data_ranks == 1:
        return
    if weight_policy == "stash":
        if layout.zero or layout.grad_overlap:
            raise SpecError(f"{'--zero 1' if layout.zero else '--grad-overlap'} is modelled for schedules that "
                            f"update once per iteration, not {schedule}, which updates after every microbatch")
        return
    if weight_policy != "flush":
        raise SpecError(f"data parallelism (--dp {layout.dp}) is not modelled for {weight_policy} plans")
    if layout.zero == 3 and split_backward:
        raise SpecError(f"--zero 3 is not modelled for a split backward ({schedule}'s I and W): the W would "
                        f"gather the layer's parameters once more; use a schedule without I and W")


def _add_model_parallel(plan: Plan, after: list[dict[OpKind, OpKind]], *, overlap_ep: bool = False) -> Plan:
    """After every F, R, B and I, its model-parallel collectives in order (a TP op, then an EP op: ``after`` maps
    each compute kind to its collective kind, one map per dimension); the ops that consumed the compute op's output
    wait for the last of them instead. With ``overlap_ep`` the later compute ops of the same (vstage, microbatch)
    wait for its EP ops too, since the engine no longer holds the compute stream for them (module docstring)."""
    renamed: dict[str, str] = {}
    for program in plan.programs:
        for op in program:
            if op.kind in after[0] and op.kind is not OpKind.R:
                renamed[op_id(op.kind, op.vstage, op.mb)] = op_id(after[-1][op.kind], op.vstage, op.mb)
    programs = []
    for program in plan.programs:
        out: list[Op] = []
        exchanged: dict[tuple[int, int | None], list[str]] = {}  # (vstage, mb) -> its EP ops so far
        for op in program:
            deps = op.deps
            # A W needs its own I's saved tensors, not the all-reduced input gradient; program order covers it anyway.
            if deps and op.kind is not OpKind.W:
                deps = tuple(renamed.get(dep, dep) for dep in deps)
            if overlap_ep and op.kind in after[0]:
                waiting = [ep for ep in exchanged.get((op.vstage, op.mb), ()) if ep not in deps]
                deps = (*deps, *waiting) if waiting else deps
            out.append(op if deps is op.deps else Op(op.kind, op.vstage, op.mb, op.peer, op.pair, deps))
            if op.kind in after[0]:
                collectives = [Op(kinds[op.kind], op.vstage, op.mb) for kinds in after]
                out.extend(collectives)
                if overlap_ep:
                    exchanged.setdefault((op.vstage, op.mb), []).append(collectives[-1].id)
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level="L1")


def _add_data_parallel(plan: Plan, zero: int, overlap: bool, gather_first: bool) -> Plan:
    """Move each rank's optimizer steps to its end, after a REDUCE_GRAD per vstage (and a GATHER_PARAMS under
    ZeRO-1 after each step, or with ``gather_first`` at the program's start before the vstage's first forward); with
    ``overlap`` each REDUCE_GRAD goes right after its vstage's last backward op; under ZeRO-2 one per (vstage,
    microbatch) after that microbatch's last backward op; under ZeRO-3 none (module docstring)."""
    programs = []
    for program in plan.programs:
        body = [op for op in program if op.kind is not OpKind.OPT_STEP]
        vstages = sorted({op.vstage for op in program if op.kind is OpKind.OPT_STEP})
        # Reduce in reverse layer order, as the gradients of the later layers are ready first (and as Megatron's
        # buffers are laid out), then step in the same order.
        order = vstages[::-1]
        if zero == 3:
            programs.append(tuple(body + [Op(OpKind.OPT_STEP, v) for v in order]))
            continue
        if zero == 2:
            body, reductions = _reduce_each_microbatch(body)
            tail = [Op(OpKind.OPT_STEP, v, deps=reductions[v]) for v in order]
            tail += [Op(OpKind.GATHER_PARAMS, v, deps=(op_id(OpKind.OPT_STEP, v, None),)) for v in order]
            programs.append(tuple(body + tail))
            continue
        if overlap:
            body = _reduce_after_last_backward(body)
        head = _first_forward_gathers(body) if gather_first else []
        tail = [] if overlap else [Op(OpKind.REDUCE_GRAD, v) for v in order]
        for v in order:
            tail.append(Op(OpKind.OPT_STEP, v, deps=(op_id(OpKind.REDUCE_GRAD, v, None),)))
            if zero and not gather_first:
                tail.append(Op(OpKind.GATHER_PARAMS, v, deps=(op_id(OpKind.OPT_STEP, v, None),)))
        # The last backward of each vstage is what its reduction waits for: with everything the rank did before the
        # tail in program order, the compute stream has finished it when the REDUCE_GRAD is issued; the dep makes
        # the same true for the executor, which issues collectives asynchronously.
        # (A weight gradient is complete when its B or W ends: the tensor-parallel collective after a B reduces the
        # input gradient only.)
        last_grad = {op.vstage: op_id(op.kind, op.vstage, op.mb) for op in body if op.kind in WEIGHT_GRADIENT_KINDS}
        tail = [Op(op.kind, op.vstage, deps=(last_grad[op.vstage],)) if op.kind is OpKind.REDUCE_GRAD else op
                for op in tail]
        programs.append(tuple(head + body + tail))
    return plan.with_programs(tuple(programs), level="L1")


def _first_forward_gathers(body: list[Op]) -> list[Op]:
    """A GATHER_PARAMS per vstage of ``body`` in the order of their first forwards; ``body``'s first forward of each
    vstage is given a dependency on it, in place."""
    first_forward: dict[int, int] = {}
    for i, op in enumerate(body):
        if op.kind is OpKind.F:
            first_forward.setdefault(op.vstage, i)
    for vstage, i in first_forward.items():
        op = body[i]
        body[i] = Op(op.kind, op.vstage, op.mb, op.peer, op.pair, (*op.deps, op_id(OpKind.GATHER_PARAMS, vstage, None)))
    return [Op(OpKind.GATHER_PARAMS, v) for v in sorted(first_forward, key=first_forward.__getitem__)]


def _add_fsdp_per_step(plan: Plan) -> Plan:
    """ZeRO-3 under a pipeline, parameters kept (module docstring): per vstage a GATHER_PARAMS at the program's
    start that its first forward waits for, a REDUCE_GRAD (the reduce-scatter) right after its last backward op, and
    the updates last, each waiting for its vstage's reduction."""
    programs = []
    for program in plan.programs:
        body = [op for op in program if op.kind is not OpKind.OPT_STEP]
        order = sorted({op.vstage for op in program if op.kind is OpKind.OPT_STEP})[::-1]
        gathers = _first_forward_gathers(body)
        body = _reduce_after_last_backward(body)
        tail = [Op(OpKind.OPT_STEP, v, deps=(op_id(OpKind.REDUCE_GRAD, v, None),)) for v in order]
        programs.append(tuple(gathers + body + tail))
    return plan.with_programs(tuple(programs), level="L1")


def _add_stash_reductions(plan: Plan) -> Plan:
    """PipeDream with replicated stages (Narayanan et al., SOSP'19 §3.2): every update of a stage is preceded by the
    all-reduce of that microbatch's gradient across the stage's replicas, so the replicas keep one weight version
    sequence; a REDUCE_GRAD of (vstage, mb) before each OPT_STEP of (vstage, mb), which waits for it."""
    programs = []
    for program in plan.programs:
        out: list[Op] = []
        producer: dict[tuple[int, int | None], str] = {}
        for op in program:
            if op.kind in WEIGHT_GRADIENT_KINDS:
                producer[(op.vstage, op.mb)] = op_id(op.kind, op.vstage, op.mb)
            if op.kind is OpKind.OPT_STEP:
                reduce = Op(OpKind.REDUCE_GRAD, op.vstage, op.mb, deps=(producer[(op.vstage, op.mb)],))
                out.append(reduce)
                op = Op(op.kind, op.vstage, op.mb, op.peer, op.pair, (*op.deps, reduce.id))
            out.append(op)
        programs.append(tuple(out))
    return plan.with_programs(tuple(programs), level="L1")


def _after_collective(body: list[Op], i: int) -> int:
    """Where to put what follows ``body[i]``: after its tensor-parallel collective when one reports it (a compute op
    and its TP op stay adjacent: the executor runs the TP op's collective inside the compute op)."""
    op = body[i]
    following = body[i + 1] if i + 1 < len(body) else None
    if following is not None and following.kind is _TP_AFTER.get(op.kind) and (following.vstage, following.mb) == \
            (op.vstage, op.mb):
        return i + 1
    return i


def _reduce_each_microbatch(body: list[Op]) -> tuple[list[Op], dict[int, tuple[str, ...]]]:
    """ZeRO-2: a REDUCE_GRAD of (vstage, mb) right after the last op that makes that microbatch's weight gradients
    of the vstage (its B, or its W when split; after its TP collective), waiting for it; and, per vstage, the ids of
    its reductions."""
    last = {(op.vstage, op.mb): i for i, op in enumerate(body) if op.kind in WEIGHT_GRADIENT_KINDS}
    after = {_after_collective(body, i): body[i] for i in last.values()}
    out: list[Op] = []
    reductions: dict[int, tuple[str, ...]] = {}
    for i, op in enumerate(body):
        out.append(op)
        if i in after:
            grad = after[i]
            reduce = Op(OpKind.REDUCE_GRAD, grad.vstage, grad.mb, deps=(op_id(grad.kind, grad.vstage, grad.mb),))
            out.append(reduce)
            reductions[grad.vstage] = (*reductions.get(grad.vstage, ()), reduce.id)
    return out, reductions


def _reduce_after_last_backward(body: list[Op]) -> list[Op]:
    """A REDUCE_GRAD right after the last op that produces each vstage's weight gradients (B, or W when split; after
    its TP collective)."""
    last = {op.vstage: i for i, op in enumerate(body) if op.kind in WEIGHT_GRADIENT_KINDS}
    after = {_after_collective(body, i): body[i] for i in last.values()}
    out: list[Op] = []
    for i, op in enumerate(body):
        out.append(op)
        if i in after:
            grad = after[i]
            out.append(Op(OpKind.REDUCE_GRAD, grad.vstage, deps=(op_id(grad.kind, grad.vstage, grad.mb),)))
    return out
