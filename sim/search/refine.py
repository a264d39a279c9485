"""The screen's partition and placement refined on the bound: a local search inside the best layouts, so that the
plan the proof simulates is not only the balanced partition on a listed placement.

The listed space splits each pipeline layout's layers by ``--partition balanced``, which minimises the slowest stage
per microbatch (PipeDream's steady-state objective, SOSP'19 §3.1), and on a mixed cluster tries at most
:data:`sim.search.placement.MAX_PLACEMENTS` placements (or, with :mod:`sim.search.dp`, the one the joint program
finds for the same objective). With many microbatches that objective is the iteration's; with few it is not: the
fill and the drain add every stage's time once, and the update of the stage that finishes last (the first, under
1F1B's drain) waits after them, so the engine's best split moves layers off that stage or off a slow link. On a
12-layer GPT over ``2x2xV100+1x4xA100`` with two microbatches, the balanced plans are 25 % slower than the best split
brute force finds over every partition and placement (the joint program's 34 %).

So the screen refines, before its proof, the best layouts by their bound (:data:`REFINE_WINDOW`, at most
:data:`MAX_LAYOUTS` of them): from each layout's best listed plan and, on a mixed cluster, from the joint program's
plan and from the differentiable relaxation's (:mod:`sim.search.relaxed.relaxation`, which lands in other basins of
the bound there), a steepest descent on the screen's own lower bound (:func:`sim.search.bound.time_lower_bound`,
which holds the engine's fill, drain and update chains) over two moves: one layer across one cut between
neighbouring stages, and the device kinds of two neighbouring stages exchanged
(:func:`sim.search.placement.swapped_placements`). Every plan the descent bounds and that may fit joins the
candidates (explicit layer counts and device order, as ``--partition 5,7,6,6`` plans), so the proof simulates them
in the order of their bounds with the rest, and its gap covers them: the refinement only adds plans; what the proof
says of the listed ones is unchanged. It is a local search on a bound, not an exact one: its figure of merit is the
brute-force check in ``sim.bench --search`` (``sim.bench.joint_check``) and ``tests/sim/search/test_refine.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from sim.core.errors import SpecError
from sim.schedules import SCHEDULES
from sim.search.dp import joint_candidate
from sim.search.placement import swapped_placements
from sim.search.relaxed.relaxation import relax
from sim.search.screen import Bound, Screener
from sim.search.space import Candidate
from sim.search.stopping import expired

__all__ = ["refine", "METHODS", "REFINE_WINDOW", "MAX_LAYOUTS", "MAX_STEPS"]

#: How the best layouts are refined: the bound's descent (``screen``) or the relaxation (``relaxed``).
METHODS = ("descent", "relaxation")

#: Layouts refined: those whose best listed bound is within this fraction of the lowest bound of the space.
REFINE_WINDOW = 0.5
#: At most this many layouts (a layout: every field of a candidate but its partition and device order), best first.
MAX_LAYOUTS = 8
#: Descent steps per start at most (each bounds every neighbour of the current plan).
MAX_STEPS = 64


def _refinable(candidate: Candidate) -> bool:
    """One stage per pipeline rank, more than one rank, the listed balanced partition."""
    return candidate.pp > 1 and candidate.partition == "balanced" and SCHEDULES[candidate.schedule].flat


def _layout_key(candidate: Candidate) -> Candidate:
    return replace(candidate, partition="balanced", devices=())


def refine(screener: Screener, candidates: Sequence[Candidate], bounds: Sequence[Bound | None], *,
           method: str = "descent", deadline: float | None = None) -> tuple[list[Candidate], list[Bound]]:
    """The plans the refinement found that are not among ``candidates`` and may fit, with their bounds, in the
    order they were bounded (module docstring). Stops at ``deadline`` (``time.time()`` seconds) with what it has.

    Args:
        method: ``descent`` (the screen's: the bound's steepest descent from each layout's best listed plan and the
            joint program's) or ``relaxation`` (``--strategy relaxed``: the differentiable relaxation's plan of each
            layout, :func:`sim.search.relaxed.relaxation.relax`, bounded as it is).
    """
    if method not in METHODS:
        raise SpecError(f"{{method}} must be one of {', '.join(METHODS)}, got {method!r}", "method")
    if expired(deadline):  # after a Ctrl-C, not even the index of the bounds (0.1-0.2 s on 20,000 of them)
        return [], []
    known: dict[Candidate, Bound] = {c: b for c, b in zip(candidates, bounds) if b is not None}
    if method == "relaxation":
        _relax_best_layouts(screener, known, deadline)
        return _added(screener, candidates, known)
    # Each layout's starts (its best listed plan; on a mixed cluster also the joint program's) and its best bound.
    starts: dict[Candidate, list[tuple[float, Candidate]]] = {}
    for candidate, bound in known.items():
        if bound.fits and bound.time_s < math.inf and _refinable(candidate):
            starts.setdefault(_layout_key(candidate), []).append((bound.time_s, candidate))
    for key in starts:
        starts[key] = [min(starts[key])]
    mixed = len({device.name for device in screener.topology.devices}) > 1
    if mixed:
        answers: dict[Candidate, Candidate | None] = {}  # the program does not depend on the schedule
        for key in sorted(starts):
            if expired(deadline):
                break
            common = replace(key, schedule="1f1b")
            if common not in answers:
                answers[common] = joint_candidate(screener.problem, screener.topology, common)
            joint = answers[common]
            if joint is None:
                continue
            joint = replace(joint, schedule=key.schedule)
            if joint not in known:
                known[joint] = screener.bound(joint)
            if known[joint].fits:
                starts[key].append((known[joint].time_s, joint))
    if not starts:
        return [], []
    ranked = sorted((min(found), key) for key, found in starts.items())
    lowest = ranked[0][0][0]
    for (time_s, _), key in ranked[:MAX_LAYOUTS]:
        if time_s > lowest * (1 + REFINE_WINDOW):
            break
        layout_starts = [start for _, start in sorted(starts[key])]
        if mixed and not expired(deadline):
            # The relaxation's plan lands in other basins of the bound than the balanced or the program's plan on
            # mixed clusters (experiments.run search_strategies: 7 % faster on two of seven there).
            relaxed = _relaxed_plan(screener, key)
            if relaxed is not None:
                layout_starts.append(relaxed)
        for start in layout_starts:
            if expired(deadline):
                break
            _descend(screener, start, known, deadline)
    return _added(screener, candidates, known)


def _relaxed_plan(screener: Screener, layout: Candidate) -> Candidate | None:
    """The relaxation's plan of ``layout`` (:func:`sim.search.relaxed.relaxation.relax`), or ``None`` where its
    surrogate cannot describe the layout."""
    try:
        return relax(screener.problem, layout).candidate
    except SpecError:
        return None


def _added(screener: Screener, candidates: Sequence[Candidate],
           known: dict[Candidate, Bound]) -> tuple[list[Candidate], list[Bound]]:
    """The plans of ``known`` not listed that may fit, in the order they were bounded: a plan that is a listed one
    spelled out (the balanced partition's own layer counts on the same devices, as the descent writes its start) is
    the listed plan, not a second one."""
    listed = set(candidates)
    added = [(c, b) for c, b in known.items() if c not in listed and b.fits and b.time_s < math.inf
             and not _spells_out_listed(screener, c, listed)]
    return [c for c, _ in added], [b for _, b in added]


def _spells_out_listed(screener: Screener, candidate: Candidate, listed: set[Candidate]) -> bool:
    """Whether ``candidate``'s explicit layer counts are those the balanced partition gives the same plan, which is
    listed."""
    twin = replace(candidate, partition="balanced")
    if candidate.partition == "balanced" or twin not in listed:
        return False
    try:
        counts, _ = screener.shape(twin)
    except SpecError:
        return False
    return ",".join(map(str, counts)) == candidate.partition


def _best_layouts(known: dict[Candidate, Bound]) -> list[Candidate]:
    """The best listed plan of each layout worth refining, best first (module docstring)."""
    best_of_layout: dict[Candidate, tuple[float, Candidate]] = {}
    for candidate, bound in sorted(known.items(), key=lambda item: (item[1].time_s, item[0])):
        if bound.fits and bound.time_s < math.inf and _refinable(candidate):
            best_of_layout.setdefault(_layout_key(candidate), (bound.time_s, candidate))
    ranked = sorted(best_of_layout.values())
    if not ranked:
        return []
    lowest = ranked[0][0]
    return [candidate for time_s, candidate in ranked[:MAX_LAYOUTS] if time_s <= lowest * (1 + REFINE_WINDOW)]


def _relax_best_layouts(screener: Screener, known: dict[Candidate, Bound], deadline: float | None) -> None:
    """The relaxation's plan of each of the best layouts, bounded into ``known`` (layouts its surrogate cannot
    describe are left as listed)."""
    for candidate in _best_layouts(known):
        if expired(deadline):
            return
        relaxed = _relaxed_plan(screener, _layout_key(candidate))
        if relaxed is not None and relaxed not in known:
            known[relaxed] = screener.bound(relaxed)


def _explicit(screener: Screener, candidate: Candidate) -> Candidate | None:
    """``candidate`` with its partition written out as layer counts (the same plan), or ``None`` where it cannot be
    built."""
    try:
        counts, _ = screener.shape(candidate)
    except SpecError:
        return None
    return replace(candidate, partition=",".join(map(str, counts)))


def _neighbours(screener: Screener, candidate: Candidate) -> list[Candidate]:
    """One layer moved across one cut (either way), then the kinds of two neighbouring stages exchanged."""
    counts, layout = screener.shape(candidate)
    found = []
    for cut in range(1, len(counts)):
        for left, right in ((-1, 1), (1, -1)):
            moved = list(counts)
            moved[cut - 1] += left
            moved[cut] += right
            if min(moved) >= 1:
                found.append(replace(candidate, partition=",".join(map(str, moved))))
    for order in swapped_placements(layout, screener.topology):
        found.append(replace(candidate, devices=order))
    return found


def _descend(screener: Screener, start: Candidate, known: dict[Candidate, Bound], deadline: float | None) -> None:
    """Steepest descent on the bound from ``start``; every plan bounded is recorded in ``known``."""
    current = _explicit(screener, start)
    if current is None:
        return
    if current not in known:
        known[current] = screener.bound(current)
    here = known[current]
    if not here.fits:
        return
    for _ in range(MAX_STEPS):
        if expired(deadline):
            return
        step: tuple[float, Candidate] | None = None
        for neighbour in _neighbours(screener, current):
            bound = known.get(neighbour)
            if bound is None:
                bound = known[neighbour] = screener.bound(neighbour)
            if bound.fits and (step is None or (bound.time_s, neighbour) < step):
                step = (bound.time_s, neighbour)
        if step is None or not step[0] < here.time_s:
            return
        current, here = step[1], known[step[1]]
