"""Simulated annealing over the search space with the simulator in the loop (``--strategy anneal``; FlexFlow's
MCMC search, Jia et al., SysML'19 §5, over our space instead of FlexFlow's per-operator configurations).

The space is the exhaustive strategy's list (:func:`sim.search.space.enumerate_candidates`); annealing walks it
instead of costing all of it. A move changes one choice of the current candidate and keeps the others: the (TP, DP,
PP) shape (with its rank order and placement); the microbatch size; both at once (the global batch ties them: b · DP
≤ G); the schedule and its chunks; the recomputation; sequence parallelism; ZeRO; the rank order; the partition
rule; the placement. The neighbours of a candidate along a choice are the listed candidates that differ from it in
that choice only, so every move lands on a listed, valid point. A move to a plan Δ = ln(t_new / t_now) slower is
taken with probability exp(−Δ / T), the temperature T falling geometrically from :data:`START_TEMPERATURE` to
:data:`END_TEMPERATURE` over the chain's evaluations (a 10 % slower plan is taken with probability 0.39 at the start
and about never at the end); infeasible plans are never moved to. With probability :data:`JUMP` a move jumps to any
listed candidate instead, so that a chain is not held in one region of the space by the ones around it.

The chains start from the dynamic program's plans (:mod:`sim.search.dp`, the search's ``anneal`` strategy adds
them to the list): chain k at the k-th best of them by the planner's estimate, so the simulator refines what the
program chose, as the issue's "refinement starting from the DP" asks; a chain without one starts at a random
feasible candidate. Several independent chains (``chains``, each seeded from the search seed and its index) run, one
per worker process
when there are several; a candidate is costed once per chain (a chain remembers what it has seen). Then the best
candidate any chain found is polished by steepest descent (:func:`polish`): all its neighbours along every choice
are costed and the best taken, until none is faster, so the answer is at least a local optimum of the move set.
The result is every candidate costed, so the ranking is as honest as the exhaustive one over what was seen. The same
seed and chain count give the same result whatever the number of workers.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

from sim.search.evaluate import Evaluation, evaluate
from sim.search.space import Candidate, SearchProblem
from sim.search.stopping import expired

__all__ = ["anneal_chain", "polish", "ChainResult", "START_TEMPERATURE", "END_TEMPERATURE", "CHOICES", "JUMP"]

START_TEMPERATURE = 0.1
END_TEMPERATURE = 0.002
#: Probability that a move jumps to a random listed candidate.
JUMP = 0.05
#: The choices a move changes, as groups of Candidate field positions. The shape moves as one, and with it the rank
#: order and the placement, which are listed per shape (a one-stage layout has none to keep).
CHOICES: dict[str, tuple[int, ...]] = {
    "shape": (0, 1, 2, 9, 11), "microbatch size": (3,), "shape and microbatch size": (0, 1, 2, 3, 9, 11),
    "schedule": (4, 5),
    "recompute": (6,), "sequence parallel": (7,), "zero": (8,), "rank order": (9,), "partition": (10,),
    "placement": (11,),
}


@dataclass(frozen=True)
class ChainResult:
    """What one chain costed, in the order it costed them (indices into the candidate list)."""

    costed: tuple[tuple[int, Evaluation], ...]


class _Neighbours:
    """For each choice, the listed candidates grouped by everything but that choice."""

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.rows = [astuple(c) for c in candidates]
        self.groups: dict[str, dict[tuple, list[int]]] = {}
        for name, fields in CHOICES.items():
            table: dict[tuple, list[int]] = defaultdict(list)
            for index, row in enumerate(self.rows):
                table[tuple(v for k, v in enumerate(row) if k not in fields)].append(index)
            self.groups[name] = table

    def of(self, index: int, choice: str) -> list[int]:
        fields = CHOICES[choice]
        key = tuple(v for k, v in enumerate(self.rows[index]) if k not in fields)
        return [other for other in self.groups[choice][key] if other != index]


def anneal_chain(problem: SearchProblem, candidates: Sequence[Candidate], evaluations: int, seed: int,
                 deadline: float | None = None, start: int | None = None,
                 cost: Callable[[SearchProblem, Candidate], Evaluation] = evaluate) -> ChainResult:
    """One annealing chain of at most ``evaluations`` costed candidates (see the module docstring), stopping at the
    wall-clock ``deadline`` (``time.time()`` seconds; ``None``: none) if that comes first. It starts at candidate
    ``start`` when that is given and feasible, else at a random feasible one."""
    rng = random.Random(seed)
    neighbours = _Neighbours(candidates)
    seen: dict[int, Evaluation] = {}
    order: list[tuple[int, Evaluation]] = []

    def look(index: int) -> Evaluation:
        if index not in seen:
            seen[index] = cost(problem, candidates[index])
            order.append((index, seen[index]))
        return seen[index]

    budget = min(evaluations, len(candidates))
    current = None
    # Start at a feasible candidate: draw until one is (each draw is one of the budget's evaluations).
    def out_of_time() -> bool:
        return expired(deadline)

    if start is not None and look(start).feasible:
        current = start
    for index in ([] if current is not None else rng.sample(range(len(candidates)), len(candidates))):
        if len(order) >= budget or out_of_time():
            break
        if look(index).feasible:
            current = index
            break
    attempts = 0
    while current is not None and len(order) < budget and attempts < 20 * budget and not out_of_time():
        attempts += 1
        temperature = START_TEMPERATURE * (END_TEMPERATURE / START_TEMPERATURE) ** (len(order) / budget)
        choices = [name for name in CHOICES if neighbours.of(current, name)]
        if not choices or rng.random() < JUMP:
            proposal = rng.randrange(len(candidates))
        else:
            proposal = rng.choice(neighbours.of(current, rng.choice(choices)))
        new, now = look(proposal), seen[current]
        if not new.feasible:
            continue
        delta = math.log(new.iteration_time_s / now.iteration_time_s)
        if delta <= 0 or rng.random() < math.exp(-delta / temperature):
            current = proposal
    return ChainResult(tuple(order))


def polish(problem: SearchProblem, candidates: Sequence[Candidate], seen: dict[int, Evaluation],
           deadline: float | None = None,
           cost: Callable[[SearchProblem, Candidate], Evaluation] = evaluate) -> list[tuple[int, Evaluation]]:
    """Steepest descent from the fastest feasible candidate in ``seen`` (index → evaluation, extended in place):
    cost every neighbour along every choice not yet seen, move to the fastest if it beats the current one, repeat;
    stop at the wall-clock ``deadline`` (``time.time()`` seconds) if it comes first. Returns what it costed, in
    order."""
    feasible = [i for i, e in seen.items() if e.feasible]
    if not feasible:
        return []
    neighbours = _Neighbours(candidates)
    current = min(feasible, key=lambda i: (seen[i].iteration_time_s, i))
    costed: list[tuple[int, Evaluation]] = []
    while True:
        around = sorted({n for name in CHOICES for n in neighbours.of(current, name)})
        for index in around:
            if expired(deadline):
                return costed
            if index not in seen:
                seen[index] = cost(problem, candidates[index])
                costed.append((index, seen[index]))
        better = [i for i in around if seen[i].feasible and seen[i].iteration_time_s < seen[current].iteration_time_s]
        if not better:
            return costed
        current = min(better, key=lambda i: (seen[i].iteration_time_s, i))
