"""Op kinds, their streams and the op record of the schedule IR (DESIGN §3); :mod:`sim.ir.plan` holds the plan.

An op is identified by ``(kind, vstage, mb)`` and prints in the action syntax of PyTorch's
``torch.distributed.pipelining``: ``2F0`` is the forward of virtual stage 2 on microbatch 0, ``3SEND_F1`` sends the
output of stage 3's forward of microbatch 1, ``0OPT_STEP`` is the optimizer step of stage 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sim.core.errors import SpecError

__all__ = ["OpKind", "Op", "Action", "MemoryEffect", "OpSemantics", "OP_SEMANTICS", "kinds_of", "handled_kinds",
           "SCHEDULED_KINDS", "COMPUTE_KINDS", "SEND_KINDS", "RECV_KINDS", "COPY_KINDS", "TP_KINDS", "EP_KINDS",
           "DP_KINDS", "INPUT_GRADIENT_KINDS", "WEIGHT_GRADIENT_KINDS", "SPLIT_BACKWARD_KINDS", "collective_after",
           "message_kinds", "stream_of", "op_id"]


class OpKind(StrEnum):
    """What an op does. The value is its spelling in the string notation."""

    F = "F"  # forward of (vstage, mb); the last stage's F includes the loss
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741 - backward w.r.t. inputs only (zero-bubble)
    W = "W"  # backward w.r.t. weights only (zero-bubble)
    R = "R"  # recompute of a forward before its backward (activation checkpointing)
    SEND_F = "SEND_F"  # send vstage's forward output to the next vstage's rank
    RECV_F = "RECV_F"  # receive vstage's forward input from the previous vstage's rank
    SEND_B = "SEND_B"  # send vstage's input gradient to the previous vstage's rank
    RECV_B = "RECV_B"  # receive vstage's output gradient from the next vstage's rank
    PREFETCH = "PREFETCH"  # host → device copy of a parameter set
    EVICT = "EVICT"  # device → host copy of a parameter set
    OPT_STEP = "OPT_STEP"  # optimizer step of a vstage
    # Tensor-parallel collectives of one (vstage, mb): every all-reduce (or, with sequence parallelism, reduce-scatter
    # and all-gather) of the stage's layers in its forward, backward (B or I) or recompute, run right after that op
    # on the compute stream, which waits for them (Megatron-LM §3: the f and g operators).
    TP_F = "TP_F"
    TP_B = "TP_B"
    TP_R = "TP_R"
    # Expert-parallel all-to-alls of one (vstage, mb): the token dispatch and combine of every MoE layer of the stage in
    # its forward, backward (B or I) or recompute, run after the op (and its TP collectives), the compute stream
    # waiting for them as for the TP ops (Megatron-Core's token dispatcher is synchronous with the layer).
    EP_F = "EP_F"
    EP_B = "EP_B"
    EP_R = "EP_R"
    # Data-parallel gradient all-reduce of a vstage (reduce-scatter under ZeRO-1 and 2, and under ZeRO-3 gathered
    # once per step: its one reduce-scatter of the step, Parallelism.fsdp_gathers_per_step).
    REDUCE_GRAD = "REDUCE_GRAD"
    # ZeRO-1 and 2: all-gather of a vstage's updated parameters after its OPT_STEP; ZeRO-3 gathered once per step:
    # the all-gather its first forward waits for.
    GATHER_PARAMS = "GATHER_PARAMS"


class Action(StrEnum):
    """How an op is carried out, and so which handler of a consumer (engine, validator, fast evaluator, executor)
    runs it. A consumer keeps one handler per action it supports; a kind whose action it has no handler for is
    refused before anything runs."""

    COMPUTE = "compute"  # device compute for the cost view's compute_time(kind, vstage)
    TP_COLLECTIVE = "tp_collective"  # the tensor-parallel collectives of the compute op before it
    SEND = "send"  # one side of a point-to-point transfer: the sender
    RECV = "recv"  # the receiver; the transfer ends both
    HOST_COPY = "host_copy"  # a copy between host and device memory over the rank's PCIe path
    DP_COLLECTIVE = "dp_collective"  # a collective across data-parallel replicas
    EP_COLLECTIVE = "ep_collective"  # the expert-parallel all-to-alls of the compute op before it


class MemoryEffect(StrEnum):
    """What an op does to its device's memory beyond its transient workspace (:attr:`OpSemantics.workspace`). The
    byte counts behind each effect are the memory ledger's (``sim.cost.ledger``), which handles every effect."""

    NONE = "none"
    #: keeps the microbatch's activations (only the checkpoint when the microbatch is recomputed) until its backward
    KEEP_ACTIVATIONS = "keep_activations"
    #: rebuilds the activations a recomputed microbatch did not keep, right before its backward
    REBUILD_ACTIVATIONS = "rebuild_activations"
    #: frees the microbatch's activations (B)
    RELEASE_ACTIVATIONS = "release_activations"
    #: frees the microbatch's activations but keeps what its W needs: the weight GEMMs' inputs and output gradients
    #: (I, zero bubble's split backward)
    DEFER_WEIGHT_GRADIENTS = "defer_weight_gradients"
    #: frees what the microbatch's I kept for it (W)
    RELEASE_DEFERRED = "release_deferred"
    #: the weight update: under weight stashing, retires the version its microbatch ran on and keeps the new one
    UPDATE_WEIGHTS = "update_weights"
    #: brings the stage's weights onto the device (a stage that lives in host memory)
    LOAD_WEIGHTS = "load_weights"
    #: takes the stage's weights off the device again
    UNLOAD_WEIGHTS = "unload_weights"
    #: holds a buffer for the reduction of the stage's gradients from its issue until the update that waits for it
    #: (where the framework reduces a flat copy; none where it reduces in place)
    HOLD_REDUCTION_BUFFER = "hold_reduction_buffer"


