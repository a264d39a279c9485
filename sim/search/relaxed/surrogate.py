"""The smooth surrogate of a layout's iteration time that :mod:`sim.search.relaxed.relaxation` descends, with its
gradient.

For one layout (TP, DP, PP, microbatch size, schedule and its chunks, recompute) the choices left are the layer count
of each virtual stage and, on a mixed cluster, which kind of device block serves each pipeline rank (a kind is the
sorted tuple of device models of a block, as in :mod:`sim.search.placement`). Relaxed, they are

* ``x``: fractional layer counts, ``x_v >= 1``, ``sum(x) = n``; the stage boundaries are ``e_j = x_0 + ... + x_{j-1}``;
* ``q``: for each pipeline rank a probability over the K kinds (a row of a P x K matrix).

Every number comes from the cost oracle (:class:`sim.cost.oracle.CostOracle`), tabulated once at the integer points
and interpolated linearly in between:

* ``F[p, k, i]``: forward plus backward time of layers ``[0, i)`` (``stage_compute_s``; plus the forward again under
  full recomputation, from ``layer_costs``) on the device rank p would have if it got a block of kind k, and their
  tensor-parallel collectives on that block (``collective``, as the plan's cost view costs TP_F, TP_B, TP_R), s;
* ``O[p, k, i]``: the optimizer step time of the same layers there, s;
* ``M[p, k]``, ``S[p, k]``: the framework's overheads there, once per microbatch and once per step per rank, s;
* ``W[i]``: the parameter bytes of layers ``[0, i)``, and per (p, k) the data-parallel update of a stage holding
  ``w`` of them, ``R0[p, k] + R1[p, k] * w`` s: the gradient all-reduce (reduce-scatter and parameter all-gather
  under ZeRO-1) of the block's data-parallel groups, ``oracle.collective``'s time fitted as a line through stages
  of ``W[n] / V`` and ``2 W[n] / V`` bytes (0 without data parallelism);
* ``G[j, k, k', i]``: the time of the message that crosses boundary j (between virtual stages j - 1 and j on different
  ranks) when the cut is after layer i, from the earlier stage (kind k) to the later (kind k') forward, and back for
  the gradient (``transfer_time(boundary_bytes(i), ...)``), s.

A stage's expected time is ``t_v = sum_k q[r(v), k] (F(e_{v+1}) - F(e_v))`` plus its expected sends (both neighbours'
kinds weighted by their probabilities), as the balanced dynamic program (:mod:`sim.plan.partition`) costs a stage.
The surrogate of the iteration time is

    J = m * smax(L) + fill * (sum(L) - smax(L)) + smax(U) + lam * J0 * sum_k (sum_p q[p, k] - N_k)^2

with ``L_r`` the time per microbatch of rank r (the sum of its virtual stages; ``L = t`` without interleaving),
``U_r`` its optimizer steps and data-parallel updates, ``smax(y) = tau * logsumexp(y / tau)`` the smooth maximum (the
hard maximum at ``tau = None``) and m the microbatches. The first term is the steady state, m microbatches through
the slowest rank (PipeDream's objective, the balanced DP's, times m); the second the warm-up and cool-down, during
which a microbatch passes through every other rank once: for gpipe and 1f1b ``fill = 1``, the critical path
``(m - 1) max(L) + sum(L)`` of a pipeline of unequal stages, which is ``(m + P - 1) t`` for equal ones; for ZB-H1
``fill = 1/3`` (:data:`sim.search.planner.FILL`: its deferred weight gradients fill two thirds of 1F1B's bubble); for
interleaving with v chunks it is divided by v. The planner's model takes ``(P - 1) max`` instead of the sum, which is
the same for equal stages; the sum makes a stage on a fast device cheaper even when it is not the slowest, and that
matters when m is small. The last term (added here) holds the kind counts to what the cluster has (``N_k`` blocks of
kind k), scaled by ``J0`` (s) so ``lam`` is unitless.

Approximations, stated (the balanced DP leaves out the overheads and the tensor- and data-parallel collectives): the
data-parallel update is a line in the stage's bytes; messages are costed one at a time (``transfer_time``, as the DP
costs them; the plan sends every shard's at once); on a mixed cluster a rank that takes a kind other than its own
block's is costed on the first block of that kind (a block of one kind is interchangeable for compute; for messages it
is a stand-in: the realised placement may hand it another block of that kind on another server). On a cluster of one
kind it is exact per rank: every rank keeps its own block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sim.core.errors import SpecError
from sim.cost.profile import load_profile
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.plan.build import inputs_graph, place_layers
from sim.plan.layout import plan_layout, plan_microbatches
from sim.schedules import SCHEDULES
from sim.search.placement import realise
from sim.search.planner import FILL
from sim.search.space import Candidate, SearchProblem

__all__ = ["Surrogate", "LayoutBlocks", "layout_blocks", "interpolate", "MAX_TABLE_CELLS"]

#: The most table cells (boundaries x kinds^2 x cuts) a surrogate may tabulate: 8 bytes each, 80 MB at most.
MAX_TABLE_CELLS = 10_000_000


@dataclass(frozen=True)
class LayoutBlocks:
    """The device blocks of a layout in its own order (``devices=()``).

    Attributes:
        blocks: per pipeline rank, its ``tp * dp`` devices in ascending order.
        kinds: the distinct kinds (sorted tuples of device model names), in sorted order.
        own: per pipeline rank, the index of its own block's kind.
        counts: per kind, how many blocks of it the layout has.
        position: per pipeline rank, where device (p, 0, 0), which costs the stage, sits in its block.
    """

    blocks: tuple[tuple[int, ...], ...]
    kinds: tuple[tuple[str, ...], ...]
    own: tuple[int, ...]
    counts: tuple[int, ...]
    position: tuple[int, ...]

    def first_of(self, kind: int, avoid: int | None = None) -> int | None:
        """The first pipeline rank whose own block has ``kind`` (not ``avoid``); ``None`` if none."""
        return next((p for p, k in enumerate(self.own) if k == kind and p != avoid), None)

    def realise(self, sequence: tuple[int, ...]) -> tuple[int, ...]:
        """The device order (``Candidate.devices``) giving pipeline rank p a block of kind ``sequence[p]``: the blocks
        of one kind handed out in the layout's order (:func:`sim.search.placement.realise`), so every group's devices
        stay ascending; ``()`` when that is the layout's own order."""
        order = realise(sequence, self.own, self.blocks, sum(len(b) for b in self.blocks))
        return () if list(order) == sorted(order) else order


