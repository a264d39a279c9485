"""PipeDream's planner generalised to device groups of different speeds: one exact dynamic program over the
partition and the placement together (``--strategy dp``).

PipeDream (Narayanan et al., SOSP'19 §3.1) splits a layer chain into stages by a dynamic program whose objective is
the slowest stage's time per microbatch, which bounds the pipeline's steady state. Its stages may differ in
replication; a plan here has one data-parallel degree for every stage (Megatron's 3D layout, which is what the IR
and the executor run), so replication is a choice of the layout outside the program, like TP, and what is left to
choose per layout is which layers each stage holds and which block of devices serves it. On one kind of device
that is :func:`sim.plan.partition.balanced_counts`. On a mixed cluster the blocks differ, and choosing a placement
first and balancing after (what :mod:`sim.search.placement` lists, at most 24 per layout) is a guess at the joint
optimum; this module finds it.

The objective is ``balanced``'s own, asked of the same oracle: stage s holding layers ``[i, j)`` on block ``b_s``
costs ``C = ((P_b[j] − P_b[i]) + out(j; b_s → b_{s+1})) + in(i; b_s → b_{s−1})`` per microbatch, its forward and
backward compute plus the activation it sends on and the gradient it sends back (float operations in
``balanced``'s order, so the bottleneck is bitwise the one ``balanced`` computes for the same placement). Blocks of
one kind are handed out in ascending order (:func:`sim.search.placement.realise`), so after a prefix of stages the
blocks used are fixed by how many of each kind were used, and a state is

    (blocks used per kind, kind of the last stage's block, kind of the one before)  →  b[i]

the smallest bottleneck of the stages before the last when the last starts at layer i. Adding a stage of kind k
ending the last one at j costs ``max(b[i], C(last, i, j))`` minimised over i, and that is the new state's b[j]:
the last stage's time is complete only once the block after it is known, which is why the state keeps two kinds.
Every transition is one (n+1)² numpy array. The answer is the best state using every block with the last stage
ending at n; the placement is read back through the recorded arguments of each minimum.

Given the microbatch count m (the search gives it), a stage is also charged its update amortised over the
iteration, ``U / m``: optimizer step plus data-parallel gradient reduction (and ZeRO-1's all-gather), asked of the
oracle for the stage's own groups on its block. PipeDream charges a replicated stage its weight synchronisation the
same way; without it the program put the embedding's stage on the V100 server of ``8xV100+8xA100``, where its
all-reduce is slower (the strategy's best 11 % behind brute force's on a 12-layer GPT there; 6 % with the
update). What the objective still does not see is where a schedule's drain puts each update: under 1F1B the first
stage finishes last, so its update is on the critical path and the others' are not, and the simulator prefers that
stage on the fast server. The ``dp`` strategy screens the program's plans with the planner and costs them with the
simulator; ``anneal`` starts its chains from them and moves from there.

Work is Π(c_k + 1) · K² states for c_k blocks of each of K kinds, each with K transitions of (n+1)² elements, and
is refused above :data:`MAX_WORK` before anything is allocated (:class:`~sim.core.errors.SpecError`). Interleaved
schedules put several stages on a rank, whose times add instead of maxing; they keep the listed placements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import prod

import numpy as np

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.cost.profile import load_profile
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.plan.build import inputs_costs
from sim.plan.layout import plan_layout, plan_microbatches
from sim.schedules import SCHEDULES
from sim.search.placement import realise
from sim.search.space import Candidate, SearchProblem

__all__ = ["JointPlacement", "joint_partition", "joint_candidates", "joint_candidate", "MAX_WORK"]

#: Most array elements the program may touch (states × kinds × (layers + 1)²): about ten seconds of numpy.
MAX_WORK = 2_000_000_000


@dataclass(frozen=True)
class JointPlacement:
    """The program's answer for one layout.

    Attributes:
        counts: layers per pipeline stage.
        devices: the device order (:attr:`sim.ir.parallel.Parallelism.devices`; ``()``: the layout's own).
        bottleneck_s: the slowest stage's time per microbatch, s (``balanced``'s objective).
    """

    counts: tuple[int, ...]
    devices: tuple[int, ...]
    bottleneck_s: float


class _Blocks:
    """The layout's device blocks by kind, and the costs of a stage on each (the oracle's numbers, cached)."""

    def __init__(self, oracle: CostOracle, layout: Parallelism, topology: Topology) -> None:
        self.base = base = replace(layout, devices=())
        self.blocks = [sorted(base.device(p, d, t) for d in range(base.data_ranks) for t in range(base.tp))
                       for p in range(base.pp)]
        self.block_kinds = [tuple(sorted(topology.devices[device].name for device in block)) for block in self.blocks]
        self.kinds = sorted(set(self.block_kinds))
        # Blocks of each kind (indices into blocks) in the order realise hands them out.
        self.pool = [[b for b, kind in enumerate(self.block_kinds) if kind == wanted] for wanted in self.kinds]
        self.oracle, self.world = oracle, base.world_size
        self.n = n = len(oracle.graph)
        self._prefix: dict[int, np.ndarray] = {}
        self._links: dict[tuple[int, int], np.ndarray] = {}
        self._updates: dict[tuple[int, int], np.ndarray] = {}
        self._bytes = [0] + [oracle.boundary_bytes(cut) for cut in range(1, n)] + [0]
        params = np.array([0, *(layer.param_bytes for layer in oracle.graph.layers)], dtype=np.int64).cumsum()
        self._params = params[None, :] - params[:, None]  # [i, j]: weight bytes of layers [i, j)

    def representative(self, block: int) -> int:
        """The device a stage on ``block`` is costed on: its first, which stands for it in a plan
        (``Parallelism.device(p, 0, 0)`` is a block's smallest device)."""
        return self.blocks[block][0]

    def prefix(self, device: int) -> np.ndarray:
        """``P[j]``: forward plus backward time of layers ``[0, j)`` on ``device``, s (the oracle's prefix sums)."""
        found = self._prefix.get(device)
        if found is None:
            found = self._prefix[device] = np.array([self.oracle.stage_compute_s(device, 0, j)
                                                     for j in range(self.n + 1)])
        return found

    def link(self, src: int, dst: int) -> np.ndarray:
        """Time of the message crossing each cut (0..n) from ``src`` to ``dst``, s; 0 at cuts 0 and n."""
        found = self._links.get((src, dst))
        if found is None:
            times = [0.0] * (self.n + 1)
            for cut in range(1, self.n):
                times[cut] = self.oracle.transfer_time(self._bytes[cut], src, dst)
            found = self._links[(src, dst)] = np.array(times)
        return found

    def update(self, stage: int, block: int) -> np.ndarray:
        """``U[i, j]``: the update of pipeline stage ``stage`` holding layers ``[i, j)`` on ``block``, s: the
        optimizer step (with the framework's per-step overhead) plus, with replicas, the data-parallel reduction of
        its gradients (a reduce-scatter and an all-gather of the parameters under ZeRO-1), every tensor shard's
        group at once, as the plan's cost view asks the oracle for them."""
        found = self._updates.get((stage, block))
        if found is not None:
            return found
        oracle, base, n = self.oracle, self.base, self.n
        device = oracle.topology.devices[self.representative(block)]
        costs = oracle.layer_costs(device)
        steps = np.array([0.0, *costs.opt]).cumsum()
        found = (steps[None, :] - steps[:, None]) + oracle.step_overhead_s(device)
        if base.data_ranks > 1:
            moved = dict(zip(self.blocks[stage], self.blocks[block]))
            groups = tuple(tuple(moved[device] for device in base.dp_group(stage, t)) for t in range(base.tp))
            names = ("reduce_scatter", "all_gather") if base.zero else ("all_reduce",)
            sizes = np.unique(self._params[np.triu_indices(n + 1, 1)])
            seconds = np.array([sum(oracle.collective(name, groups, int(size)).seconds for name in names)
                                for size in sizes])
            where = np.searchsorted(sizes, np.clip(self._params, sizes[0], sizes[-1]))
            found = found + seconds[where]
        self._updates[(stage, block)] = found
        return found


def joint_partition(oracle: CostOracle, layout: Parallelism, topology: Topology,
                    microbatches: int | None = None) -> JointPlacement:
    """The partition and block placement of ``layout`` (one stage per pipeline rank) whose slowest stage is fastest
    (see the module docstring). With ``microbatches`` m, a stage's time per microbatch also carries its update
    amortised over the iteration, ``U / m`` (:meth:`_Blocks.update`), as PipeDream's planner charges a replicated
    stage its weight synchronisation; without, the objective is ``--partition balanced``'s.

    Raises:
        SpecError: more stages than layers, or a program above :data:`MAX_WORK`.
    """
    blocks = _Blocks(oracle, layout, topology)
    n, stages, kinds = blocks.n, layout.pp, len(blocks.kinds)
    if stages > n:
        raise SpecError(f"more stages ({stages}) than layers ({n}): every stage needs a layer")
    totals = tuple(len(pool) for pool in blocks.pool)
    work = prod(c + 1 for c in totals) * kinds * (kinds + 1) * kinds * (n + 1) ** 2
    if work > MAX_WORK:
        raise SpecError(f"the joint partition of {n} layers over {stages} stages of {kinds} device kinds would touch "
                        f"{work:,} elements, more than {MAX_WORK:,}; search these layouts with --strategy planner")
    start = np.arange(n + 1)[:, None]
    end = np.arange(n + 1)[None, :]
    empty = start >= end
    # best[state] = (b over the last stage's start, for each start the (previous state, previous start) it came from)
    best: dict[tuple, tuple[np.ndarray, list]] = {}
    for k in range(kinds):
        b = np.full(n + 1, np.inf)
        b[0] = 0.0
        best[(_bump((0,) * kinds, k), k, -1)] = (b, [None] * (n + 1))
    for placed in range(1, stages + 1):
        layer = sorted(state for state in best if sum(state[0]) == placed)
        for state in layer:
            used, last, previous = state
            b, _ = best[state]
            block = blocks.pool[last][used[last] - 1]
            here = blocks.representative(block)
            back = (np.zeros(n + 1) if previous < 0 else blocks.link(here, blocks.representative(
                blocks.pool[previous][used[previous] - 1 - (previous == last)])))
            prefix = blocks.prefix(here)
            compute = prefix[None, :] - prefix[:, None]
            amortised = None if microbatches is None else blocks.update(placed - 1, block) / microbatches
            if placed == stages:
                cost = (compute[:, n] + 0.0) + back
                if amortised is not None:
                    cost = cost + amortised[:, n]
                cost = np.where(empty[:, n], np.inf, cost)
                total = np.maximum(b, cost)
                best[("end", state)] = (np.array([total.min()]), [(state, int(total.argmin()))])
                continue
            for k in range(kinds):
                if used[k] == totals[k]:
                    continue
                ahead = blocks.link(here, blocks.representative(blocks.pool[k][used[k]]))
                cost = (compute + ahead[None, :]) + back[:, None]
                if amortised is not None:
                    cost = cost + amortised
                cost = np.where(empty, np.inf, cost)
                matrix = np.maximum(b[:, None], cost)
                values, argmins = matrix.min(axis=0), matrix.argmin(axis=0)
                target = (_bump(used, k), k, last)
                if target not in best:
                    best[target] = (np.full(n + 1, np.inf), [None] * (n + 1))
                kept, origin = best[target]
                better = values < kept
                kept[better] = values[better]
                for j in np.flatnonzero(better):
                    origin[j] = (state, int(argmins[j]))
    finals = sorted((key for key in best if key[0] == "end"), key=lambda key: (best[key][0][0], key[1]))
    if not finals or not np.isfinite(best[finals[0]][0][0]):
        raise SpecError(f"no partition of {n} layers into {stages} stages")  # unreachable when stages <= n
    bottleneck = float(best[finals[0]][0][0])
    return _read_back(best, finals[0], blocks, n, bottleneck)


def _bump(used: tuple[int, ...], kind: int) -> tuple[int, ...]:
    return used[:kind] + (used[kind] + 1,) + used[kind + 1:]


def _read_back(best: dict, final: tuple, blocks: _Blocks, n: int, bottleneck: float) -> JointPlacement:
    """Follow the recorded minima from the final state back to the first stage."""
    ends, sequence = [n], []
    state, first = best[final][1][0]
    while True:
        sequence.append(state[1])
        if first == 0:
            break
        ends.append(first)
        state, first = best[state][1][first]
    sequence.reverse()
    cuts = [0, *reversed(ends)]
    counts = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    order = realise([blocks.kinds[k] for k in sequence], blocks.block_kinds, blocks.blocks, blocks.world)
    return JointPlacement(counts, () if order == tuple(range(blocks.world)) else order, bottleneck)


def joint_candidates(problem: SearchProblem, topology: Topology, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The listed ``candidates`` with each layout's placements replaced by the program's one: every candidate of a
    pipeline (one stage per rank) under ``--partition balanced`` becomes the same plan with the program's layer
    counts and device order, once per layout (the placements listed for it collapse into one). Candidates of other
    schedules and partition rules, and of layouts the program refuses or cannot cost (a rule of the model broken:
    the simulator says which when it costs them), stay as listed. The order is the list's, first occurrence kept."""
    profile = load_profile(problem.profile) if problem.profile else None
    answers: dict[tuple, JointPlacement | None] = {}
    found: list[Candidate] = []
    seen: set[Candidate] = set()
    for candidate in candidates:
        chosen = candidate
        if candidate.pp > 1 and candidate.partition == "balanced" and SCHEDULES[candidate.schedule].flat:
            # The program depends on the layout and on what the oracle costs, not on the schedule.
            key = (candidate.tp, candidate.dp, candidate.pp, candidate.microbatch_size, candidate.recompute,
                   candidate.sequence_parallel, candidate.zero, candidate.rank_order, candidate.cp, candidate.cp_comm,
                   candidate.dp_replicate, candidate.precision, candidate.compiled, candidate.ep, candidate.etp)
            if key not in answers:
                answers[key] = _answer(problem, topology, profile, candidate)
            answer = answers[key]
            if answer is not None:
                chosen = replace(candidate, partition=",".join(map(str, answer.counts)), devices=answer.devices)
        if chosen not in seen:
            seen.add(chosen)
            found.append(chosen)
    return found


def joint_candidate(problem: SearchProblem, topology: Topology, candidate: Candidate) -> Candidate | None:
    """``candidate`` (a one-stage-per-rank pipeline) with the program's layer counts and device order for its
    layout, or ``None`` where the program cannot cost the layout or refuses it."""
    profile = load_profile(problem.profile) if problem.profile else None
    answer = _answer(problem, topology, profile, candidate)
    if answer is None:
        return None
    return replace(candidate, partition=",".join(map(str, answer.counts)), devices=answer.devices)


def _answer(problem: SearchProblem, topology: Topology, profile, candidate: Candidate) -> JointPlacement | None:
    """The program's placement of ``candidate``'s layout, or ``None`` where it cannot be built or is refused."""
    try:
        inputs = replace(candidate, devices=()).plan_inputs(problem)
        layout = plan_layout(inputs, topology)
        oracle = inputs_costs(inputs, profile, topology, layout).oracle
        microbatches = plan_microbatches(inputs, layout)
        return joint_partition(oracle, layout, topology, microbatches)
    except SpecError:
        return None