@dataclass(frozen=True)
class OpSemantics:
    """What one op kind means, the one definition every consumer reads (DESIGN §6).

    Attributes:
        action: how the op is carried out (which handler runs it).
        stream: the stream its span is drawn on: ``compute``, ``tp``, ``ep``, ``send``, ``recv``, ``h2d``, ``d2h``
            or ``collective``.
        blocks: True when the rank's walker waits for the op's deps, runs it and goes on only once it has finished
            (compute and the tensor- and expert-parallel collectives the compute stream waits for); False when the
            walker issues it and goes on, and it completes on its own stream (transfers, copies, data-parallel
            collectives), awaited by whatever names it in ``deps``.
        scheduled: emitted by the schedule generators (an L0 op, a cell of PyTorch's schedule CSV); the others are
            added by the lowering.
        memory: what it allocates or frees beyond its workspace.
        workspace: it holds its vstage's transient workspace while it runs.
        backward: it is part of a backward pass (B, I, W): its workspace is the backward's, and it writes weight
            gradients, whose buffers exist from the first such op after an update where they are not kept for the
            whole run.
        input_gradient: it makes the stage's input gradient, which SEND_B carries to the previous vstage and which
            the previous vstage's backward waits for (B; I under a split backward). A recompute runs right before
            such an op, and its tensor- and expert-parallel collectives follow it (TP_B, EP_B).
        weight_gradient: it completes the stage's weight gradients, which the gradient reduction and the update wait
            for (B; W under a split backward).
        follows: the compute kinds this op carries on from, right after one of them of the same (vstage, mb): a
            tensor- or expert-parallel kind reports the collectives run inside that op (TP_F and EP_F after F,
            TP_B and EP_B after B or I, TP_R and EP_R after R); a SEND or RECV moves that op's output (``_F``: the
            F's activation; ``_B``: the input gradient of B or I) to the next or previous vstage. Empty otherwise.
        backward_share: for a part of a split backward (I, W), the fraction of the full backward's (B's) time it
            takes; ``None`` otherwise. Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2)
            splits B into I (the input gradient) and W (the weight gradient) and takes them as equally long: for a
            matmul layer each is one GEMM of the forward's size (``dX = dY·Wᵀ``, ``dW = Xᵀ·dY``), so the shares
            are 1/2 each and sum to 1.
    """

    action: Action
    stream: str
    blocks: bool
    scheduled: bool
    memory: MemoryEffect
    workspace: bool
    backward: bool = False
    input_gradient: bool = False
    weight_gradient: bool = False
    follows: tuple[OpKind, ...] = ()
    backward_share: float | None = None

    @property
    def compute(self) -> bool:
        """Whether the op is device compute (costed by ``compute_time``; stretched on a slowed device)."""
        return self.action is Action.COMPUTE


