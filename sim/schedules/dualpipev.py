"""DualPipeV (``dualpipev``): DeepSeek's bidirectional pipeline folded into a V on p ranks.

DualPipe (DeepSeek-V3 report, arXiv 2412.19437 §3.2.1, Figure 5) feeds microbatches from both ends of the pipeline
and pairs, on every rank, the forward of one microbatch with the backward of another, so that each one's
communication (the expert all-to-alls, the pipeline sends) hides under the other's compute. DualPipeV is its
"cut-in-half" form (the DualPipe repository's ``dualpipev.py``; PyTorch's ``ScheduleDualPipeV``): the model is cut
into 2p virtual stages placed in a V, rank r holding stage r on the way down and stage 2p − 1 − r on the way back
(PyTorch's ``generate_stage_to_rank_mapping(style="v")``), so the last rank runs the turn in memory and rank 0 holds
both the first stage and the last (the embedding and the head share a GPU, which balances them). Parameters are 1×
(DualPipe keeps two copies, 2×); the published bubble is (PP/2 − 1)(F&B + B − 3W) for DualPipe and its activations
PP + 1 microbatches (the DualPipe repository's README, "Pipeline Bubbles and Memory Usage Comparison").

Order on rank r, with a = r the down stage, b = 2p − 1 − r the up stage, m ≥ 2p microbatches (eight phases, as the
DualPipe repository and PyTorch's ``ScheduleDualPipeV._calculate_single_rank_operations`` run them):

1. 2(p − r − 1) forwards of a: the down leg fills;
2. r + 1 times a forward of a, then of b: the first microbatches turn at the V's tip;
3. p − r − 1 times I of b, the oldest deferred W, a forward of b (zero-bubble style: the weight gradient waits);
4. m − 2p + r + 1 times the pairs (F of a; B of b), then (F of b; B of a): the steady state, a forward and a full
   backward of different stages side by side;
5. p − r − 1 times B of b, then (F of b; B of a): the forwards are done on a;
6. r + 1 times a backward of b then of a; from the middle of this phase on the backwards are split (I now, W
   deferred): for odd r before b's backward, for even r between b's and a's;
7. p − r − 1 times the oldest deferred W, then a backward of a (split once phase 6 switched);
8. r + 1 times the oldest deferred W: the cool-down.

The W of phase 3 is the one its own I just deferred. A (F; B) pair is written as the forward then the backward in
program order: this tool runs the pair's two computations one after the other on the compute stream (what PyTorch's
runtime does with an ``OVERLAP_F_B`` action), and with ``--ep-overlap`` each one's expert all-to-alls run beside the
other's compute, which is the overlap DualPipe is built for. The SMs DualPipe gives its communication kernels (20 of an
H800's 132, §3.2.2) are not taken from the compute.

::

    p=2, m=4: vstages 0 and 3 on rank 0, 1 and 2 on rank 1 ("|" separates the phases, empty ones left out)
    rank 0: 0F0 0F1 | 0F2 3F0 | 3I0 3W0 3F1 | 0F3 3B1 3F2 0B0 | 3B2 3F3 0B1 | 3B3 0I2 | 0W2 0I3 | 0W3
    rank 1: 1F0 2F0 1F1 2F1 | 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 | 2B2 1B2 2I3 1I3 | 2W3 1W3
"""

from __future__ import annotations

from collections import deque

from sim.core.errors import SpecError
from sim.ir.plan import Op, OpKind
from sim.schedules.gpipe import _check

__all__ = ["dualpipev", "dualpipev_rank", "v_placement", "check_dualpipev"]


