"""Schedule generators: pure functions from (ranks, microbatches, chunks) to L0 compute-only programs.

The registry :data:`SCHEDULES` maps each ``--schedule`` name to its generator, its weight policy and its placement
(which rank runs each virtual stage); the CLI takes its ``choices`` from it, so a schedule added here is available
everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.ir.plan import Op
from sim.schedules.dualpipev import check_dualpipev, dualpipev, v_placement
from sim.schedules.gpipe import gpipe
from sim.schedules.interleaved import check_interleaved, interleaved, loop_placement
from sim.schedules.one_f_one_b import one_f_one_b
from sim.schedules.partime import partime
from sim.schedules.pipedream import pipedream
from sim.schedules.zero_bubble import zb1p

__all__ = ["ScheduleEntry", "SCHEDULES", "get_schedule", "PLACEMENTS"]

Programs = tuple[tuple[Op, ...], ...]

#: ``vstage_to_rank`` of each placement style, from (ranks p, stages per rank v); PyTorch's
#: ``generate_stage_to_rank_mapping(style=...)``. ``identity``: one vstage per rank (v = 1); ``loop``: vstage k on
#: rank k mod p; ``v``: two per rank in a V, vstages r and 2p − 1 − r on rank r.
PLACEMENTS: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "identity": lambda num_ranks, chunks: tuple(range(num_ranks)),
    "loop": loop_placement,
    "v": v_placement,
}


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule: its name, what it is, how weights are updated, where vstages go, and the generator.

    Attributes:
        name: the ``--schedule`` value.
        description: one line for ``--help`` and the docs.
        weight_policy: ``flush``, ``stash``, ``stream`` or ``csp`` (DESIGN §3).
        generator: ``(p, m)`` → programs, or ``(p, m, v)`` → programs when ``chunked``.
        placement: a key of :data:`PLACEMENTS`.
        chunked: whether the generator takes model chunks per rank (``--chunks``); the others run
            ``fixed_chunks`` per rank.
        constraints: ``(p, m, v) -> None``, raising the generator's own :class:`SpecError` for sizes it refuses,
            without building anything (``None``: any p, m >= 1); v is the stages per rank.
        split_backward: whether the programs split the backward into I and W (all of them, or some: DualPipeV).
        fixed_chunks: virtual stages per rank of a schedule that does not take ``--chunks``: 2 for DualPipeV's V,
            1 for the others.
    """

    name: str
    description: str
    weight_policy: str
    generator: Callable[..., Programs]
    placement: str = "identity"
    chunked: bool = False
    constraints: Callable[[int, int, int], None] | None = None
    split_backward: bool = False
    fixed_chunks: int = 1

    def chunks_per_rank(self, chunks: int = 1) -> int:
        """Virtual stages on each rank: ``chunks`` (``--chunks``) for a chunked schedule, else ``fixed_chunks``."""
        return chunks if self.chunked else self.fixed_chunks

    @property
    def flat(self) -> bool:
        """Whether every rank runs exactly one stage (such schedules differ only in their order, not placement)."""
        return not self.chunked and self.fixed_chunks == 1

    def check(self, num_ranks: int, num_microbatches: int, chunks: int = 1) -> None:
        """Refuse, without building them, the sizes :meth:`build` would refuse.

        Raises:
            SpecError: as :meth:`build` (a wrong ``chunks``, the generator's constraints).
        """
        if not self.chunked and chunks != 1:
            per_rank = "one stage" if self.fixed_chunks == 1 else f"{self.fixed_chunks} stages"
            raise SpecError(f"{{chunks}} {chunks} needs an interleaved schedule; {self.name} runs {per_rank} per rank "
                            f"(schedules taking {{chunks}}: {', '.join(n for n, e in SCHEDULES.items() if e.chunked)})",
                            "chunks")
        if self.constraints is not None:
            self.constraints(num_ranks, num_microbatches, self.chunks_per_rank(chunks))

    def build(self, num_ranks: int, num_microbatches: int, chunks: int = 1) -> Programs:
        """The L0 programs for p ranks, m microbatches and v chunks per rank.

        Raises:
            ValueError: p or m < 1.
            SpecError: ``chunks`` ≠ 1 for a schedule with one stage per rank, or the generator's own constraints.
        """
        self.check(num_ranks, num_microbatches, chunks)
        if self.chunked:
            return self.generator(num_ranks, num_microbatches, chunks)
        return self.generator(num_ranks, num_microbatches)

    def vstage_to_rank(self, num_ranks: int, chunks: int = 1) -> tuple[int, ...]:
        """Rank of each of the ``num_ranks × chunks_per_rank(chunks)`` virtual stages."""
        return PLACEMENTS[self.placement](num_ranks, self.chunks_per_rank(chunks))


SCHEDULES: dict[str, ScheduleEntry] = {
    entry.name: entry
    for entry in (
        ScheduleEntry("gpipe", "GPipe fill-drain: all forwards, then all backwards, then a flush", "flush", gpipe),
        ScheduleEntry(
            "1f1b", "1F1B / PipeDream-Flush (Megatron order): p−r−1 warm-up forwards, then one F one B", "flush",
            one_f_one_b,
        ),
        ScheduleEntry(
            "interleaved", "Megatron interleaved 1F1B: --chunks v model chunks per rank in a loop, bubble ÷ v",
            "flush", interleaved, placement="loop", chunked=True,
            constraints=check_interleaved,
        ),
        ScheduleEntry(
            "pipedream", "async PipeDream: 1F1B order without a flush, an update after every minibatch, weight "
            "stashing (--vertical-sync optional)", "stash", pipedream,
        ),
        ScheduleEntry(
            "stream", "PARTIME online learning on a stream: --frames frames, one per step, each stage's forward of its "
            "newest input and backward of the arriving gradient, an update every step", "stream", partime,
        ),
        ScheduleEntry(
            "zb1p", "Zero Bubble ZB-H1: backward split into I and W, W deferred into 1F1B's bubbles", "flush", zb1p,
            split_backward=True,
        ),
        ScheduleEntry(
            "dualpipev", "DeepSeek's DualPipeV: 2 stages per rank in a V (r and 2p-1-r), a forward and a backward of "
            "different stages paired (their all-to-alls overlap under --ep-overlap), zero-bubble W at the ends; "
            "m >= 2p", "flush", dualpipev, placement="v", constraints=check_dualpipev, split_backward=True,
            fixed_chunks=2,
        ),
    )
}


def get_schedule(name: str) -> ScheduleEntry:
    """The registry entry for ``name``; SpecError naming it and the known schedules otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise SpecError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})") from None
