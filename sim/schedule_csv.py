"""``schedule.csv``: the compute-only (L0) view of a plan in the CSV syntax of PyTorch's pipelining.

One row per rank, one cell per op in program order (``0F0,0F1,0B0,...``), an empty cell for nothing; this is the
format of ``torch.distributed.pipelining``'s ``_dump_csv``/``_load_csv`` with ``format="compute_only"``, so files
round-trip between the two tools. Communication and optimizer ops are not written: lowering adds them again. A
``compute_comms`` file (what ``_dump_csv`` writes for PyTorch's runtime schedules such as
``ScheduleInterleavedZeroBubble``, with SEND/RECV, REDUCE_GRAD and FSDP's UNSHARD/RESHARD) is read by keeping its
compute actions in order.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from sim.errors import SpecError
from sim.ir import COMPUTE_KINDS, Op, OpKind

__all__ = ["dumps_schedule_csv", "load_schedule_csv"]

# Actions of a ``compute_comms`` CSV that are not part of the compute-only schedule: point-to-point and gradient
# reduction (our lowering inserts its own), and FSDP's UNSHARD/RESHARD, which PyTorch's runtime schedules emit.
_LOWERED_KINDS = frozenset({OpKind.SEND_F, OpKind.SEND_B, OpKind.RECV_F, OpKind.RECV_B, OpKind.REDUCE_GRAD})
_RUNTIME_ONLY = re.compile(r"^\d+(UNSHARD|RESHARD)$")


def dumps_schedule_csv(programs: tuple[tuple[Op, ...], ...]) -> str:
    """CSV text of the compute ops of each rank's program (L1 programs are filtered down to L0)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for program in programs:
        writer.writerow([op.id for op in program if op.kind in COMPUTE_KINDS])
    return out.getvalue()


def load_schedule_csv(path: str | os.PathLike) -> tuple[tuple[Op, ...], ...]:
    """Read a compute-only schedule CSV; row r is rank r's program.

    Raises:
        SpecError: an empty file, a cell that is not an op (naming row and column), or a non-compute op.
    """
    text = Path(path).read_text()
    programs = []
    for row_number, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        ops = []
        for column, cell in enumerate(row, start=1):
            if not cell.strip():
                continue
            if _RUNTIME_ONLY.match(cell.strip()):
                continue  # FSDP bookkeeping of PyTorch's runtime schedules; it has no counterpart here
            try:
                op = Op.parse(cell.strip())
            except SpecError as exc:
                raise SpecError(f"{path}: row {row_number}, column {column}: {exc}") from None
            if op.kind in _LOWERED_KINDS:
                continue  # a compute_comms file: lowering adds the communication again
            if op.kind not in COMPUTE_KINDS:
                raise SpecError(f"{path}: row {row_number}, column {column}: {cell!r} is not a compute op "
                                f"(schedule.csv holds F, B, I, W, R; SEND/RECV/REDUCE_GRAD/UNSHARD/RESHARD are "
                                f"skipped)")
            if op.mb is None:
                raise SpecError(f"{path}: row {row_number}, column {column}: {cell!r} has no microbatch")
            ops.append(op)
        programs.append(tuple(ops))
    while programs and not programs[-1]:
        programs.pop()
    if not programs:
        raise SpecError(f"{path}: no ops in the schedule file")
    return tuple(programs)
