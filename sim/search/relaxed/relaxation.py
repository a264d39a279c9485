"""A differentiable relaxation of a layout's per-stage choices: the DARTS idea the project started from, the search's
``relaxed`` strategy inside the best layouts (:mod:`sim.search.refine`), and compared with the discrete strategies by
``experiments.run relaxed_search`` and ``experiments.run search_strategies``.

DARTS (Liu, Simonyan and Yang, ICLR'19) replaces a discrete choice among candidate operations by a softmax over
them, descends the gradient of a smooth loss, then keeps each softmax's argmax. Here the choices are those a fixed
layout (TP, DP, PP, microbatch size, schedule) leaves open:

* the layer count of each virtual stage: logits ``a`` (one per stage), ``x = 1 + (n - V) * softmax(a)``, so every
  stage keeps at least one layer and the counts sum to the model's ``n`` layers;
* on a mixed cluster, the kind of device block serving each pipeline rank: logits ``b`` (P x K), ``q =
  softmax(b)`` per rank.

The loss is :class:`sim.search.relaxed.surrogate.Surrogate`: the oracle's stage times (compute, tensor-parallel
collectives, messages) interpolated at fractional cuts; the microbatches times a smooth maximum ``tau * logsumexp(L /
tau)`` of the ranks' times, plus the schedule's fill through the other ranks, plus the slowest update (optimizer step
and data-parallel collectives), plus a penalty holding the kind counts to the cluster's; its gradients are analytic
(checked against finite differences by the tests). Adam descends it for :attr:`RelaxedConfig.iterations` steps while
``tau`` falls geometrically from ``tau_start`` to ``tau_end`` times the mean stage time of the even split (s).
Then:

1. kinds are discretised: the largest probabilities first, each kind until its blocks run out (an argmax that
   respects the cluster's counts);
2. with those kinds fixed (one-hot), the counts are descended again for ``refine_iterations`` steps at ``tau_end``
   (DARTS retrains after discretising; here only the counts are left to adapt to the kinds picked);
3. counts are rounded by largest remainder (each stage keeps its floor, which is >= 1, and the layers left go to the
   largest fractional parts, ties to the earlier stage), so they still sum to n; or, with ``rounding="cuts"``, each
   stage boundary is moved to the integer below or above it, whichever combination has the lowest surrogate
   (:func:`round_cuts`: at most 2^:data:`MAX_FREE_CUTS` combinations, the boundaries whose fractions are nearest
   one half free, the others rounded to nearest). Largest remainder is the relaxation alone; cut rounding adds a
   small discrete search on the same surrogate, which closes the rounding gap where the continuous optimum sits
   between integer points (on 2 V100 + 2 A100 as four stages of 12 GPT layers, largest remainder gives 4,3,3,2 at
   0.1993 s, and the surrogate's discrete optimum, which cut rounding finds, is 4,2,3,3 at 0.1989 s).

``restarts`` runs start from the even split with the cluster's kind mix (restart 0) and from seeded perturbations of
it; the one whose discrete plan has the lowest surrogate (the hard maximum at integer counts, no simulation) is
returned, as a :class:`~sim.search.space.Candidate` with explicit ``partition`` and ``devices`` that
:func:`sim.search.evaluate.evaluate` costs. Work is bounded: ``restarts * (iterations + refine_iterations)`` steps of
O(V * K^2) each, after O((P * K + V * K^2) * n) oracle calls for the tables.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from sim.core.errors import SpecError
from sim.search.relaxed.surrogate import Surrogate
from sim.search.space import Candidate, SearchProblem

__all__ = ["RelaxedConfig", "RelaxedResult", "relax", "largest_remainder", "round_cuts", "assign_kinds",
           "counts_from_logits", "objective", "MAX_STEPS", "ROUNDINGS", "MAX_FREE_CUTS"]

#: The most descent steps one relaxation may take over all restarts.
MAX_STEPS = 200_000
#: The discretisations of the counts (module docstring).
ROUNDINGS = ("largest-remainder", "cuts")
#: Boundaries that :func:`round_cuts` moves both ways at most (2^10 = 1,024 surrogates per restart).
MAX_FREE_CUTS = 10


@dataclass(frozen=True)
class RelaxedConfig:
    """How the relaxation descends.

    Attributes:
        iterations: Adam steps per restart on counts and kinds together, tau annealed.
        refine_iterations: Adam steps per restart on the counts alone once the kinds are fixed.
        restarts: runs from different starting logits (the first from the even split).
        learning_rate: Adam's step on the logits (unitless).
        tau_start: the smooth maximum's first temperature, as a fraction of the even split's mean stage time.
        tau_end: its last temperature, likewise.
        kind_penalty: weight of the kind-count penalty, relative to the surrogate at the start (unitless).
        init_noise: standard deviation of the logits' perturbation in restarts after the first.
        seed: seed of those perturbations.
        rounding: ``largest-remainder`` (the counts) or ``cuts`` (the boundaries, by the surrogate).
    """

    iterations: int = 300
    refine_iterations: int = 100
    restarts: int = 4
    learning_rate: float = 0.05
    tau_start: float = 0.3
    tau_end: float = 0.002
    kind_penalty: float = 1.0
    init_noise: float = 0.5
    seed: int = 0
    rounding: str = "largest-remainder"

    def check(self) -> None:
        """Reject a value out of range (one line naming it)."""
        for name in ("iterations", "refine_iterations", "restarts", "seed"):
            value = getattr(self, name)
            low = 1 if name == "restarts" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecError(f"relaxation {name} must be an integer >= {low}, got {value!r}")
        for name in ("learning_rate", "tau_start", "tau_end", "kind_penalty", "init_noise"):
            value = getattr(self, name)
            positive = name in ("learning_rate", "tau_start", "tau_end")
            bad = not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            if bad or (positive and value == 0):
                raise SpecError(f"relaxation {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                                f"got {value!r}")
        if self.rounding not in ROUNDINGS:
            raise SpecError(f"relaxation rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.tau_end > self.tau_start:
            raise SpecError(f"relaxation tau_end must be <= tau_start ({self.tau_start}), got {self.tau_end}")
        if self.restarts * (self.iterations + self.refine_iterations) > MAX_STEPS:
            raise SpecError(f"relaxation restarts x (iterations + refine_iterations) must be <= {MAX_STEPS:,}, got "
                            f"{self.restarts * (self.iterations + self.refine_iterations):,}")


@dataclass(frozen=True)
class RelaxedResult:
    """What a relaxation picked.

    Attributes:
        candidate: the layout with explicit ``partition`` (layer counts) and ``devices`` (``()``: its own order).
        counts: layers per virtual stage.
        kinds: per pipeline rank, the kind of block picked (an index into ``kinds_names``).
        kinds_names: the kinds (sorted tuples of device model names).
        surrogate_s: the surrogate at the discrete plan (hard maximum), s.
        relaxed_s: the surrogate at the best restart's continuous optimum (at ``tau_end``), s.
        trace: the best restart's surrogate per step, s (phase 1, then the refinement).
        steps: descent steps taken over all restarts.
        elapsed_s: wall-clock time, tables included, s.
    """

    candidate: Candidate
    counts: tuple[int, ...]
    kinds: tuple[int, ...]
    kinds_names: tuple[tuple[str, ...], ...]
    surrogate_s: float
    relaxed_s: float
    trace: tuple[float, ...]
    steps: int
    elapsed_s: float


def counts_from_logits(a: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``x = 1 + (n - V) softmax(a)`` and the softmax."""
    s = np.exp(a - a.max())
    s /= s.sum()
    return 1.0 + (n - len(a)) * s, s


