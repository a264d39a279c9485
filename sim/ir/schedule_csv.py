"""``schedule.csv``: the compute-only (L0) view of a plan in the CSV syntax of PyTorch's pipelining.

One row per rank, one cell per op in program order (``0F0,0F1,0B0,...``), an empty cell for nothing; this is the
format of ``torch.distributed.pipelining``'s ``_dump_csv``/``_load_csv`` with ``format="compute_only"``, so files
round-trip between the two tools. Communication and optimizer ops are not written: lowering adds them again. A
``compute_comms`` file (what ``_dump_csv`` writes for PyTorch's runtime schedules such as
``ScheduleInterleavedZeroBubble``, with SEND/RECV, REDUCE_GRAD and FSDP's UNSHARD/RESHARD) is read by keeping its
compute actions in order. DualPipeV's composite ``(0F7;7B3)OVERLAP_F_B`` cells are read as the forward then the
backward, one after the other (see :func:`load_schedule_csv`).
"""

from __future__ import annotations

import csv
import io
import os
import re

from sim.core.errors import SpecError
from sim.core.fileio import read_text
from sim.ir.plan import RECV_KINDS, SCHEDULED_KINDS, SEND_KINDS, Op, OpKind

__all__ = ["dumps_schedule_csv", "load_schedule_csv"]

# Actions of a ``compute_comms`` CSV that are not part of the compute-only schedule: point-to-point and gradient
# reduction (our lowering inserts its own), and FSDP's UNSHARD/RESHARD, which PyTorch's runtime schedules emit.
_LOWERED_KINDS = SEND_KINDS | RECV_KINDS
_RUNTIME_ONLY = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)$")
# DualPipeV's composite cell ``(0F7;7B3)OVERLAP_F_B``: a forward of one stage overlapped with a backward of another.
_OVERLAP = re.compile(r"^\((?P<subs>[^()]+)\)OVERLAP_F_B$")


def dumps_schedule_csv(programs: tuple[tuple[Op, ...], ...]) -> str:
    """CSV text of the compute ops of each rank's program (L1 programs are filtered down to L0)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for program in programs:
        writer.writerow([op.id for op in program if op.kind in SCHEDULED_KINDS])
    return out.getvalue()


def _parse(text: str, where: str) -> Op:
    try:
        return Op.parse(text)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _compute_op(text: str, where: str, cell: str) -> Op | None:
    """The compute op a cell names, ``None`` for communication (a compute_comms file); else a SpecError."""
    op = _parse(text, where)
    if op.kind in _LOWERED_KINDS:
        return None  # a compute_comms file: lowering adds the communication again
    if op.kind not in SCHEDULED_KINDS:
        raise SpecError(f"{where}: {cell!r} is not a compute op (schedule.csv holds F, B, I, W, R and DualPipeV's "
                        f"(F;B)OVERLAP_F_B; SEND/RECV/REDUCE_GRAD/UNSHARD/RESHARD are skipped)")
    if op.mb is None:
        raise SpecError(f"{where}: {cell!r} has no microbatch")
    return op


def _overlap_ops(subs: str, where: str, cell: str) -> tuple[Op, Op]:
    """The forward and the full backward of a ``(sFm;s'Bm')OVERLAP_F_B`` cell.

    The pair is exactly two compute actions: a communication or FSDP sub-action inside the cell, which a
    compute_comms file would have skipped at top level, has no place in it and is named in the error.

    Raises:
        SpecError: a sub-action that is not an op, or the cell holds anything but one F then one B with microbatches.
    """
    found: list[str] = []
    ops: list[Op] = []
    for sub in (text.strip() for text in subs.split(";")):
        runtime_only = _RUNTIME_ONLY.match(sub)
        if runtime_only:
            found.append(runtime_only.group(1))
            continue
        op = _parse(sub, where)
        found.append(op.kind.value)
        ops.append(op)
    if found != [OpKind.F.value, OpKind.B.value]:
        raise SpecError(f"{where}: {cell!r} holds {';'.join(found)}; an OVERLAP_F_B cell must hold one forward and "
                        f"one full backward, (F;B)")
    forward, backward = ops
    for op in ops:
        if op.mb is None:
            raise SpecError(f"{where}: {cell!r} has no microbatch for {op.id}")
    return forward, backward


def load_schedule_csv(path: str | os.PathLike) -> tuple[tuple[Op, ...], ...]:
    """Read a schedule CSV, ``compute_only`` or ``compute_comms``; row r is rank r's program of compute ops.

    Communication actions (SEND/RECV, REDUCE_GRAD) and FSDP's UNSHARD/RESHARD are skipped: lowering adds its own.
    A ``(sF m;s'B m')OVERLAP_F_B`` cell becomes ``sFm`` then ``s'Bm'`` in program order: PyTorch's runtime runs the
    sub-actions in sequence too, and running them back to back on the compute stream is the conservative model of
    DualPipeV's overlap (it takes F + B, never less; the overlap only hides communication behind compute).

    Raises:
        SpecError: a file that is not UTF-8 text, an empty file, a cell that is not an op (naming row and column), a
            non-compute op other than those skipped, or an OVERLAP_F_B cell that is not one F and one B.
    """
    text = read_text(path, "schedule file")
    programs = []
    for row_number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        ops = []
        for column, cell in enumerate(row, start=1):
            if not cell.strip():
                continue
            if _RUNTIME_ONLY.match(cell.strip()):
                continue  # FSDP bookkeeping of PyTorch's runtime schedules; it has no counterpart here
            where = f"{path}: row {row_number}, column {column}"
            overlap = _OVERLAP.match(cell.strip())
            if overlap:
                # The conservative reading: the sub-actions one after the other on the compute stream, as PyTorch's
                # own runtime executes OVERLAP_F_B. DualPipeV overlaps them to hide the communication of one under
                # the compute of the other; with no overlap modelled the pair takes F + B, an upper bound.
                ops.extend(_overlap_ops(overlap.group("subs"), where, cell))
                continue
            op = _compute_op(cell.strip(), where, cell)
            if op is not None:
                ops.append(op)
        programs.append(tuple(ops))
    while programs and not programs[-1]:
        programs.pop()
    if not programs:
        raise SpecError(f"{path}: no ops in the schedule file")
    return tuple(programs)
