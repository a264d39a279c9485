"""Op kinds, their streams and the op record of the schedule IR (DESIGN §3); :mod:`sim.ir.plan` holds the plan.

An op is identified by ``(kind, vstage, mb)`` and prints in the action syntax of PyTorch's
``torch.distributed.pipelining``: ``2F0`` is the forward of virtual stage 2 on microbatch 0, ``3SEND_F1`` sends the
output of stage 3's forward of microbatch 1, ``0OPT_STEP`` is the optimizer step of stage 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sim.core.errors import SpecError

__all__ = ["OpKind", "Op", "COMPUTE_KINDS", "SEND_KINDS", "RECV_KINDS", "COPY_KINDS", "TP_KINDS", "DP_KINDS",
           "stream_of"]


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
    REDUCE_GRAD = "REDUCE_GRAD"  # data-parallel gradient all-reduce (reduce-scatter under ZeRO-1) of a vstage
    GATHER_PARAMS = "GATHER_PARAMS"  # ZeRO-1: all-gather of a vstage's updated parameters after its OPT_STEP


COMPUTE_KINDS = frozenset({OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R})
SEND_KINDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
RECV_KINDS = frozenset({OpKind.RECV_F, OpKind.RECV_B})
COPY_KINDS = frozenset({OpKind.PREFETCH, OpKind.EVICT})
TP_KINDS = frozenset({OpKind.TP_F, OpKind.TP_B, OpKind.TP_R})
#: Collectives across data-parallel replicas: issued without blocking the rank, on the ``collective`` stream.
DP_KINDS = frozenset({OpKind.REDUCE_GRAD, OpKind.GATHER_PARAMS})

_STREAM = {
    OpKind.SEND_F: "send",
    OpKind.SEND_B: "send",
    OpKind.RECV_F: "recv",
    OpKind.RECV_B: "recv",
    OpKind.PREFETCH: "h2d",
    OpKind.EVICT: "d2h",
    OpKind.TP_F: "tp",
    OpKind.TP_B: "tp",
    OpKind.TP_R: "tp",
    OpKind.REDUCE_GRAD: "collective",
    OpKind.GATHER_PARAMS: "collective",
}


def stream_of(kind: OpKind) -> str:
    """The stream an op kind runs on (``compute`` unless it is a transfer or a copy)."""
    return _STREAM.get(kind, "compute")


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
        return f"{self.vstage}{self.kind.value}{'' if self.mb is None else self.mb}"

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