def _softmax_rows(b: np.ndarray) -> np.ndarray:
    e = np.exp(b - b.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def objective(surrogate: Surrogate, a: np.ndarray, b: np.ndarray | None, tau: float | None, lam: float,
              scale: float, fixed_q: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray | None]:
    """The surrogate (s) as a function of the logits and its gradient in them: ``a`` for counts, ``b`` for kinds (or
    ``fixed_q``, then no kind gradient)."""
    x, s = counts_from_logits(a, surrogate.n)
    q = fixed_q if fixed_q is not None else _softmax_rows(b)  # type: ignore[arg-type]
    value, gx, gq, _ = surrogate.value_and_grad(x, q, tau, lam, scale)
    ga = (surrogate.n - len(a)) * (s * gx - s * float(s @ gx))
    if fixed_q is not None:
        return value, ga, None
    gb = q * (gq - (q * gq).sum(axis=1, keepdims=True))
    return value, ga, gb


def largest_remainder(x: np.ndarray | list[float], n: int) -> tuple[int, ...]:
    """Integer counts summing to ``n`` with each count the floor of ``x`` or one more: the layers left after the
    floors go to the largest fractional parts (ties: the earlier stage). Floors below 1 are raised to 1 (every stage
    keeps a layer), taking layers back from the largest counts.

    Raises:
        SpecError: ``n`` is smaller than the number of stages.
    """
    values = np.asarray(x, dtype=float)
    if n < len(values):
        raise SpecError(f"{len(values)} stages cannot each keep a layer of {n}")
    floors = np.maximum(np.floor(values).astype(int), 1)
    left = n - int(floors.sum())
    fractions = values - np.floor(values)
    order = sorted(range(len(values)), key=lambda i: (-fractions[i], i))
    while left > 0:
        for i in order[:left]:
            floors[i] += 1
        left = n - int(floors.sum())
    while left < 0:  # only when some x < 1 was raised: take back from the largest, later stage first on ties
        i = max(range(len(values)), key=lambda i: (floors[i], i))
        floors[i] -= 1
        left += 1
    return tuple(int(c) for c in floors)


def round_cuts(x: np.ndarray, n: int, cost) -> tuple[int, ...]:
    """The counts whose boundaries are each the floor or the ceiling of ``x``'s (``e_j = x_0 + ... + x_{j-1}``) and
    whose ``cost(counts)`` is lowest (ties: the first in the order floors before ceilings, earlier boundaries
    first), every stage keeping a layer. Only the :data:`MAX_FREE_CUTS` boundaries with fractions nearest one half go
    both ways; the others are rounded to nearest."""
    cuts = np.cumsum(np.asarray(x, dtype=float))[:-1]
    stages = len(cuts) + 1
    fractions = cuts - np.floor(cuts)
    free = sorted(sorted(range(len(cuts)), key=lambda j: (abs(fractions[j] - 0.5), j))[:MAX_FREE_CUTS])
    base = np.floor(cuts + 0.5).astype(int)
    best: tuple[float, tuple[int, ...]] | None = None
    for mask in range(1 << len(free)):
        ends = base.copy()
        for bit, j in enumerate(free):
            ends[j] = int(np.floor(cuts[j])) + ((mask >> bit) & 1)
        counts = tuple(int(c) for c in np.diff(np.concatenate(([0], ends, [n]))))
        if len(counts) != stages or min(counts) < 1:
            continue
        value = cost(counts)
        if best is None or value < best[0]:
            best = (value, counts)
    return best[1] if best is not None else largest_remainder(x, n)


def assign_kinds(q: np.ndarray, counts: tuple[int, ...]) -> tuple[int, ...]:
    """A kind per rank from the probabilities ``q`` (P x K): the largest probability first (ties: lower rank, then
    lower kind), each kind while it has blocks left (``counts``), so every kind gets exactly its blocks."""
    left = list(counts)
    chosen: list[int | None] = [None] * q.shape[0]
    pairs = sorted((-float(q[p, k]), p, k) for p in range(q.shape[0]) for k in range(q.shape[1]))
    for _, p, k in pairs:
        if chosen[p] is None and left[k] > 0:
            chosen[p] = k
            left[k] -= 1
    return tuple(int(k) for k in chosen)  # type: ignore[arg-type]


class _Adam:
    """Adam (Kingma and Ba, ICLR'15) with its usual constants, one state per array."""

    def __init__(self, rate: float) -> None:
        self.rate, self.step, self.m, self.v = rate, 0, {}, {}

    def update(self, name: str, value: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if name not in self.m:
            self.m[name], self.v[name] = np.zeros_like(value), np.zeros_like(value)
        m = self.m[name] = 0.9 * self.m[name] + 0.1 * grad
        v = self.v[name] = 0.999 * self.v[name] + 0.001 * grad * grad
        t = self.step
        return value - self.rate * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-12)


def _descend(surrogate: Surrogate, a: np.ndarray, b: np.ndarray | None, config: RelaxedConfig, taus: np.ndarray,
             scale: float, fixed_q: np.ndarray | None, trace: list[float]) -> tuple[np.ndarray, np.ndarray | None]:
    adam = _Adam(config.learning_rate)
    for tau in taus:
        value, ga, gb = objective(surrogate, a, b, float(tau), config.kind_penalty, scale, fixed_q)
        trace.append(value)
        adam.step += 1
        a = adam.update("a", a, ga)
        if gb is not None:
            b = adam.update("b", b, gb)  # type: ignore[arg-type]
    return a, b


def relax(problem: SearchProblem, layout: Candidate, config: RelaxedConfig = RelaxedConfig()) -> RelaxedResult:
    """Pick ``layout``'s layer counts and (on a mixed cluster) the device kind of each pipeline rank by the
    relaxation of the module docstring. Deterministic for a given ``config.seed``.

    Raises:
        SpecError: a bad config, or a layout the surrogate cannot be built for (see :class:`Surrogate`).
    """
    config.check()
    start = time.monotonic()
    surrogate = Surrogate(problem, layout)
    n, stages = surrogate.n, len(surrogate.to_rank)
    blocks = surrogate.blocks
    kinds, ranks = len(blocks.kinds), surrogate.parallel.pp
    mix = np.array(blocks.counts, dtype=float) / ranks
    q_even = np.tile(mix, (ranks, 1))
    even = np.full(stages, n / stages)
    scale, _, _, t0 = surrogate.value_and_grad(even, q_even, None)
    unit = max(float(np.mean(t0)), 1e-12)  # s; a model of free layers still gets a temperature
    taus = unit * np.geomspace(config.tau_start, config.tau_end, config.iterations) if config.iterations else []
    rng = np.random.default_rng(config.seed)
    best: tuple | None = None
    steps = 0
    for restart in range(config.restarts):
        noise = config.init_noise if restart else 0.0
        a = rng.normal(0.0, 1.0, stages) * noise
        b = np.log(np.tile(mix, (ranks, 1))) + rng.normal(0.0, 1.0, (ranks, kinds)) * noise
        trace: list[float] = []
        a, b = _descend(surrogate, a, b if kinds > 1 else None, config, taus, scale,
                        None if kinds > 1 else q_even, trace)
        q = _softmax_rows(b) if kinds > 1 else q_even
        picked = assign_kinds(q, blocks.counts)
        one_hot = np.eye(kinds)[list(picked)]
        a, _ = _descend(surrogate, a, None, config, np.full(config.refine_iterations, unit * config.tau_end), scale,
                        one_hot, trace)
        steps += config.iterations + config.refine_iterations
        x, _ = counts_from_logits(a, n)

        def cost(counts: tuple[int, ...], q: np.ndarray = one_hot) -> float:
            return surrogate.value_and_grad(np.array(counts, dtype=float), q, None)[0]

        counts = largest_remainder(x, n) if config.rounding == "largest-remainder" else round_cuts(x, n, cost)
        discrete = cost(counts)
        relaxed = objective(surrogate, a, None, unit * config.tau_end, 0.0, scale, one_hot)[0]
        key = (discrete, restart)
        if best is None or key < best[0]:
            best = (key, counts, picked, relaxed, tuple(trace))
    (discrete, _), counts, picked, relaxed, trace = best  # type: ignore[misc]
    candidate = replace(layout, partition=",".join(map(str, counts)), devices=blocks.realise(picked))
    return RelaxedResult(candidate, counts, picked, blocks.kinds, float(discrete), float(relaxed), trace, steps,
                         time.monotonic() - start)