def layout_blocks(layout: Parallelism, topology: Topology) -> LayoutBlocks:
    """The blocks, kinds and kind counts of ``layout`` (its ``devices`` ignored) on ``topology``."""
    base = replace(layout, devices=())
    blocks = tuple(tuple(sorted(base.device(p, d, t) for d in range(base.dp) for t in range(base.tp)))
                   for p in range(base.pp))
    names = [tuple(sorted(topology.devices[device].name for device in block)) for block in blocks]
    kinds = tuple(sorted(set(names)))
    own = tuple(kinds.index(name) for name in names)
    return LayoutBlocks(blocks, kinds, own, tuple(own.count(k) for k in range(len(kinds))),
                        tuple(block.index(base.device(p, 0, 0)) for p, block in enumerate(blocks)))


def interpolate(table: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise-linear values and slopes of ``table[..., i]`` (integer points ``0..n`` on the last axis) at the
    fractional points ``at`` (broadcast against the leading axes); slopes are the right-hand ones at integers."""
    n = table.shape[-1] - 1
    table = np.broadcast_to(table, np.broadcast_shapes(table.shape[:-1], np.shape(at)) + (n + 1,))
    at = np.broadcast_to(at, table.shape[:-1])
    low = np.clip(np.floor(at), 0, n - 1).astype(int)
    left = np.take_along_axis(table, low[..., None], axis=-1)[..., 0]
    right = np.take_along_axis(table, (low + 1)[..., None], axis=-1)[..., 0]
    slope = right - left
    return left + (at - low) * slope, slope


def _smax(values: np.ndarray, tau: float | None) -> tuple[float, np.ndarray]:
    """``tau * logsumexp(values / tau)`` and its gradient (softmax weights); the hard max and a one-hot at the first
    maximum when ``tau`` is ``None``."""
    if tau is None:
        weights = np.zeros_like(values)
        weights[int(np.argmax(values))] = 1.0
        return float(values.max()), weights
    shifted = (values - values.max()) / tau
    exp = np.exp(shifted)
    total = exp.sum()
    return float(values.max() + tau * np.log(total)), exp / total


class Surrogate:
    """The surrogate of one layout (module docstring): tables built once from the oracle, then
    :meth:`value_and_grad` at any relaxed point.

    Args:
        problem: the search problem (model, topology, global batch, profile, kernel model).
        layout: a candidate fixing the layout; its ``partition`` and ``devices`` are ignored.

    Raises:
        SpecError: the layout breaks a rule (divisibility, more stages than layers), has one stage (nothing to
            choose), or its tables would exceed :data:`MAX_TABLE_CELLS`.
    """

    def __init__(self, problem: SearchProblem, layout: Candidate) -> None:
        topology = Topology.parse(problem.topology)
        inputs = replace(layout, partition="uniform", devices=()).plan_inputs(problem)
        parallel = plan_layout(inputs, topology)
        microbatches = plan_microbatches(inputs, parallel)
        entry = SCHEDULES[layout.schedule]
        to_rank = entry.vstage_to_rank(parallel.pp, layout.chunks)
        graph = inputs_graph(inputs, parallel)
        n, stages = len(graph), len(to_rank)
        if stages < 2:
            raise SpecError(f"a relaxation needs at least two stages to balance, the layout {layout.label()} has 1")
        if stages > n:
            raise SpecError(f"more stages ({stages}) than layers ({n}) in {graph.spec}")
        self.blocks = layout_blocks(parallel, topology)
        kinds = len(self.blocks.kinds)
        if stages * kinds * kinds * (n + 1) > MAX_TABLE_CELLS:
            raise SpecError(f"the relaxation's tables need {stages * kinds * kinds * (n + 1):,} cells, more than "
                            f"{MAX_TABLE_CELLS:,}: {stages} stages, {kinds} device kinds, {n} layers")
        profile = load_profile(problem.profile) if problem.profile else None
        self.oracle = place_layers(inputs, profile, topology, parallel, to_rank)[0].oracle
        self.layout, self.parallel, self.n, self.to_rank = layout, parallel, n, np.array(to_rank)
        self.microbatches = int(microbatches if microbatches is not None else 8)
        self.fill = FILL.get(layout.schedule, 1.0) / entry.chunks_per_rank(layout.chunks)
        self.recompute_full = inputs.recompute_mode == "full"
        self._tabulate()

    def rank_of(self, p: int, kind: int) -> int:
        """The device that costs pipeline rank p's compute when it gets a block of ``kind``."""
        b = self.blocks
        holder = p if b.own[p] == kind else b.first_of(kind)
        return b.blocks[holder][b.position[p]]  # type: ignore[index]

    def _message_ranks(self, a: int, ka: int, b: int, kb: int) -> tuple[int, int] | None:
        """The devices of a message from rank a (kind ka) to rank b (kind kb); ``None`` when no two blocks can."""
        blocks = self.blocks
        first = a if blocks.own[a] == ka else blocks.first_of(ka)
        second = b if blocks.own[b] == kb else blocks.first_of(kb, avoid=first)
        if first == second:
            second = blocks.first_of(kb, avoid=first)
        if first is None or second is None:
            return None
        return blocks.blocks[first][blocks.position[a]], blocks.blocks[second][blocks.position[b]]

    def _groups(self, p: int, kind: int, parallel: str) -> tuple[tuple[int, ...], ...]:
        """Rank p's data-parallel groups (one per tensor shard) or tensor-parallel groups (one per replica) when it
        gets a block of ``kind``: its own block's groups, moved position by position onto that block."""
        b, base = self.blocks, replace(self.parallel, devices=())
        holder = p if b.own[p] == kind else b.first_of(kind)
        moved = {device: b.blocks[holder][i] for i, device in enumerate(b.blocks[p])}  # type: ignore[index]
        own = ([base.dp_group(p, t) for t in range(base.tp)] if parallel == "dp" else
               [base.tp_group(p, d) for d in range(base.dp)])
        return tuple(tuple(moved[device] for device in group) for group in own)

    def _update_s(self, p: int, kind: int, nbytes: int) -> float:
        """Data-parallel update of ``nbytes`` of parameters on rank p given a block of ``kind``, s: every tensor
        shard's data-parallel group at once, as the plan's cost view costs REDUCE_GRAD (and GATHER_PARAMS)."""
        names = ("reduce_scatter", "all_gather") if self.parallel.zero else ("all_reduce",)
        groups = self._groups(p, kind, "dp")
        return sum(self.oracle.collective(name, groups, nbytes).seconds for name in names)

    def _tensor_parallel_s(self, p: int, kind: int) -> np.ndarray:
        """Per layer, its tensor-parallel collectives for one microbatch on rank p given a block of ``kind``, s
        (forward, backward, and the forward's again under full recomputation): every replica's group at once, as
        the plan's cost view costs TP_F, TP_B and TP_R."""
        oracle, groups, size = self.oracle, self._groups(p, kind, "tp"), self.oracle.microbatch_size
        names = ("reduce_scatter", "all_gather") if self.parallel.sequence_parallel else ("all_reduce",)
        found = np.zeros(self.n)
        for i, layer in enumerate(oracle.graph.layers):
            for total, count, times in ((layer.tp_comm_fwd_bytes, layer.tp_comm_fwd_count,
                                         2 if self.recompute_full else 1),
                                        (layer.tp_comm_bwd_bytes, layer.tp_comm_bwd_count, 1)):
                if count:
                    each = size * total // count
                    found[i] += times * count * sum(oracle.collective(name, groups, each).seconds for name in names)
        return found

    def _tabulate(self) -> None:
        oracle, n, kinds, pp = self.oracle, self.n, len(self.blocks.kinds), self.parallel.pp
        self.F = np.zeros((pp, kinds, n + 1))
        self.O = np.zeros((pp, kinds, n + 1))
        self.M, self.S = np.zeros((pp, kinds)), np.zeros((pp, kinds))
        for p in range(pp):
            for k in range(kinds):
                rank = self.rank_of(p, k)
                device = oracle.device_spec(rank)
                self.M[p, k], self.S[p, k] = oracle.microbatch_overhead_s(device), oracle.step_overhead_s(device)
                costs = oracle.layer_costs(device)
                extra = np.cumsum(costs.fwd) if self.recompute_full else np.zeros(n)
                self.F[p, k] = [oracle.stage_compute_s(rank, 0, i) for i in range(n + 1)]
                self.F[p, k, 1:] += extra
                if self.parallel.tp > 1:
                    self.F[p, k, 1:] += np.cumsum(self._tensor_parallel_s(p, k))
                self.O[p, k, 1:] = np.cumsum(costs.opt)
        self.W = np.concatenate(([0.0], np.cumsum([oracle.memory.param_bytes(i, i + 1) for i in range(n)])))
        self.R0, self.R1 = np.zeros((pp, kinds)), np.zeros((pp, kinds))
        if self.parallel.dp > 1:
            low = max(1, int(self.W[-1] // len(self.to_rank)))
            for p in range(pp):
                for k in range(kinds):
                    short, long = self._update_s(p, k, low), self._update_s(p, k, 2 * low)
                    self.R1[p, k] = (long - short) / low
                    self.R0[p, k] = short - self.R1[p, k] * low
        stages = len(self.to_rank)
        size = [oracle.boundary_bytes(i) for i in range(1, n)]
        self.G_fwd = np.zeros((stages, kinds, kinds, n + 1))
        self.G_bwd = np.zeros((stages, kinds, kinds, n + 1))
        for j in range(1, stages):
            a, b = int(self.to_rank[j - 1]), int(self.to_rank[j])
            if a == b:
                continue  # consecutive chunks on one rank: no message
            for ka in range(kinds):
                for kb in range(kinds):
                    ranks = self._message_ranks(a, ka, b, kb)
                    if ranks is None:
                        continue
                    fwd = [oracle.transfer_time(nbytes, ranks[0], ranks[1]) for nbytes in size]
                    bwd = [oracle.transfer_time(nbytes, ranks[1], ranks[0]) for nbytes in size]
                    # cuts 0 and n are never interior (every stage keeps a layer); the edges repeat their neighbour
                    self.G_fwd[j, ka, kb] = [fwd[0], *fwd, fwd[-1]]
                    self.G_bwd[j, ka, kb] = [bwd[0], *bwd, bwd[-1]]

    def value_and_grad(self, x: np.ndarray, q: np.ndarray, tau: float | None, lam: float = 0.0,
                       scale: float = 1.0) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """The surrogate J (s) at layer counts ``x`` (one per virtual stage, summing to n) and kind probabilities
        ``q`` (P x K rows), its gradients dJ/dx and dJ/dq, and the expected stage times ``t`` (s).

        ``tau`` is the smooth maximum's temperature, s (``None``: the hard maximum); ``lam * scale`` weighs the
        kind-count penalty (``scale`` in s)."""
        n, to_rank, stages = self.n, self.to_rank, len(self.to_rank)
        e = np.concatenate(([0.0], np.cumsum(x)[:-1], [float(n)]))
        Q = q[to_rank]                                            # stages x K
        # compute and optimizer: stage v spans [e_v, e_{v+1}) on its rank's tables
        F_lo, dF_lo = interpolate(self.F[to_rank], e[:-1, None])  # stages x K
        F_hi, dF_hi = interpolate(self.F[to_rank], e[1:, None])
        O_lo, dO_lo = interpolate(self.O[to_rank], e[:-1, None])
        O_hi, dO_hi = interpolate(self.O[to_rank], e[1:, None])
        W_lo, dW_lo = interpolate(self.W, e[:-1])
        W_hi, dW_hi = interpolate(self.W, e[1:])
        R0, R1 = self.R0[to_rank], self.R1[to_rank]
        # the update: optimizer steps plus the data-parallel collectives of the stage's parameter bytes
        O_lo, O_hi = O_lo + R1 * W_lo[:, None], O_hi + R0 + R1 * W_hi[:, None]
        dO_lo, dO_hi = dO_lo + R1 * dW_lo[:, None], dO_hi + R1 * dW_hi[:, None]
        C, U_part = F_hi - F_lo, O_hi - O_lo
        t = (Q * C).sum(axis=1)
        u = (Q * U_part).sum(axis=1)
        # messages at interior boundaries j = 1..stages-1 (zero tables where consecutive stages share a rank)
        j = np.arange(1, stages)
        Gf, dGf = interpolate(self.G_fwd[j], e[j][:, None, None])  # (stages-1) x K x K
        Gb, dGb = interpolate(self.G_bwd[j], e[j][:, None, None])
        Qa, Qb = Q[:-1], Q[1:]
        fwd = np.einsum("jk,jl,jkl->j", Qa, Qb, Gf)               # on stage j - 1
        bwd = np.einsum("jk,jl,jkl->j", Qa, Qb, Gb)               # on stage j
        t = t + np.concatenate((fwd, [0.0])) + np.concatenate(([0.0], bwd))
        ranks = q.shape[0]
        # a rank pays the framework's overheads once per microbatch and once per step, whatever its chunks
        L = np.bincount(to_rank, weights=t, minlength=ranks) + (q * self.M).sum(axis=1)
        Ur = np.bincount(to_rank, weights=u, minlength=ranks) + (q * self.S).sum(axis=1)
        sL, wL = _smax(L, tau)
        sU, wU = _smax(Ur, tau)
        excess = q.sum(axis=0) - np.array(self.blocks.counts, dtype=float)
        # m microbatches through the slowest rank, and the warm-up and cool-down through the others
        value = self.microbatches * sL + self.fill * (float(L.sum()) - sL) + sU + lam * scale * float(excess @ excess)
        # backward
        gL = self.microbatches * wL + self.fill * (1.0 - wL)
        gt = gL[to_rank]
        gu = wU[to_rank]
        gQ = gt[:, None] * C + gu[:, None] * U_part
        ge = np.zeros(stages + 1)
        ge[1:] += ((gt[:, None] * Q * dF_hi) + (gu[:, None] * Q * dO_hi)).sum(axis=1)
        ge[:-1] -= ((gt[:, None] * Q * dF_lo) + (gu[:, None] * Q * dO_lo)).sum(axis=1)
        g_fwd, g_bwd = gt[:-1], gt[1:]
        gQ[:-1] += g_fwd[:, None] * np.einsum("jl,jkl->jk", Qb, Gf) + g_bwd[:, None] * np.einsum("jl,jkl->jk", Qb, Gb)
        gQ[1:] += g_fwd[:, None] * np.einsum("jk,jkl->jl", Qa, Gf) + g_bwd[:, None] * np.einsum("jk,jkl->jl", Qa, Gb)
        ge[j] += g_fwd * np.einsum("jk,jl,jkl->j", Qa, Qb, dGf) + g_bwd * np.einsum("jk,jl,jkl->j", Qa, Qb, dGb)
        # e_j = x_0 + ... + x_{j-1} for j = 1..stages-1 (e_stages = n is fixed: sum(x) = n)
        gx = np.concatenate((np.cumsum(ge[1:stages][::-1])[::-1], [0.0]))
        gq = np.zeros_like(q)
        np.add.at(gq, to_rank, gQ)
        gq += gL[:, None] * self.M + wU[:, None] * self.S + 2.0 * lam * scale * excess[None, :]
        return value, gx, gq, t
