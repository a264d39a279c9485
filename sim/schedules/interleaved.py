"""Interleaved 1F1B: v model chunks per rank (Narayanan et al., Megatron-LM, arXiv 2104.04473 §2.2.2).

The model is cut into p·v virtual stages placed in a loop: vstage k runs on rank ``k mod p``, so rank r holds the
chunks ``r, p + r, 2p + r, ...`` (PyTorch's ``generate_stage_to_rank_mapping(style="loop")``). A microbatch
therefore visits every rank v times, and each visit costs 1/v of a full stage: the pipeline fills and drains in
(p − 1)·(t_f + t_b)/v instead of (p − 1)·(t_f + t_b), so with uniform costs and free links

    iteration = (m + (p − 1)/v)·(t_f + t_b),  bubble ÷ total = (p − 1)/(v·m + p − 1)

(§2.2.2: "the pipeline bubble time is reduced by a factor of v"; t_f and t_b are a full stage's times). The price is
v times as many point-to-point messages.

Order on each rank (Megatron-LM ``forward_backward_pipelining_with_interleaving``, schedules.md §3):

* The k-th chunk-forward of every rank belongs to chunk ``(k // p) mod v`` and microbatch
  ``(k // (p·v))·p + k mod p``: microbatches go through the chunks in groups of p (Megatron's
  ``microbatch_group_size_per_vp_stage = p``), which is why m must be a multiple of p. The k-th chunk-backward
  uses the same microbatch and chunk ``v − 1 − (k // p) mod v``: backwards visit the chunks in reverse.
* Rank r runs ``min(2·(p − r − 1) + (v − 1)·p, m·v)`` warm-up chunk-forwards, then alternates one chunk-forward
  and one chunk-backward, then drains the remaining chunk-backwards.

At its peak rank r holds ``min(2·(p − r − 1) + (v − 1)·p + 1, m·v)`` chunk activations, each 1/v of a full stage's
A: on the first rank (p·v + p − 1)·A/v = p·A·(1 + (p − 1)/(p·v)) (hardware.md §5), a little more than 1F1B's p·A.

::

    p=2, v=2, m=4: vstages 0, 2 on rank 0 and 1, 3 on rank 1; warm-up 4 and 2
    rank 0: 0F0 0F1 2F0 2F1 | 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 | 2B2 2B3 0B2 0B3
    rank 1: 1F0 1F1 | 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 | 1B2 1B3

With one rank (p = 1) all chunks share the rank; adjacent chunks hand tensors over in memory and the lowering adds
no SEND/RECV for them.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.ir.plan import Op, OpKind
from sim.schedules.gpipe import _check

__all__ = ["interleaved", "interleaved_rank", "loop_placement", "check_interleaved"]


def loop_placement(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """``vstage_to_rank`` of the loop placement: vstage k on rank ``k mod p``, p·v vstages."""
    return tuple(k % num_ranks for k in range(num_ranks * chunks))


def check_interleaved(num_ranks: int, num_microbatches: int, chunks: int) -> None:
    """Raise :class:`SpecError` unless (p, m, v) is a valid interleaved configuration.

    v must be ≥ 2 (one chunk per rank is plain 1F1B) and m a multiple of p (Megatron's requirement: its microbatch
    groups have p members, arXiv 2104.04473 §2.2.2).
    """
    _check(num_ranks, num_microbatches)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise SpecError(f"interleaved needs --chunks >= 2 model chunks per rank, got {chunks!r} "
                        f"(with one chunk per rank use --schedule 1f1b)")
    if num_microbatches % num_ranks:
        raise SpecError(f"interleaved needs the microbatches to be a multiple of the pipeline ranks (Megatron's "
                        f"requirement), got --microbatches {num_microbatches} with {num_ranks} ranks")


def _chunk_and_microbatch(k: int, num_ranks: int, chunks: int) -> tuple[int, int]:
    """Chunk and microbatch of a rank's k-th chunk-forward (Megatron ``get_model_chunk_id``)."""
    group = num_ranks * chunks
    return (k % group) // num_ranks, (k // group) * num_ranks + k % num_ranks


def interleaved_rank(rank: int, num_ranks: int, num_microbatches: int, chunks: int) -> tuple[Op, ...]:
    """The program of one rank: warm-up chunk-forwards, steady one-forward-one-backward, cool-down backwards."""
    p, v = num_ranks, chunks
    total = num_microbatches * v  # chunk-forwards (and chunk-backwards) on this rank

    def forward(k: int) -> Op:
        chunk, mb = _chunk_and_microbatch(k, p, v)
        return Op(OpKind.F, chunk * p + rank, mb)

    def backward(k: int) -> Op:
        chunk, mb = _chunk_and_microbatch(k, p, v)
        return Op(OpKind.B, (v - 1 - chunk) * p + rank, mb)

    # Megatron: 2 per hop to the last rank (a forward down and a backward back), plus one extra round of p for each
    # chunk beyond the first, so the first backward arrives just as the warm-up ends.
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops.append(forward(warmup + k))
        ops.append(backward(k))
    ops.extend(backward(k) for k in range(total - warmup, total))
    return tuple(ops)


def interleaved(num_ranks: int, num_microbatches: int, chunks: int) -> tuple[tuple[Op, ...], ...]:
    """L0 programs of interleaved 1F1B, one per rank; vstage k runs on rank ``k mod p``.

    Args:
        num_ranks: pipeline ranks p, ≥ 1.
        num_microbatches: microbatches m per iteration, a multiple of p.
        chunks: model chunks (virtual stages) v per rank, ≥ 2.

    Raises:
        SpecError: v < 2, or m not a multiple of p (ValueError for p or m < 1).
    """
    check_interleaved(num_ranks, num_microbatches, chunks)
    return tuple(interleaved_rank(r, num_ranks, num_microbatches, chunks) for r in range(num_ranks))