def _compute(memory: MemoryEffect, *, scheduled: bool = True, workspace: bool = True, backward: bool = False,
             input_gradient: bool = False, weight_gradient: bool = False,
             backward_share: float | None = None) -> OpSemantics:
    return OpSemantics(Action.COMPUTE, "compute", True, scheduled, memory, workspace, backward, input_gradient,
                       weight_gradient, backward_share=backward_share)


def _issued(action: Action, stream: str, memory: MemoryEffect = MemoryEffect.NONE, *,
            follows: tuple[OpKind, ...] = ()) -> OpSemantics:
    return OpSemantics(action, stream, False, False, memory, False, follows=follows)


def _tp(*follows: OpKind) -> OpSemantics:
    return OpSemantics(Action.TP_COLLECTIVE, "tp", True, False, MemoryEffect.NONE, False, follows=follows)


def _ep(*follows: OpKind) -> OpSemantics:
    return OpSemantics(Action.EP_COLLECTIVE, "ep", True, False, MemoryEffect.NONE, False, follows=follows)


#: The input-gradient half of zero bubble's split backward and the weight-gradient half: equal (OpSemantics'
#: ``backward_share``).
_HALF_A_BACKWARD = 0.5

#: The semantics of every op kind. A new kind is added here (and to :class:`OpKind`); a consumer that has no
#: handler for its action refuses it by name.
OP_SEMANTICS: dict[OpKind, OpSemantics] = {
    OpKind.F: _compute(MemoryEffect.KEEP_ACTIVATIONS),
    OpKind.B: _compute(MemoryEffect.RELEASE_ACTIVATIONS, backward=True, input_gradient=True, weight_gradient=True),
    OpKind.I: _compute(MemoryEffect.DEFER_WEIGHT_GRADIENTS, backward=True, input_gradient=True,
                       backward_share=_HALF_A_BACKWARD),
    OpKind.W: _compute(MemoryEffect.RELEASE_DEFERRED, backward=True, weight_gradient=True,
                       backward_share=_HALF_A_BACKWARD),
    OpKind.R: _compute(MemoryEffect.REBUILD_ACTIVATIONS),
    OpKind.OPT_STEP: _compute(MemoryEffect.UPDATE_WEIGHTS, scheduled=False, workspace=False),
    OpKind.SEND_F: _issued(Action.SEND, "send", follows=(OpKind.F,)),
    OpKind.SEND_B: _issued(Action.SEND, "send", follows=(OpKind.B, OpKind.I)),
    OpKind.RECV_F: _issued(Action.RECV, "recv", follows=(OpKind.F,)),
    OpKind.RECV_B: _issued(Action.RECV, "recv", follows=(OpKind.B, OpKind.I)),
    OpKind.PREFETCH: _issued(Action.HOST_COPY, "h2d", MemoryEffect.LOAD_WEIGHTS),
    OpKind.EVICT: _issued(Action.HOST_COPY, "d2h", MemoryEffect.UNLOAD_WEIGHTS),
    OpKind.TP_F: _tp(OpKind.F),
    OpKind.TP_B: _tp(OpKind.B, OpKind.I),
    OpKind.TP_R: _tp(OpKind.R),
    OpKind.EP_F: _ep(OpKind.F),
    OpKind.EP_B: _ep(OpKind.B, OpKind.I),
    OpKind.EP_R: _ep(OpKind.R),
    OpKind.REDUCE_GRAD: _issued(Action.DP_COLLECTIVE, "collective", MemoryEffect.HOLD_REDUCTION_BUFFER),
    OpKind.GATHER_PARAMS: _issued(Action.DP_COLLECTIVE, "collective"),
}


