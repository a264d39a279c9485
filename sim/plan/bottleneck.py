"""The exact min-max partition of a layer chain, fast: threshold feasibility with numpy, then a DP on a narrow band.

:func:`sim.plan.partition.balanced_counts` is defined by a dynamic program (kept as the reference in
``tests/sim/plan/test_partition.py``)::

    best[0][j] = C(0, 0, j)
    best[s][j] = min over s <= i < j of max(best[s-1][i], C(s, i, j)),   cut[s][j] = the smallest such i

where ``C(s, i, j)`` is the time per microbatch (s) of vstage s holding layers ``[i, j)``, and the partition is read
back from ``cut`` starting at ``(p-1, n)``. Run as written that is O(p·n²) steps of Python. This module returns the
very same ``cut`` chain, float for float, in three steps:

1. **Feasibility of a threshold T** for every prefix at once: ``F_s(T)`` = the ends j such that stages 0..s can
   cover ``[0, j)`` with every stage ≤ T, i.e. ``best[s][j] ≤ T`` (min and max never round, so ``best`` is exactly
   a min over partitions of their largest ``C``). ``C(s, i, j) = ((P[j] - P[i]) + out[j]) + in[i]`` is almost
   ``B[j] - A[i]`` with ``A = P - in`` and ``B = P + out``, so a running maximum of ``A`` over the feasible starts
   answers every j in O(n) numpy work. The two forms differ by a few ulps, bounded by ``StageCosts.margin``; the j whose
   answer falls inside that margin are decided with the exact ``C``. ``G_s(T)``, the starts from which stages
   s..p-1 can cover ``[i, n)``, is the same pass run from the end.
2. **A feasible T close to the optimum** by bisection; each feasible test also yields a partition, whose own
   bottleneck (exact) becomes the new upper bound. Any feasible T is correct for step 3; a close one keeps it small.
3. **The reference DP restricted to the band** ``J_s = F_s(T) ∩ G_{s+1}(T)``. Every i that attains the minimum for
   some ``j ∈ J_s`` lies in ``J_{s-1}``: its value ``max(best[s-1][i], C(s, i, j)) = best[s][j] ≤ T`` puts i in
   ``F_{s-1}``, and ``C(s, i, j) ≤ T`` with ``j ∈ G_{s+1}`` puts i in ``G_s``. So on the band the restricted DP
   computes the same ``best`` and the same smallest-i ``cut`` as the full one, and ``(p-1, n)`` and every cut read
   back from it stay inside the band. Near the optimum the band is a few layers wide per stage (how far a stage end
   can move while every stage stays ≤ T), so this costs about p·width² instead of p·n².

The exact ``C`` is evaluated with numpy in the reference's order of float operations on numbers the oracle gave:
``P[j]`` is ``oracle.stage_compute_s(rank, 0, j)`` (the oracle's prefix sum, so ``P[j] - P[i]`` is its
``stage_compute_s(rank, i, j)``) and ``out``/``in`` are ``oracle.transfer_time`` of ``oracle.boundary_bytes`` asked
once per distinct (bytes, source rank, destination rank). IEEE-754 double arithmetic is the same in numpy and in
Python, so each ``C`` is bitwise the reference's (the tests compare every ``C`` with the oracle's, and
``balanced_counts`` re-costs its answer through the oracle).

Worst cases: when the optimum leaves much slack (one layer far slower than a fair share), the band widens towards
every layer and step 3 tends to p·n² numpy element operations; a model whose every cut has its own activation size
asks the oracle for up to 2·p·n transfer times. Memory is O(p·n) in every case.
"""

from __future__ import annotations

import math

import numpy as np

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle

__all__ = ["StageCosts", "min_max_counts"]

#: Unit roundoff of IEEE-754 double precision.
_UNIT_ROUNDOFF = 2.0 ** -53
#: Largest p·(n+1) table accepted: about 45 bytes a cell (per-stage keys and transfers, the feasibility masks and
#: witnesses), so about 1 GB at the limit; the reference DP would need p·n²/2 ≈ 10^11 steps there.
MAX_CELLS = 20_000_000
#: Most elements of one temporary matrix in the band DP (bounds its memory to a few tens of MB).
_BLOCK = 1 << 20