def v_placement(num_ranks: int, chunks: int = 2) -> tuple[int, ...]:
    """``vstage_to_rank`` of the V placement: vstages 0..p−1 on ranks 0..p−1, then p..2p−1 back on p−1..0.

    ``chunks`` is the number of stages per rank, always 2 for a V (the registry's calling convention).
    """
    if chunks != 2:
        raise ValueError(f"a V placement has 2 stages per rank, got {chunks}")
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def check_dualpipev(num_ranks: int, num_microbatches: int, chunks: int = 2) -> None:
    """Raise :class:`SpecError` unless (p, m) is a valid DualPipeV configuration: m ≥ 2p (every rank's steady phase
    needs m − 2p + r + 1 ≥ 1 pairs; the DualPipe repository and PyTorch refuse fewer); ValueError for p or m < 1."""
    _check(num_ranks, num_microbatches)
    if num_microbatches < 2 * num_ranks:
        raise SpecError(f"dualpipev needs at least twice as many microbatches as pipeline ranks (2p = "
                        f"{2 * num_ranks} stages in a V), got --microbatches {num_microbatches} with {num_ranks} ranks")


class _RankProgram:
    """One rank's program as it is written: per-stage microbatch counters and the queue of deferred W."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next_forward: dict[int, int] = {}
        self._next_backward: dict[int, int] = {}
        self._deferred: deque[tuple[int, int]] = deque()

    def forward(self, stage: int) -> None:
        mb = self._next_forward.get(stage, 0)
        self._next_forward[stage] = mb + 1
        self.ops.append(Op(OpKind.F, stage, mb))

    def backward(self, stage: int, *, split: bool) -> None:
        """The stage's next backward: full (B), or its input half (I) with the weight half deferred."""
        mb = self._next_backward.get(stage, 0)
        self._next_backward[stage] = mb + 1
        if split:
            self.ops.append(Op(OpKind.I, stage, mb))
            self._deferred.append((stage, mb))
        else:
            self.ops.append(Op(OpKind.B, stage, mb))

    def deferred_weight(self) -> None:
        """The oldest deferred W, if any is pending."""
        if self._deferred:
            stage, mb = self._deferred.popleft()
            self.ops.append(Op(OpKind.W, stage, mb))


def dualpipev_rank(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Op, ...]:
    """The program of one rank: the eight phases of the module docstring."""
    p, r, m = num_ranks, rank, num_microbatches
    down, up = r, 2 * p - 1 - r
    program = _RankProgram()
    for _ in range(2 * (p - r - 1)):                       # 1: the down leg fills
        program.forward(down)
    for _ in range(r + 1):                                  # 2: the first microbatches turn
        program.forward(down)
        program.forward(up)
    for _ in range(p - r - 1):                              # 3: I, its W, a forward of the up stage
        program.backward(up, split=True)
        program.deferred_weight()
        program.forward(up)
    for _ in range(m - 2 * p + r + 1):                      # 4: steady (F a; B b), (F b; B a)
        program.forward(down)
        program.backward(up, split=False)
        program.forward(up)
        program.backward(down, split=False)
    for _ in range(p - r - 1):                              # 5: B b, (F b; B a)
        program.backward(up, split=False)
        program.forward(up)
        program.backward(down, split=False)
    split = False
    for i in range(r + 1):                                  # 6: backwards of both, split from the middle on
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        program.backward(up, split=split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        program.backward(down, split=split)
    for _ in range(p - r - 1):                              # 7: W, then a backward of the down stage
        program.deferred_weight()
        program.backward(down, split=split)
    for _ in range(r + 1):                                  # 8: the deferred W
        program.deferred_weight()
    return tuple(program.ops)


def dualpipev(num_ranks: int, num_microbatches: int, chunks: int = 2) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of DualPipeV, one per rank; rank r runs vstages r and 2p − 1 − r (:func:`v_placement`).

    Args:
        num_ranks: pipeline ranks p, ≥ 1.
        num_microbatches: microbatches m per iteration, ≥ 2p.
        chunks: stages per rank, always 2 (the registry's calling convention).

    Raises:
        SpecError: m < 2p (ValueError for p or m < 1).
    """
    check_dualpipev(num_ranks, num_microbatches, chunks)
    return tuple(dualpipev_rank(r, num_ranks, num_microbatches) for r in range(num_ranks))