_MISSING = [kind.value for kind in OpKind if kind not in OP_SEMANTICS]
if _MISSING:  # a kind without semantics would be run by nobody: refuse to import rather than skip it somewhere
    raise ImportError(f"op kind(s) {', '.join(_MISSING)} have no entry in OP_SEMANTICS")

#: An op kind's spelling, looked up once: ``kind.value`` on an enum member costs a property call per id written.
_KIND_TEXT = {kind: kind.value for kind in OpKind}


def kinds_of(action: Action) -> frozenset[OpKind]:
    """Every kind carried out by ``action``."""
    return frozenset(kind for kind, semantics in OP_SEMANTICS.items() if semantics.action is action)


def handled_kinds(actions: Iterable[Action]) -> frozenset[OpKind]:
    """The kinds a consumer with handlers for ``actions`` can run: derive a ``HANDLED_KINDS`` from this, never
    list kinds by hand."""
    supported = frozenset(actions)
    return frozenset(kind for kind, semantics in OP_SEMANTICS.items() if semantics.action in supported)


#: The kinds a schedule generator emits (L0): F, B, I, W, R.
SCHEDULED_KINDS = frozenset(kind for kind, semantics in OP_SEMANTICS.items() if semantics.scheduled)
#: Device compute, the optimizer step included: F, B, I, W, R, OPT_STEP.
COMPUTE_KINDS = kinds_of(Action.COMPUTE)
SEND_KINDS = kinds_of(Action.SEND)
RECV_KINDS = kinds_of(Action.RECV)
COPY_KINDS = kinds_of(Action.HOST_COPY)
TP_KINDS = kinds_of(Action.TP_COLLECTIVE)
#: Expert-parallel all-to-alls: blocking like the TP collectives, on the ``ep`` stream.
EP_KINDS = kinds_of(Action.EP_COLLECTIVE)
#: Collectives across data-parallel replicas: issued without blocking the rank, on the ``collective`` stream.
DP_KINDS = kinds_of(Action.DP_COLLECTIVE)
#: The backward ops that make a stage's input gradient: B, I.
INPUT_GRADIENT_KINDS = frozenset(kind for kind, semantics in OP_SEMANTICS.items() if semantics.input_gradient)
#: The ops that complete a stage's weight gradients: B, W.
WEIGHT_GRADIENT_KINDS = frozenset(kind for kind, semantics in OP_SEMANTICS.items() if semantics.weight_gradient)
#: The parts of a split backward, each with its share of the full backward's time: I and W, 1/2 each.
SPLIT_BACKWARD_KINDS = {kind: semantics.backward_share for kind, semantics in OP_SEMANTICS.items()
                        if semantics.backward_share is not None}


def collective_after(action: Action) -> dict[OpKind, OpKind]:
    """For the tensor- (``Action.TP_COLLECTIVE``) or expert-parallel (``Action.EP_COLLECTIVE``) collectives: each
    compute kind they follow, mapped to the collective kind that runs right after it (F → TP_F, B and I → TP_B,
    R → TP_R; :attr:`OpSemantics.follows`)."""
    return {source: kind for kind, semantics in OP_SEMANTICS.items() if semantics.action is action
            for source in semantics.follows}


