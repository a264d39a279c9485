"""How large a plan ``sim.run`` will build: its op count and byte counts, checked from the sizes before anything is
generated, so that a typo in ``--microbatches`` is an error in a millisecond instead of an exhausted machine.

The op limit comes from a measurement (``python -m sim.bench_memory``: resident memory per op of the plan being
simulated) and a memory budget; the byte limit from the 64-bit integers the engine's memory counts are read back
with. :func:`plan_op_count` predicts the lowered plan's ops from its shape alone, exactly (a test holds it to every
schedule's generated plans).
"""

from __future__ import annotations

import math

from sim.core.errors import SpecError
from sim.models.graph import LayerGraph
from sim.schedules import ScheduleEntry

__all__ = ["MAX_PLAN_OPS", "MAX_BYTES", "PEAK_BYTES_PER_OP", "MEMORY_BUDGET_BYTES", "plan_op_count",
           "check_plan_size", "compute_ops_per_microbatch"]

#: Peak memory of ``sim.run`` per op of the plan it simulates, bytes, measured by ``python -m sim.bench_memory``:
#: 1F1B on 4 ranks peaks at 75 MB, 251 MB and 2,045 MB of resident memory for 1,000, 10,000 and 100,000 microbatches
#: (20,004, 200,004 and 2,000,004 ops), 55 MB of it fixed (interpreter, imports): 980 to 1,015 bytes per op at every
#: size. The peak is while plan.json is written: the plan's ops (~210 bytes each), the trace's spans (~210) and the
#: JSON of every op on its way to disk (~490) are alive at once.
PEAK_BYTES_PER_OP = 1000
#: What a plan may make ``sim.run`` hold at once: 8 GiB, half of a 16 GB workstation.
MEMORY_BUDGET_BYTES = 8 * 2**30
#: The most ops (lowered: compute, SEND/RECV, optimizer steps) a plan may have: the memory budget at the measured
#: peak per op, about 8.6 million (430,000 microbatches of a 4-rank 1F1B plan). Time grows in proportion too: about
#: 70 µs an op end to end on one core, so the largest plan takes ten minutes.
MAX_PLAN_OPS = MEMORY_BUDGET_BYTES // PEAK_BYTES_PER_OP
#: Largest byte count the memory accounting may reach: the engine's counters are Python ints, but metrics.json
#: carries them to readers with 64-bit integers (the executor's torch memory stats among them).
MAX_BYTES = 2**63 - 1


def compute_ops_per_microbatch(entry: ScheduleEntry) -> int:
    """Compute ops (F, B, I, W, R) a schedule gives each (vstage, microbatch): 2, or 3 with a split backward.

    Counted on the schedule itself at 2 ranks and 4 microbatches (2 chunks where it takes them), an instance every
    generator accepts (DualPipeV needs m >= 2p), so a new generator needs no entry here. Rounded up: DualPipeV
    splits some backwards and not others, and splits a larger share of them the fewer microbatches it has.
    """
    chunks = 2 if entry.chunked else 1
    probe = entry.build(2, 4, chunks)
    vstages = len(entry.vstage_to_rank(2, chunks))
    return -(-sum(len(program) for program in probe) // (vstages * 4))


def plan_op_count(num_microbatches: int, vstage_to_rank: tuple[int, ...], compute_per_microbatch: float,
                  update_per_microbatch: bool) -> int:
    """Ops of the lowered plan, before generating it.

    Per microbatch: ``compute_per_microbatch`` ops on each vstage, four (SEND_F, RECV_F, SEND_B, RECV_B) at each
    boundary between consecutive vstages on different ranks, and an OPT_STEP per vstage when weights are updated per
    microbatch (``stash``); otherwise one OPT_STEP per vstage in all.
    """
    per_microbatch, fixed = _op_rate(vstage_to_rank, compute_per_microbatch, update_per_microbatch)
    return math.ceil(num_microbatches * per_microbatch) + fixed


def _op_rate(vstage_to_rank: tuple[int, ...], compute_per_microbatch: float,
             update_per_microbatch: bool) -> tuple[float, int]:
    """(ops per microbatch, ops once per plan) of :func:`plan_op_count`."""
    vstages = len(vstage_to_rank)
    crossings = sum(a != b for a, b in zip(vstage_to_rank, vstage_to_rank[1:]))
    per_microbatch = vstages * compute_per_microbatch + 4 * crossings + (vstages if update_per_microbatch else 0)
    return per_microbatch, 0 if update_per_microbatch else vstages


def check_plan_size(graph: LayerGraph, num_microbatches: int, microbatch_size: int, vstage_to_rank: tuple[int, ...],
                    compute_per_microbatch: float, update_per_microbatch: bool) -> None:
    """Reject, before anything is generated, a plan over :data:`MAX_PLAN_OPS` ops or whose byte counts overflow.

    Raises:
        SpecError: the plan would have more than :data:`MAX_PLAN_OPS` ops (naming ``--microbatches``), or its
            microbatches' activations could exceed :data:`MAX_BYTES` (naming ``--microbatch-size``).
    """
    ops = plan_op_count(num_microbatches, vstage_to_rank, compute_per_microbatch, update_per_microbatch)
    if ops > MAX_PLAN_OPS:
        per_microbatch, fixed = _op_rate(vstage_to_rank, compute_per_microbatch, update_per_microbatch)
        fit = int((MAX_PLAN_OPS - fixed) // per_microbatch)
        raise SpecError(
            f"a plan of {ops:,} ops ({len(vstage_to_rank)} stages on {len(set(vstage_to_rank))} ranks, "
            f"{per_microbatch:g} ops per microbatch) is over the limit of {MAX_PLAN_OPS:,} ops, set by the "
            f"~{PEAK_BYTES_PER_OP:,} bytes of memory sim.run needs per op (measured) and an "
            f"{MEMORY_BUDGET_BYTES // 2**30} GiB budget: at most {fit:,} microbatches fit; "
            f"--microbatches {num_microbatches}")
    # Every byte the engine accounts is at most all microbatches' activations (and workspace) at once, per sample
    # at most the model input plus everything each layer keeps or uses.
    per_sample = graph.input_bytes + sum(layer.activation_bytes + layer.saved_bytes
                                         + max(layer.workspace_bytes, layer.backward_transient_bytes)
                                         for layer in graph.layers)
    if num_microbatches * microbatch_size * max(per_sample, 1) > MAX_BYTES:
        raise SpecError(
            f"{num_microbatches} microbatches × {microbatch_size} samples × {per_sample:,} bytes per sample of "
            f"{graph.spec} overflow the memory accounting (at most 2^63 - 1 bytes, the 64-bit counts metrics.json "
            f"readers use); --microbatch-size {microbatch_size}")
