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
           "DP_KINDS", "stream_of", "op_id"]


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
    REDUCE_GRAD = "REDUCE_GRAD"  # data-parallel gradient all-reduce (reduce-scatter under ZeRO-1) of a vstage
    GATHER_PARAMS = "GATHER_PARAMS"  # ZeRO-1: all-gather of a vstage's updated parameters after its OPT_STEP


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
    """

    action: Action
    stream: str
    blocks: bool
    scheduled: bool
    memory: MemoryEffect
    workspace: bool
    backward: bool = False

    @property
    def compute(self) -> bool:
        """Whether the op is device compute (costed by ``compute_time``; stretched on a slowed device)."""
        return self.action is Action.COMPUTE


def _compute(memory: MemoryEffect, *, scheduled: bool = True, workspace: bool = True,
             backward: bool = False) -> OpSemantics:
    return OpSemantics(Action.COMPUTE, "compute", True, scheduled, memory, workspace, backward)


def _issued(action: Action, stream: str, memory: MemoryEffect = MemoryEffect.NONE) -> OpSemantics:
    return OpSemantics(action, stream, False, False, memory, False)


_TP = OpSemantics(Action.TP_COLLECTIVE, "tp", True, False, MemoryEffect.NONE, False)
_EP = OpSemantics(Action.EP_COLLECTIVE, "ep", True, False, MemoryEffect.NONE, False)

#: The semantics of every op kind. A new kind is added here (and to :class:`OpKind`); a consumer that has no
#: handler for its action refuses it by name.
OP_SEMANTICS: dict[OpKind, OpSemantics] = {
    OpKind.F: _compute(MemoryEffect.KEEP_ACTIVATIONS),
    OpKind.B: _compute(MemoryEffect.RELEASE_ACTIVATIONS, backward=True),
    OpKind.I: _compute(MemoryEffect.DEFER_WEIGHT_GRADIENTS, backward=True),
    OpKind.W: _compute(MemoryEffect.RELEASE_DEFERRED, backward=True),
    OpKind.R: _compute(MemoryEffect.REBUILD_ACTIVATIONS),
    OpKind.OPT_STEP: _compute(MemoryEffect.UPDATE_WEIGHTS, scheduled=False, workspace=False),
    OpKind.SEND_F: _issued(Action.SEND, "send"),
    OpKind.SEND_B: _issued(Action.SEND, "send"),
    OpKind.RECV_F: _issued(Action.RECV, "recv"),
    OpKind.RECV_B: _issued(Action.RECV, "recv"),
    OpKind.PREFETCH: _issued(Action.HOST_COPY, "h2d", MemoryEffect.LOAD_WEIGHTS),
    OpKind.EVICT: _issued(Action.HOST_COPY, "d2h", MemoryEffect.UNLOAD_WEIGHTS),
    OpKind.TP_F: _TP,
    OpKind.TP_B: _TP,
    OpKind.TP_R: _TP,
    OpKind.EP_F: _EP,
    OpKind.EP_B: _EP,
    OpKind.EP_R: _EP,
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