def message_kinds(source: OpKind) -> tuple[OpKind, OpKind]:
    """The SEND and the RECV kind that move ``source``'s output between vstages (F → SEND_F, RECV_F; B or I →
    SEND_B, RECV_B; :attr:`OpSemantics.follows`).

    Raises:
        KeyError: no message carries ``source``'s output.
    """
    send, recv = (tuple(kind for kind, semantics in OP_SEMANTICS.items()
                        if semantics.action is action and source in semantics.follows)
                  for action in (Action.SEND, Action.RECV))
    if len(send) != 1 or len(recv) != 1:
        raise KeyError(f"no single message carries {source.value}'s output")
    return send[0], recv[0]


def stream_of(kind: OpKind) -> str:
    """The stream an op kind runs on (:attr:`OpSemantics.stream`)."""
    return OP_SEMANTICS[kind].stream


def op_id(kind: OpKind, vstage: int, mb: int | None) -> str:
    """``Op(kind, vstage, mb).id`` without building the op: the lowering writes one per dep and the checks and the
    engine one per op, where building the op first costs three times as much (a test compares the two)."""
    return f"{vstage}{_KIND_TEXT[kind]}{'' if mb is None else mb}"


# Longest names first so that "SEND_F" is not read as "S" + "END_F" and "F" never shadows "SEND_F".
_KIND_ALTERNATIVES = "|".join(sorted((k.value for k in OpKind), key=len, reverse=True))
_OP_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATIVES})(\d*)$")


@dataclass(frozen=True, slots=True)
class Op:
    """One op of a rank's program.

    Attributes:
        kind: what the op does.
        vstage: the virtual stage (contiguous group of layers) it belongs to. For SEND it is the sending stage, for
            RECV the receiving stage (PyTorch's convention).
        mb: microbatch id (``None`` for per-stage ops such as OPT_STEP).
        peer: L1 only: the other rank of a SEND/RECV.
        pair: L1 only: the id shared by a SEND and its RECV.
        deps: L1 only: ids of ops (on any rank) that must complete before this op may start, beyond program order on
            its own stream.
    """

    kind: OpKind
    vstage: int
    mb: int | None = None
    peer: int | None = None
    pair: int | None = None
    deps: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """The op in string notation, e.g. ``"2F0"``; unique within a plan."""
        return op_id(self.kind, self.vstage, self.mb)

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> Op:
        """Parse the string notation (``"2F0"``, ``"3SEND_F1"``, ``"0OPT_STEP"``) into an L0-style op.

        Raises:
            SpecError: the text is not an op.
        """
        match = _OP_RE.match(text.strip())
        if match is None:
            raise SpecError(f"not an op: {text!r} (expected e.g. '2F0', '1B3', '0SEND_F1')")
        vstage, kind, mb = match.groups()
        return cls(OpKind(kind), int(vstage), int(mb) if mb else None)

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form: ``{"op": "2F0"}`` plus only the L1 fields that are set."""
        out: dict[str, Any] = {"op": self.id}
        if self.peer is not None:
            out["peer"] = self.peer
        if self.pair is not None:
            out["pair"] = self.pair
        if self.deps:
            out["deps"] = list(self.deps)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Op:
        """Inverse of :meth:`to_json`; SpecError on anything malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("op"), str):
            raise SpecError(f"op record must be an object with an 'op' string, got {data!r}")
        base = cls.parse(data["op"])
        unknown = sorted(set(data) - {"op", "peer", "pair", "deps"})
        if unknown:
            raise SpecError(f"op {base.id} has unknown field(s) {', '.join(map(repr, unknown))}; an op has op, peer, "
                            f"pair and deps")
        peer, pair, deps = data.get("peer"), data.get("pair"), data.get("deps", [])
        for name, value in (("peer", peer), ("pair", pair)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SpecError(f"op {base.id}: {name} must be a non-negative integer, got {value!r}")
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            raise SpecError(f"op {base.id}: deps must be a list of op ids, got {deps!r}")
        return cls(base.kind, base.vstage, base.mb, peer, pair, tuple(deps))