class StageCosts:
    """``C(s, i, j)``, the time per microbatch (s) of vstage s holding layers ``[i, j)``, as numpy arrays.

    Args:
        oracle: the cost oracle (the only source of numbers).
        ranks: the rank that runs each vstage, in pipeline order.

    Raises:
        SpecError: the table would exceed :data:`MAX_CELLS`.
    """

    def __init__(self, oracle: CostOracle, ranks: tuple[int, ...]) -> None:
        n, p = len(oracle.graph), len(ranks)
        if p * (n + 1) > MAX_CELLS:
            raise SpecError(f"{{partition}} balanced over {n} layers and {p} stages needs {p * (n + 1)} table cells, "
                            f"more than {MAX_CELLS}", "partition")
        self.num_layers, self.num_stages = n, p
        # Cut c in 1..n-1 crosses boundary_bytes(c); cuts 0 and n send nothing and point at an extra 0.0 slot.
        distinct: dict[int, int] = {}
        slot = [0] * (n + 1)
        for cut in range(1, n):
            slot[cut] = distinct.setdefault(oracle.boundary_bytes(cut), len(distinct))
        slot[0] = slot[n] = len(distinct)
        slots = np.array(slot, dtype=np.int64)
        transfers: dict[tuple[int, int], np.ndarray] = {}

        def transfer(src: int, dst: int) -> np.ndarray:
            if (src, dst) not in transfers:
                seconds = [oracle.transfer_time(nbytes, src, dst) for nbytes in distinct] + [0.0]
                transfers[src, dst] = np.array(seconds, dtype=np.float64)[slots]
            return transfers[src, dst]

        prefixes: dict[object, np.ndarray] = {}
        zeros = np.zeros(n + 1)
        self.prefix, self.out, self.inp = [], [], []
        for s, rank in enumerate(ranks):
            device = oracle.device_spec(rank)
            if device not in prefixes:  # the oracle costs a layer range by the rank's device alone
                # stage_compute_s(rank, 0, j) is prefix[j] - 0.0, which is prefix[j] exactly
                prefixes[device] = np.array(oracle.compute_prefix_s(rank), dtype=np.float64)
            self.prefix.append(prefixes[device])
            # As _StageCoster: the output goes to the next vstage's rank unless this is the last stage (or j = n,
            # the 0.0 slot); the input gradient goes back to the previous one unless this is the first (or i = 0).
            self.out.append(transfer(rank, ranks[s + 1]) if s + 1 < p else zeros)
            self.inp.append(transfer(rank, ranks[s - 1]) if s > 0 else zeros)
        # A[i] - B[j] approximates -C(s, i, j) with every term folded into one side (module docstring, step 1).
        self.start_key = [prefix - inp for prefix, inp in zip(self.prefix, self.inp)]
        self.end_key = [prefix + out for prefix, out in zip(self.prefix, self.out)]
        largest = max(float(np.max(np.abs(a))) for a in prefixes.values())
        largest += max(float(np.max(a)) for a in self.out) + max(float(np.max(a)) for a in self.inp)
        if not math.isfinite(largest):
            raise SpecError(f"a stage cost is not finite ({largest}); check the model's layer times and the links")
        # |C - (B[j] - A[i])| <= ~10 u (max|P| + max out + max in) (two roundings in each form, plus the
        # subtraction): the margin takes 64 u of that scale, so no answer outside it can be wrong.
        self.margin = 64 * _UNIT_ROUNDOFF * largest

    def signature(self) -> tuple[bytes, ...]:
        """Every number the partition depends on, as bytes: two tables with the same signature have the same
        optimal partition (a search meets the same table for many candidates)."""
        return tuple(array.tobytes() for arrays in (self.prefix, self.out, self.inp) for array in arrays)

    def exact(self, s: int, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """``C(s, start, end)`` element-wise, in s, with the reference's float operations in its order."""
        prefix = self.prefix[s]
        return ((prefix[end] - prefix[start]) + self.out[s][end]) + self.inp[s][start]

    def bottleneck(self, starts: list[int]) -> float:
        """The slowest stage's time (s) of the partition whose stage s begins at ``starts[s]``."""
        ends = starts[1:] + [self.num_layers]
        return max(float(self.exact(s, i, j)) for s, (i, j) in enumerate(zip(starts, ends)))


def _forward(costs: StageCosts, limit: float) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """``F_s(limit)`` for every s as boolean masks over ends j, with a witness start for each feasible end; None
    when not even the whole chain is feasible."""
    n, p, margin = costs.num_layers, costs.num_stages, costs.margin
    ends = np.arange(1, n - p + 2)
    first = np.zeros(n + 1, dtype=bool)
    first[ends] = costs.exact(0, 0, ends) <= limit
    masks, witnesses = [first], [np.zeros(n + 1, dtype=np.int64)]
    for s in range(1, p):
        prev = masks[-1]
        lo = int(np.argmax(prev))  # the first feasible start; nothing can end at or before it
        if not prev[lo]:
            return None
        hi = n - p + s + 1  # the last end stage s may take and still leave a layer to each later stage
        key = np.where(prev[lo:hi], costs.start_key[s][lo:hi], -np.inf)
        run = np.maximum.accumulate(key)
        offsets = np.arange(hi - lo)
        argrun = np.maximum.accumulate(np.where(key == run, offsets, 0))  # where the running maximum was last set
        jlo = lo + 1
        gap = costs.end_key[s][jlo:hi + 1] - run  # ≈ the smallest C(s, i, j) over feasible i < j
        witness = argrun + lo
        ok = gap <= limit - margin
        unsure = np.flatnonzero((gap <= limit + margin) & ~ok)
        if unsure.size:
            exact = costs.exact(s, witness[unsure], unsure + jlo) <= limit
            ok[unsure[exact]] = True
            for k in unsure[~exact]:  # the approximately best start fails exactly: try every feasible start
                j = int(k) + jlo
                starts = np.flatnonzero(prev[lo:j]) + lo
                hits = np.flatnonzero(costs.exact(s, starts, j) <= limit)
                if hits.size:
                    ok[k], witness[k] = True, starts[hits[0]]
        mask = np.zeros(n + 1, dtype=bool)
        mask[jlo:hi + 1] = ok
        full = np.zeros(n + 1, dtype=np.int64)
        full[jlo:hi + 1] = witness
        masks.append(mask)
        witnesses.append(full)
    return (masks, witnesses) if masks[-1][n] else None


def _backward(costs: StageCosts, limit: float) -> list[np.ndarray]:
    """``G_s(limit)`` for s = 1..p-1 (index s) as boolean masks over starts i; index 0 is unused. ``limit`` must be
    feasible."""
    n, p, margin = costs.num_layers, costs.num_stages, costs.margin
    masks = [np.zeros(0, dtype=bool)] * p
    starts = np.arange(p - 1, n)
    last = np.zeros(n + 1, dtype=bool)
    last[starts] = costs.exact(p - 1, starts, n) <= limit
    masks[p - 1] = last
    for s in range(p - 2, 0, -1):
        nxt = masks[s + 1]
        hi = n - p + s + 1  # the last end stage s may take
        top = hi - int(np.argmax(nxt[hi::-1]))  # the last feasible end; nothing can start at or after it
        # key[k] is end j = s + 1 + k; the suffix minimum over ends > i is read at k = i - s.
        key = np.where(nxt[s + 1:top + 1], costs.end_key[s][s + 1:top + 1], np.inf)
        run = np.minimum.accumulate(key[::-1])[::-1]
        offsets = np.arange(key.size)
        # where, scanning from the right, the running minimum was last set: an end that attains it
        argrun = (key.size - 1 - np.maximum.accumulate(np.where(key[::-1] == run[::-1], offsets, 0)))[::-1]
        i = np.arange(s, top)
        gap = run[i - s] - costs.start_key[s][s:top]
        ok = gap <= limit - margin
        unsure = np.flatnonzero((gap <= limit + margin) & ~ok)
        if unsure.size:
            exact = costs.exact(s, unsure + s, argrun[unsure] + s + 1) <= limit
            ok[unsure[exact]] = True
            for k in unsure[~exact]:
                start = int(k) + s
                ends = np.flatnonzero(nxt[start + 1:top + 1]) + start + 1
                ok[k] = bool(np.any(costs.exact(s, start, ends) <= limit))
        mask = np.zeros(n + 1, dtype=bool)
        mask[s:top] = ok
        masks[s] = mask
    return masks


def _close_threshold(costs: StageCosts, upper: float) -> tuple[float, list[np.ndarray]]:
    """A feasible threshold (s) near the optimum, found by bisection below ``upper`` (a feasible bottleneck), and
    ``F(threshold)``."""
    n, p = costs.num_layers, costs.num_stages
    lower = min(float(prefix[n]) for prefix in costs.prefix) / p  # no stage can beat a fair share of the compute
    # Stop once the bracket is narrower than half a typical layer: a threshold that close adds about one layer of
    # slack per stage to the band, and more bisection would cost more than it saves.
    steps = np.concatenate([np.diff(prefix) for prefix in {id(prefix): prefix for prefix in costs.prefix}.values()])
    positive = steps[steps > 0]
    tolerance = max(0.5 * float(np.median(positive)) if positive.size else 0.0, 1e-12 * upper)
    for _ in range(200):
        if upper - lower <= tolerance:
            break
        middle = math.sqrt(lower * upper) if lower > 0 and upper > 4 * lower else 0.5 * (lower + upper)
        found = _forward(costs, middle)
        if found is None:
            lower = middle
            continue
        witnesses = found[1]
        starts, end = [], n
        for s in range(p - 1, 0, -1):
            end = int(witnesses[s][end])
            starts.append(end)
        upper = min(upper, costs.bottleneck([0, *reversed(starts)]))
    found = _forward(costs, upper)
    assert found is not None, "a partition's own bottleneck must be feasible"
    return upper, found[0]


def min_max_counts(costs: StageCosts, start_counts: tuple[int, ...]) -> tuple[tuple[int, ...], float]:
    """The reference DP's partition (layer counts per stage) and its bottleneck in s.

    Args:
        costs: the stage costs.
        start_counts: any partition (its bottleneck seeds the search), e.g. the uniform one.
    """
    n, p = costs.num_layers, costs.num_stages
    starts = [0]
    for count in start_counts[:-1]:
        starts.append(starts[-1] + count)
    limit, forward = _close_threshold(costs, costs.bottleneck(starts))
    backward = _backward(costs, limit)
    band = [np.flatnonzero(forward[s] & backward[s + 1]) for s in range(p - 1)] + [np.array([n])]
    best = costs.exact(0, 0, band[0])
    cuts: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for s in range(1, p):
        starts_in, best_in, ends = band[s - 1], best, band[s]
        best, cut = np.empty(ends.size), np.empty(ends.size, dtype=np.int64)
        rows = max(1, _BLOCK // max(1, starts_in.size))
        for a in range(0, ends.size, rows):
            j = ends[a:a + rows]
            i = starts_in[:np.searchsorted(starts_in, j[-1])]  # starts before the block's last end
            value = np.maximum(best_in[:i.size], costs.exact(s, i[None, :], j[:, None]))
            value[i[None, :] >= j[:, None]] = np.inf
            pick = np.argmin(value, axis=1)  # the first minimum: the smallest start, as the reference's strict <
            best[a:a + rows], cut[a:a + rows] = value[np.arange(j.size), pick], i[pick]
        assert np.all(np.isfinite(best)), "every end in the band has a start in the previous band"
        cuts.append(cut)
    counts, end = [], n
    for s in range(p - 1, 0, -1):
        start = int(cuts[s][np.searchsorted(band[s], end)])
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts)), float(best[0])
