"""The L1 interpreter: one rank walks its program and runs every op for real (DESIGN §7).

The semantics are the simulator's (``sim.engine.simpy_engine``), op for op, so a measured trace and a simulated one
describe the same thing:

* The walker runs its program in order. Compute ops (F, B, OPT_STEP) block it; before one starts, every receive in
  its ``deps`` is waited on. Dependencies on local ops are already met by program order (``sim.plan.lower`` only ever
  points a local dep backwards), so only receives need waiting.
* SEND_* and RECV_* are ``torch.distributed.isend``/``irecv`` and do not block the walker. Their handles are kept in
  a table keyed by op id; the consumer's deps name the RECV, so the consumer waits on exactly the handle it needs.
  Sends are waited on at the end of the iteration (their tensors are kept alive until then). ``sim.plan.validate``
  guarantees the sends on each channel are posted in the order the receives are, which is how point-to-point
  transports (gloo, NCCL) match messages.
* Adjacent vstages on the same rank hand their tensors over in memory; the lowering gives them a dep and no message.
* The last vstage's F applies the loss; its B back-propagates from it divided by the number of microbatches, so
  the accumulated gradient is the mean over the iteration's samples, like single-process training on the whole
  batch (GPipe, Huang et al. 2019 §2.2: gradients are accumulated over micro-batches and applied once).
* I and W split the backward (zero-bubble schedules): I computes the input gradient and every gradient except the
  weights of linear and conv layers, which W computes later (``executor.nn.split_backward``).
* Recomputation (``--recompute``, ``executor.recompute``): the F of a microbatch with an R keeps only each layer's
  input; its backward rebuilds one layer at a time and back-propagates through it. The R op, right before that
  backward, does nothing itself; its span is drawn as the backward's rebuild time, placed before the backward's span
  (which is shortened by as much), as the simulator draws R then B.
* OPT_STEP steps the vstage's own optimizer and clears its gradients: once per iteration under the flush policy
  (GPipe, 1F1B); after every microbatch under weight stashing (async PipeDream, ``executor.stash``), where F and its
  backward run on the weight version stashed for the microbatch and the update lands on the latest weights; and
  after every backward in a PARTIME stream (``executor.partime.partime_interpreter``), whose backward runs through the
  stage's current forward rather than the frame's own.
* 3D plans (``executor.parallel``): every process of pipeline rank p runs ``plan.programs[p]``, and a SEND/RECV's
  ``peer`` (a pipeline rank) is the process of that pipeline rank in the same replica and tensor shard.
* TP_F, TP_B, TP_R: the tensor-parallel collectives really run inside the forward, backward and recompute, where the
  sharded layers' autograd functions put them (``executor.nn.tensor_parallel``), timed call by call. The handler
  itself does nothing; its span is the time the preceding F, B/I or R spent inside collectives, placed right after
  that op's span, which is shortened by as much, so the two spans tile the time the op took.
* EP_F, EP_B, EP_R: expert parallelism's all-to-alls (token dispatch and combine, ``executor.nn.expert_parallel``)
  run inside the forward, backward and recompute of the mixtures, timed on the expert-parallel group's clock, and
  are drawn as TP's are. A process runs one of the two dimensions at most (the executor splits mixtures by expert,
  not by tensor).
* REDUCE_GRAD and GATHER_PARAMS (data parallelism, ``executor.data_parallel``) are issued asynchronously like a
  receive: the OPT_STEP that depends on a REDUCE_GRAD waits for it (its span ends when that wait returns and the
  mean gradient is in place), and a GATHER_PARAMS, which nothing depends on, is waited for at the iteration's end.
  Under ZeRO-3 gathered once per step (``executor.fsdp``) they are the step's all-gather of a vstage, which its first
  forward waits for (a dep, like a receive), and its one reduce-scatter, which its OPT_STEP waits for.
* ``--slowdown``: a slowed process sleeps after each compute op for (factor − 1) × its duration, inside the op's
  span (``executor.slowdown``).

Every op runs inside ``torch.profiler.record_function(op.id)``, so a PyTorch profiler trace of a run names the IR ops.
An op kind with no handler is rejected by :func:`check_supported` before anything runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from executor.nn.split_backward import WeightGradStore, enable_split_backward
from executor.nn.stages import Stage, TensorSpec
from executor.recompute import Layer, RebuildTime, checkpointed_forward, rebuild_and_backward
from executor.slowdown import stretch
from executor.stash import StashedWeights
from sim.ir.ops import (
    DP_KINDS,
    EP_KINDS,
    INPUT_GRADIENT_KINDS,
    OP_SEMANTICS,
    TP_KINDS,
    Action,
    Op,
    OpKind,
    collective_after,
    op_id,
)
from sim.ir.plan import Plan
from sim.plan.validate import PlanError

__all__ = ["HANDLED_KINDS", "check_supported", "OpRecord", "RankInterpreter", "OpFailure"]

#: The method of :class:`RankInterpreter` that runs each op kind. Compute kinds each have their own (a forward is not
#: a backward); every other action (``sim.ir.ops.OP_SEMANTICS``) has one method for all its kinds but the
#: data-parallel collectives, which differ in what they complete. Host copies (PREFETCH, EVICT) run only in CSP plans,
#: whose executor is ``executor.csp``; a fixed program with them is refused.
_COMPUTE_METHODS = {OpKind.F: "_forward", OpKind.B: "_backward", OpKind.I: "_backward_input",
                    OpKind.W: "_backward_weight", OpKind.R: "_recompute", OpKind.OPT_STEP: "_optimizer_step",
                    OpKind.REDUCE_GRAD: "_reduce_grad", OpKind.GATHER_PARAMS: "_gather_params"}
_ACTION_METHODS = {Action.SEND: "_send", Action.RECV: "_recv", Action.TP_COLLECTIVE: "_nothing",
                   Action.EP_COLLECTIVE: "_nothing"}
HANDLER_OF: dict[OpKind, str] = {
    kind: _COMPUTE_METHODS.get(kind) or _ACTION_METHODS[semantics.action]
    for kind, semantics in OP_SEMANTICS.items()
    if kind in _COMPUTE_METHODS or semantics.action in _ACTION_METHODS
}
#: The op kinds this interpreter can run (those with a method in :data:`HANDLER_OF`).
HANDLED_KINDS = frozenset(HANDLER_OF)
#: The op kinds that report collectives run inside the compute op before them.
_INSIDE_KINDS = TP_KINDS | EP_KINDS
#: The compute kinds whose model-parallel collectives each TP or EP kind reports (``OpSemantics.follows``).
_COLLECTIVE_SOURCE = {kind: OP_SEMANTICS[kind].follows for kind in _INSIDE_KINDS}
#: The collectives a recompute's rebuild runs, which the interpreter draws after the R: its TP and its EP kind.
_AFTER_RECOMPUTE = tuple(collective_after(action)[OpKind.R] for action in (Action.TP_COLLECTIVE, Action.EP_COLLECTIVE))


def check_supported(plan: Plan) -> None:
    """Reject a plan the executor cannot run, before anything is launched.

    Raises:
        PlanError: the plan is not lowered, its weight policy is not one it runs, or it uses an op kind with no handler
            (the message lists the kinds and the first op of each).
    """
    if plan.level != "L1":
        raise PlanError(f"the executor runs lowered (L1) plans, got level {plan.level}")
    if plan.weight_policy not in ("flush", "stash", "stream"):
        raise PlanError(f"the executor runs weight policies flush, stash and stream, not {plan.weight_policy!r}")
    first: dict[str, str] = {}
    for program in plan.programs:
        for op in program:
            if op.kind not in HANDLER_OF:
                first.setdefault(op.kind.value, op.id)
    if first:
        listed = ", ".join(f"{kind} (first: {op_id})" for kind, op_id in sorted(first.items()))
        raise PlanError(f"the executor has no handler for op kind(s) {listed}; it runs "
                        f"{', '.join(sorted(k.value for k in HANDLER_OF))}")


class OpFailure(RuntimeError):
    """An op raised; carries the op id so every rank's report can name it.

    Attributes:
        op_id: the failing op's id, e.g. ``"1B3"``.
    """

    def __init__(self, op_id: str, cause: BaseException) -> None:
        super().__init__(f"op {op_id} failed: {type(cause).__name__}: {cause}")
        self.op_id = op_id


@dataclass(frozen=True)
class OpRecord:
    """When one op ran on this rank, on this rank's clock (``time.perf_counter``, s).

    For compute ops ``start``/``end`` bracket the work. For a SEND, ``start`` is when it was posted and ``end`` when
    its handle completed (checked at the end of the iteration, so an upper bound). For a RECV, ``start`` is when it
    was posted and ``end`` when the consumer's wait returned, i.e. when the data was there.
    """

    op: Op
    start: float
    end: float


class RankInterpreter:
    """Runs one rank's program for one iteration at a time.

    Args:
        plan: the validated L1 plan (``check_supported`` has passed).
        rank: this process's rank; it runs ``plan.programs[rank]``.
        stages: vstage → its :class:`Stage` module, for every vstage on this rank.
        optimizers: vstage → the optimizer over that stage's parameters.
        loss: ``(last layer's output, targets) -> scalar``; used by the last vstage.
        boundary: vstage v → :class:`TensorSpec` of its input (what RECV_F of v receives; RECV_B of v receives the
            spec of v + 1's input, v's output).
        device: where the stages live; on CUDA every op is synchronised before its end time is taken, so spans
            are the op's real duration rather than its launch time.
        fail_at: op id at which to raise an injected error (failure-handling tests); ``None`` in real runs.
        group: the process group for point-to-point ops (``None``: the default group).
        peer_of: pipeline rank → the rank in ``group`` to exchange with (default: the same number).
        tp_comm: the tensor-parallel group's clock (``take_seconds()``), needed when the program has TP ops.
        ep_comm: the expert-parallel group's clock, needed when the program has EP ops (a process has one of the two
            at most: the executor runs expert parallelism in models it does not split by tensor).
        data_parallel: the process's :class:`executor.data_parallel.DataParallel` (or, under ZeRO-3 gathered once
            per step, its :class:`executor.fsdp.FullyShardedStages`), needed for REDUCE_GRAD and GATHER_PARAMS.
        slowdown: the factor by which this process stretches its compute ops (``executor.slowdown``; 1: none).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        stages: Mapping[int, Stage],
        optimizers: Mapping[int, torch.optim.Optimizer],
        loss: Callable[[Tensor, Tensor], Tensor],
        boundary: Mapping[int, TensorSpec],
        *,
        device: torch.device | None = None,
        fail_at: str | None = None,
        group: Any = None,
        peer_of: Callable[[int], int] | None = None,
        tp_comm: Any = None,
        ep_comm: Any = None,
        data_parallel: Any = None,
        slowdown: float = 1.0,
    ) -> None:
        self.plan, self.rank, self.stages, self.optimizers = plan, rank, stages, optimizers
        self.loss, self.boundary, self.fail_at, self.group = loss, boundary, fail_at, group
        self.peer_of = peer_of or (lambda peer: peer)
        self.tp_comm, self.ep_comm, self.data_parallel, self.slowdown = tp_comm, ep_comm, data_parallel, slowdown
        if tp_comm is not None and ep_comm is not None:
            raise PlanError(f"rank {rank}: tensor- and expert-parallel collectives in one process are not run")
        # The clock of the collectives that run inside compute ops (one dimension's at most; see ep_comm).
        self.collective_clock = tp_comm if tp_comm is not None else ep_comm
        self.device = device or torch.device("cpu")
        self._sync: Callable[[], None] = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.program = plan.programs[rank]
        self.last_vstage = plan.num_vstages - 1
        missing = sorted({op.kind.value for op in self.program if op.kind not in HANDLER_OF})
        if missing:
            raise PlanError(f"rank {rank}: no handler for op kind(s) {', '.join(missing)}")
        self.handlers: dict[OpKind, Callable[[Op], None]] = {
            kind: getattr(self, method) for kind, method in HANDLER_OF.items()}
        self._check_collectives()
        self.recomputed = self._recomputed_pairs()
        self._check_recompute()
        self.rebuilt: dict[str, RebuildTime] = {}  # backward op id -> its rebuild's seconds, until drawn
        self.weight_grads = WeightGradStore()
        for v in sorted({op.vstage for op in self.program if op.kind is OpKind.I}):
            enable_split_backward(stages[v], self.weight_grads)
        self.stashing = StashedWeights(plan, rank, stages) if plan.weight_policy == "stash" else None
        # Flush: the iteration's microbatches form one minibatch, so each contributes 1/m of the gradient. Stash:
        # each microbatch is PipeDream's minibatch and is applied on its own.
        self.loss_scale = plan.num_microbatches if self.stashing is None else 1

    def _check_collectives(self) -> None:
        """Each TP or EP op right after the compute op whose collectives it reports (``sim.plan.lower_collectives``
        puts it there), and the group or replicas the collective ops need."""
        kinds = {op.kind for op in self.program}
        if kinds & TP_KINDS and self.tp_comm is None:
            raise PlanError(f"rank {self.rank}: the program has tensor-parallel ops but no tensor-parallel group")
        if kinds & EP_KINDS and self.ep_comm is None:
            raise PlanError(f"rank {self.rank}: the program has expert-parallel ops but no expert-parallel group")
        if kinds & DP_KINDS and self.data_parallel is None:
            raise PlanError(f"rank {self.rank}: the program has data-parallel ops but no data-parallel group")
        for before, op in zip((None, *self.program), self.program):
            if op.kind in _INSIDE_KINDS and (before is None or before.kind not in _COLLECTIVE_SOURCE[op.kind]
                                        or (before.vstage, before.mb) != (op.vstage, op.mb)):
                raise PlanError(f"rank {self.rank}: {op.id} must follow the compute op it reports")

    def _recomputed_pairs(self) -> set[tuple[int, int]]:
        """(vstage, mb) whose forward keeps only each layer's input, rebuilt layer by layer in the backward."""
        return {(op.vstage, op.mb) for op in self.program if op.kind is OpKind.R}  # type: ignore[misc]

    def _check_recompute(self) -> None:
        """Each R right before the backward of its microbatch (its TP_R or EP_R between them): the rebuild runs inside
        that backward (``executor.recompute``), so an R anywhere else would be drawn where it did not run."""
        for pos, op in enumerate(self.program):
            if op.kind is not OpKind.R or (op.vstage, op.mb) not in self.recomputed:
                continue
            following = self.program[pos + 1:pos + 3]
            backward = next((o for o in following if o.kind not in _INSIDE_KINDS), None)
            if backward is None or backward.kind not in INPUT_GRADIENT_KINDS or (
                    backward.vstage, backward.mb) != (op.vstage, op.mb):
                raise PlanError(f"rank {self.rank}: {op.id} must come right before the backward (B or I) of "
                                f"vstage {op.vstage} microbatch {op.mb}")

    # --- one iteration ---------------------------------------------------------------------------------------------

    def run_iteration(self, inputs: Sequence[Tensor] | None, targets: Sequence[Tensor] | None
                      ) -> tuple[list[OpRecord], list[float]]:
        """Run the program once.

        Args:
            inputs: per microbatch, the model input (needed on the rank of vstage 0, else ``None``).
            targets: per microbatch, the loss targets (needed on the rank of the last vstage, else ``None``).

        Returns:
            The op records in program order, and the per-microbatch loss values (empty unless this rank runs the
            last vstage), in microbatch order.

        Raises:
            OpFailure: an op raised; the message names it.
        """
        self.inputs, self.targets = inputs, targets
        if self.stashing is not None:
            self.stashing.begin_iteration()
        self.activations: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}  # (v, mb) -> (input, output)
        self.checkpoints: dict[tuple[int, int], list[Tensor | None]] = {}  # recomputed (v, mb) -> each layer's input
        self.losses: dict[int, Tensor] = {}
        self.outbox: dict[tuple[OpKind, int, int], Tensor] = {}  # produced tensors: (F|B, v, mb) -> tensor
        self.inbox: dict[str, Tensor] = {}  # RECV op id -> its buffer (valid once waited on)
        self.pending: dict[str, Any] = {}  # op id -> irecv or collective work handle
        self.sent: list[tuple[Op, Any, Tensor]] = []
        self.records: dict[str, list[float]] = {}
        self.after_wait: dict[str, Callable[[], None]] = {}  # op id -> what completes it once its handle is waited on
        if self.collective_clock is not None:
            self.collective_clock.take_seconds()  # whatever ran before this iteration is not its ops'
        previous: tuple[str, float] | None = None  # the last op's id and its seconds inside TP or EP collectives
        for op in self.program:
            try:
                if op.id == self.fail_at:
                    raise RuntimeError(f"injected failure at {op.id} (--inject-failure)")
                with torch.profiler.record_function(op.id):
                    # Waiting for inputs is not part of the op: the simulator starts an op once its deps are done.
                    self._wait_receives(op)
                    start = time.perf_counter()
                    self.handlers[op.kind](op)
                    self._sync()
                    end = time.perf_counter()
                    # Seconds this op spent inside model-parallel collectives (only F, B, I and R run any).
                    spent = self.collective_clock.take_seconds() if self.collective_clock is not None else 0.0
                    rebuilt = self.rebuilt.pop(op.id, None)
                    if rebuilt is not None:  # a backward that rebuilt its layers: its collectives are all the op's
                        spent += rebuilt.rebuild_collective_s + rebuilt.backward_collective_s
                    end = stretch(op.kind, self.slowdown, start, end, spent)  # --slowdown; else returns end
            except OpFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - any error in an op is reported with the op's id
                raise OpFailure(op.id, exc) from exc
            if rebuilt is not None:
                start = self._draw_rebuild(op, rebuilt, start)
                spent = rebuilt.backward_collective_s
            if op.kind in _INSIDE_KINDS:  # the collectives ran inside the compute op before it: split its span
                assert previous is not None  # _check_collectives
                compute = self.records[previous[0]]
                cut = max(compute[0], compute[1] - previous[1])
                start, end = cut, compute[1]
                compute[1] = cut
            self.records[op.id] = [start, end]
            previous = (op.id, spent)
        # A receive nobody consumed, and a GATHER_PARAMS, must complete before the next iteration.
        for pending_id in list(self.pending):
            try:
                self._wait(pending_id)
            except Exception as exc:  # noqa: BLE001
                raise OpFailure(pending_id, exc) from exc
        for op, work, _tensor in self.sent:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001
                raise OpFailure(op.id, exc) from exc
            self.records[op.id][1] = time.perf_counter()
        records = [OpRecord(op, *self.records[op.id]) for op in self.program]
        losses = [float(self.losses[mb]) for mb in sorted(self.losses)]
        return records, losses

    def _draw_rebuild(self, op: Op, rebuilt: RebuildTime, start: float) -> float:
        """Give the R (and its TP_R) before backward ``op`` the rebuild's time, taken from the start of the backward's
        span; returns the backward's new start (s). A slowed rank's rebuild is stretched as its backward was."""
        compute_s = max(0.0, rebuilt.rebuild_s - rebuilt.rebuild_collective_s) * self.slowdown
        recompute = self.records[op_id(OpKind.R, op.vstage, op.mb)]
        recompute[1] = start + compute_s
        collectives = None
        for kind in _AFTER_RECOMPUTE:  # its TP op, else its EP op
            collectives = collectives or self.records.get(op_id(kind, op.vstage, op.mb))
        if collectives is not None:
            collectives[0], collectives[1] = recompute[1], recompute[1] + rebuilt.rebuild_collective_s
            return collectives[1]
        return recompute[1]

    # --- handlers --------------------------------------------------------------------------------------------------

    def _wait_receives(self, op: Op) -> None:
        for dep in op.deps:
            if dep in self.pending:
                self._wait(dep)

    def _wait(self, op_id: str) -> None:
        self.pending.pop(op_id).wait()
        self._sync()  # NCCL's wait only orders streams; the data is there once the device has caught up
        complete = self.after_wait.pop(op_id, None)
        if complete is not None:
            complete()
        self.records[op_id][1] = time.perf_counter()

    def _forward(self, op: Op) -> None:
        v, mb = op.vstage, op.mb
        assert mb is not None
        if v == 0:
            assert self.inputs is not None, "rank runs vstage 0 but was given no inputs"
            x = self.inputs[mb]
        else:
            x = self._incoming(OpKind.F, v - 1, mb, op).requires_grad_(True)
        if v == self.last_vstage:
            assert self.targets is not None, "rank runs the last vstage but was given no targets"
        if (v, mb) in self.recomputed:
            # Only each layer's input is kept (the checkpoints); the backward rebuilds them (executor.recompute).
            y, self.checkpoints[(v, mb)] = checkpointed_forward(self._layers(v, mb, first=True), x)
            if v == self.last_vstage:
                with torch.no_grad():
                    self.losses[mb] = self.loss(y, self.targets[mb])  # type: ignore[index]
            kept = None
        else:
            y = self._stage_forward(v, mb, x, first=True)
            if v == self.last_vstage:
                self.losses[mb] = self.loss(y, self.targets[mb])  # type: ignore[index]
            # The last vstage's backward starts from the loss: keeping its output (the logits) too would hold a
            # tensor autograd itself may not need (cross entropy saves its log-softmax, not its input).
            kept = self.losses[mb] if v == self.last_vstage else y
        if v != self.last_vstage:
            self.outbox[(OpKind.F, v, mb)] = y.detach()
        self.activations[(v, mb)] = (x, kept)

    def _recompute(self, op: Op) -> None:
        """R: nothing here; the backward right after it rebuilds layer by layer and reports the time (module
        docstring), which ``run_iteration`` draws as this op's span."""

    def _backward_input(self, op: Op) -> None:
        """I: the backward with the weight gradients of linear and conv layers deferred to the W op."""
        assert op.mb is not None
        self.weight_grads.begin((op.vstage, op.mb))
        try:
            self._backward(op)
        finally:
            self.weight_grads.end()

    def _backward_weight(self, op: Op) -> None:
        """W: the deferred weight gradients of the I op of the same (vstage, mb)."""
        assert op.mb is not None
        self.weight_grads.flush((op.vstage, op.mb))

    def _backward(self, op: Op) -> None:
        v, mb = op.vstage, op.mb
        assert mb is not None
        if (v, mb) in self.recomputed:
            self._rebuild_and_backward(op)
            return
        x, y = self.activations.pop(self._forward_of(v, mb))
        assert y is not None, f"{op.id}: the forward kept no activations"
        if v == self.last_vstage:
            (self.losses[mb] / self.loss_scale).backward()
            self.losses[mb] = self.losses[mb].detach()
        else:
            torch.autograd.backward(y, self._incoming(OpKind.B, v + 1, mb, op))
        if v > 0:
            assert x.grad is not None
            self.outbox[(OpKind.B, v, mb)] = x.grad

    def _rebuild_and_backward(self, op: Op) -> None:
        """The backward of a recomputed microbatch: each layer rebuilt from its checkpoint right before its own
        backward (``executor.recompute``); the rebuild's seconds are kept for ``run_iteration`` to draw as the R."""
        v, mb = op.vstage, op.mb
        assert mb is not None
        self.activations.pop((v, mb))
        head = None
        output_gradient: Tensor | None = None
        if v == self.last_vstage:
            targets = self.targets[mb]  # type: ignore[index]
            head = lambda y: self.loss(y, targets) / self.loss_scale  # noqa: E731 - bound to this microbatch
        else:
            output_gradient = self._incoming(OpKind.B, v + 1, mb, op)
        input_gradient, self.rebuilt[op.id] = rebuild_and_backward(
            self._layers(v, mb, first=False), self.checkpoints.pop((v, mb)), output_gradient, head=head,
            sync=self._sync, take_collective_seconds=self.collective_clock.take_seconds
            if self.collective_clock is not None else lambda: 0.0)
        if v > 0:
            assert input_gradient is not None
            self.outbox[(OpKind.B, v, mb)] = input_gradient

    def _layers(self, v: int, mb: int, *, first: bool) -> list[Layer]:
        """The stage's layers as callables: the live modules, or (weight stashing) each bound to the version stashed
        for ``mb``, as :meth:`_stage_forward` runs the whole stage."""
        stage = self.stages[v]
        if self.stashing is None:
            return list(stage.layers.values())
        weights = self.stashing.weights_for(v, mb, first=first)
        layers: list[Layer] = []
        for name, module in stage.layers.items():
            prefix = f"layers.{name}."
            own = {key[len(prefix):]: tensor for key, tensor in weights.items() if key.startswith(prefix)}
            layers.append(lambda x, module=module, own=own: torch.func.functional_call(module, own, (x,)))
        return layers

    def _forward_of(self, v: int, mb: int) -> tuple[int, int]:
        """Whose forward the backward of (v, mb) runs through: its own (a stream's:
        ``executor.partime.partime_interpreter``)."""
        return v, mb

    def _incoming(self, kind: OpKind, producer: int, mb: int, op: Op) -> Tensor:
        """The tensor ``op`` consumes: from the RECV in its deps, or from a same-rank producer's outbox."""
        for dep in op.deps:
            if dep in self.inbox:
                return self.inbox.pop(dep)
        return self.outbox.pop((kind, producer, mb))

    def _stage_forward(self, v: int, mb: int, x: Tensor, *, first: bool) -> Tensor:
        """The stage's forward: with the live weights, or (weight stashing) with the version stashed for ``mb``."""
        if self.stashing is None:
            return self.stages[v](x)
        return torch.func.functional_call(self.stages[v], self.stashing.weights_for(v, mb, first=first), (x,))

    def _optimizer_step(self, op: Op) -> None:
        optimizer = self.optimizers[op.vstage]
        if self.stashing is not None:
            assert op.mb is not None
            self.stashing.move_gradients(op.vstage, op.mb)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.stashing is not None:
            self.stashing.updated(op.vstage)

    def _nothing(self, op: Op) -> None:
        """TP_* and EP_*: their collectives already ran inside the op before (module docstring)."""

    def _reduce_grad(self, op: Op) -> None:
        self.pending[op.id], self.after_wait[op.id] = self.data_parallel.reduce(op.vstage)

    def _gather_params(self, op: Op) -> None:
        self.pending[op.id], self.after_wait[op.id] = self.data_parallel.gather(op.vstage)

    def _send(self, op: Op) -> None:
        assert op.mb is not None and op.peer is not None
        kind = OpKind.F if op.kind is OpKind.SEND_F else OpKind.B
        tensor = self.outbox.pop((kind, op.vstage, op.mb)).contiguous()
        work = dist.isend(tensor, dst=self.peer_of(op.peer), group=self.group)
        self.sent.append((op, work, tensor))

    def _recv(self, op: Op) -> None:
        assert op.mb is not None and op.peer is not None
        # RECV_F of v receives v's input; RECV_B of v receives the gradient of v's output, i.e. of v + 1's input.
        spec = self.boundary[op.vstage if op.kind is OpKind.RECV_F else op.vstage + 1]
        buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        self.inbox[op.id] = buffer
        self.pending[op.id] = dist.irecv(buffer, src=self.peer_of(op.peer), group=self.group)
