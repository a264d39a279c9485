"""A plan search from end to end: list the space, cost what the strategy picks, rank the feasible plans.

Strategies (``--strategy``):

* ``auto`` (the default): ``exhaustive`` where simulating the whole space is estimated to take at most
  :data:`AUTO_EXHAUSTIVE_S` on the workers given (:func:`auto_strategy`), ``screen`` otherwise; the result says which
  it chose and why.
* ``exhaustive``: cost every candidate of the space (brute force; the oracle the other strategies are measured
  against). Under ``--time-budget`` it costs a seeded uniform sample of the space and says how much it covered.
* ``alpa``: the same over the candidates that honour Alpa's assumption (:mod:`sim.search.alpa`): each stage inside
  one server, the pipeline across servers. A baseline: what a search that assumes the network costs.
* ``anneal``: simulated annealing chains over the same list (:mod:`sim.search.anneal`), costing ``evaluations``
  candidates in all (default: a quarter of the space, at least 50), then a steepest-descent polish of the best: for
  spaces too large to cost whole.
* ``planner``: every candidate ranked by PipeDream's pipeline model without building a plan
  (:mod:`sim.search.planner`), then costed by the simulator best first, ``evaluations`` of them (default: a tenth
  of the space, at least 50) or as many as the time budget allows.
* ``screen``: every candidate bounded from below by its per-stage costs (:mod:`sim.search.screen`, a proven bound
  on its time and memory); the best layouts' partition and placement refined on the bound (:mod:`sim.search.refine`:
  other layer counts and device orders, each bounded); then the engine on the best bounds until the best simulated
  plan is within 1 % of every bound left: the pick proven without simulating the space (the summary says the gap
  and each stage's coverage).
* ``relaxed``: the same, with the best layouts' partition and placement chosen by the differentiable relaxation
  instead (:mod:`sim.search.relaxed.relaxation`, DARTS' softmax over the layer counts and device kinds of each
  stage, descended on a smooth surrogate of the iteration time), for comparison (``experiments.run
  search_strategies``).
* ``dp``: the planner over the space with each pipeline layout's placements replaced by the one an exact dynamic
  program over partition and placement picks (:mod:`sim.search.dp`: PipeDream's planner generalised to devices of
  different speeds), so a mixed cluster's layouts are screened by their best placement instead of at most 24 guesses.
  Its plans carry explicit layer counts (``--partition 5,7,6,6``) and a device order; ``evaluations`` defaults as
  for the planner, a tenth of the listed space.

Ranking: feasible candidates by simulated iteration time (every candidate trains the same global batch, so this is
also throughput), ties broken by the candidate's own order (:class:`~sim.search.space.Candidate` fields), so the
same inputs give the same ranking.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace

from sim.core.collector import collector_paused
from sim.core.errors import SpecError, did_you_mean
from sim.hw.topology import Topology
from sim.models import build_model
from sim.models.routing import parse_routing
from sim.schedules import SCHEDULES
from sim.search.alpa import honours_alpa_assumption
from sim.search.anneal import anneal_chain, polish
from sim.search.dp import joint_candidates
from sim.search.driver import evaluate_all, map_tasks
from sim.search.evaluate import Evaluation
from sim.search.planner import estimate_all
from sim.search.ray_pool import ray_session
from sim.search.refine import refine
from sim.search.screen import Screener, ScreenSummary, prove, screen_in_parallel
from sim.search.screen import summary as screen_summary
from sim.search.space import Candidate, SearchProblem, enumerate_candidates
from sim.search.stopping import interrupted

__all__ = ["SearchResult", "run_search", "STRATEGIES", "check_problem", "auto_strategy", "AUTO_EXHAUSTIVE_S"]

STRATEGIES = ("auto", "exhaustive", "alpa", "anneal", "planner", "dp", "screen", "relaxed")
#: ``auto`` simulates the whole space when that is estimated to take at most this long, s (a person waits seconds).
AUTO_EXHAUSTIVE_S = 10.0
#: The estimate's terms, one core's CPU time on the shared 2-core development machine (2026-12-07, an exhaustive
#: search of GPT spaces of 540 and 1,413 plans: 5.6 s and 24.5 s): building and costing a plan, s, and each compute op
#: of one replica's programs in the engine, s.
AUTO_PLAN_S = 4.3e-3
AUTO_OP_S = 9.1e-5
#: The share of a time budget the screen and its refinement may use; the proof has the rest (and at least the best
#: bound simulated), so a budget that ends the screen still answers with a simulated plan.
SCREEN_BUDGET_SHARE = 0.8
#: Past its deadline, the proof still simulates the best bounds one at a time for up to this long while no plan that
#: fits has been simulated, s (a budget is the answer's time plus at most a couple of seconds).
PROOF_GRACE_S = 1.5
#: Independent annealing chains (each seeded from the search's seed and its index; spread over the workers).
DEFAULT_CHAINS = 4


@dataclass(frozen=True)
class SearchResult:
    """What a search found.

    Attributes:
        problem: the problem searched.
        strategy: the strategy's name.
        space_size: candidates in the space.
        evaluations: every candidate costed, in the space's order.
        stopped_by_budget: the time budget ended the search before the strategy was done.
        elapsed_s: wall-clock time of the search, s.
        seed: the seed of its random choices.
        screen: what the screen and its proof covered (``screen`` strategy only).
        bounded: ``(peak_bytes, time_s)`` lower bounds of every plan the screen bounded that may fit and the engine
            did not simulate (bytes, s), for the chart (``screen`` and ``relaxed`` only).
        chosen_by_auto: why ``auto`` chose ``strategy`` ("" when the strategy was named).
        interrupted: Ctrl-C stopped the search (:mod:`sim.search.stopping`); what it had found is kept.
    """

    problem: SearchProblem
    strategy: str
    space_size: int
    evaluations: tuple[Evaluation, ...]
    stopped_by_budget: bool
    elapsed_s: float
    seed: int
    screen: ScreenSummary | None = None
    bounded: tuple[tuple[int, float], ...] = ()
    chosen_by_auto: str = ""
    interrupted: bool = False

    def __repr__(self) -> str:
        """A few lines, not every evaluation (a screened space's result holds tens of thousands)."""
        best = self.best
        pick = "none feasible" if best is None else f"best {best.candidate.label()} {best.iteration_time_s:.4g} s"
        stopped = ", interrupted" if self.interrupted else ", stopped by its budget" if self.stopped_by_budget else ""
        return (f"SearchResult({self.strategy}: {self.problem.model} on {self.problem.topology}, global batch "
                f"{self.problem.global_batch}; {len(self.evaluations):,} of {self.space_size:,} plans costed, "
                f"{len(self.ranked):,} feasible, {pick}{stopped})")

    @property
    def ranked(self) -> tuple[Evaluation, ...]:
        """Feasible evaluations, fastest first."""
        feasible = [e for e in self.evaluations if e.feasible]
        return tuple(sorted(feasible, key=lambda e: (e.iteration_time_s, e.candidate)))

    @property
    def best(self) -> Evaluation | None:
        """The fastest feasible candidate, or ``None`` when none is."""
        ranked = self.ranked
        return ranked[0] if ranked else None

    @property
    def coverage(self) -> float:
        """Fraction of the space costed."""
        return len(self.evaluations) / self.space_size if self.space_size else 1.0


def check_problem(problem: SearchProblem) -> Topology:
    """Parse the problem's model and topology once, so that a bad spec is one error, not one per candidate; the
    topology.

    Raises:
        SpecError: bad model, topology or routing spec, a global batch < 1, or a negative capacity factor.
    """
    if isinstance(problem.global_batch, bool) or not isinstance(problem.global_batch, int) \
            or problem.global_batch < 1:
        raise SpecError(f"{{global_batch}} must be an integer >= 1, got {problem.global_batch!r}", "global_batch")
    if problem.memory_limit_bytes is not None and problem.memory_limit_bytes <= 0:
        raise SpecError(f"{{memory_limit_bytes}} must be > 0 bytes, got {problem.memory_limit_bytes}",
                        "memory_limit_bytes")
    headroom = problem.memory_headroom
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 <= headroom <= 1:
        raise SpecError(f"{{memory_headroom}} must be a fraction from 0 to 1 of each device's memory, got {headroom!r}",
                        "memory_headroom")
    factor = problem.capacity_factor
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 0:
        raise SpecError(f"{{capacity_factor}} must be a number >= 0 (0: dropless), got {factor!r}", "capacity_factor")
    topology = Topology.parse(problem.topology)
    build_model(problem.model)
    parse_routing(problem.routing)
    return topology


def auto_strategy(problem: SearchProblem, candidates: list[Candidate], workers: int = 1) -> tuple[str, str]:
    """What ``auto`` runs on ``candidates``, and why: ``exhaustive`` where simulating every plan is estimated at most
    :data:`AUTO_EXHAUSTIVE_S` on ``workers`` processes (:data:`AUTO_PLAN_S` per plan and :data:`AUTO_OP_S` per
    compute op of one replica: microbatches x stages x forward and backward), the ``screen`` otherwise."""
    ops = 0
    for candidate in candidates:
        stages = candidate.pp * SCHEDULES[candidate.schedule].chunks_per_rank(candidate.chunks)
        ops += 2 * stages * math.ceil(candidate.microbatches(problem.global_batch))
    estimate_s = (AUTO_PLAN_S * len(candidates) + AUTO_OP_S * ops) / max(1, workers)
    if estimate_s <= AUTO_EXHAUSTIVE_S:
        return "exhaustive", (f"simulating all {len(candidates):,} plans takes about {estimate_s:.0f} s, at most "
                              f"{AUTO_EXHAUSTIVE_S:.0f} s")
    return "screen", (f"simulating all {len(candidates):,} plans would take about {_duration(estimate_s)}; the screen "
                      f"bounds them all and simulates the best until the pick is proven")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def run_search(problem: SearchProblem, *, strategy: str = "auto", workers: int = 1,
               time_budget_s: float | None = None, seed: int = 0,
               progress: Callable[[Evaluation], None] | None = None,
               on_space: Callable[[int], None] | None = None, evaluations: int | None = None,
               chains: int = DEFAULT_CHAINS, ray_address: str | None = None) -> SearchResult:
    """Search ``problem``'s space.

    Args:
        problem: model, cluster, global batch and space.
        strategy: one of :data:`STRATEGIES` (``auto``: :func:`auto_strategy`).
        workers: evaluation processes.
        time_budget_s: wall-clock budget, s (``None``: none).
        seed: seed of every random choice (the evaluation order).
        progress: called with each evaluation as it arrives.
        on_space: called once with the space's size, before anything is costed (to size a progress bar).
        evaluations: ``anneal`` only: candidates to cost over all chains (default: a quarter of the space, >= 50).
        chains: ``anneal`` only: independent chains.
        ray_address: evaluate on this Ray cluster (``local``: a Ray instance of this machine) instead of ``workers``.

    Raises:
        SpecError: an unknown strategy, a bad problem (see :func:`check_problem`), a space too large to list.
    """
    if strategy not in STRATEGIES:
        raise SpecError(f"{{strategy}} must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
                        f"{did_you_mean(strategy, STRATEGIES)}", "strategy")
    topology = check_problem(problem)
    candidates = enumerate_candidates(problem, topology.num_ranks, topology)
    if strategy == "alpa":
        candidates = [c for c in candidates if honours_alpa_assumption(c, topology)]
    if on_space is not None:
        on_space(len(candidates))
    chosen = ""
    if strategy == "auto":
        strategy, chosen = auto_strategy(problem, candidates, workers)
    result = _run_strategy(problem, topology, candidates, strategy, workers, time_budget_s, seed, progress,
                           evaluations, chains, ray_address)
    return replace(result, chosen_by_auto=chosen, interrupted=interrupted())


def _run_strategy(problem: SearchProblem, topology: Topology, candidates: list[Candidate], strategy: str,
                  workers: int, time_budget_s: float | None, seed: int,
                  progress: Callable[[Evaluation], None] | None, evaluations: int | None, chains: int,
                  ray_address: str | None) -> SearchResult:
    if strategy == "anneal":
        return _anneal(problem, topology, candidates, workers, seed, progress, evaluations, chains, time_budget_s,
                       ray_address)
    if strategy in ("screen", "relaxed"):
        return _screen(problem, topology, candidates, workers, seed, progress, time_budget_s, ray_address,
                       strategy)
    if strategy in ("planner", "dp"):
        return _planner(problem, topology, candidates, workers, seed, progress, evaluations, time_budget_s,
                        ray_address, strategy=strategy)
    done = evaluate_all(problem, candidates, workers=workers, time_budget_s=time_budget_s, seed=seed,
                        progress=progress, ray_address=ray_address)
    return SearchResult(problem, strategy, len(candidates), done.evaluations, done.stopped_by_budget,
                        done.elapsed_s, seed)


def _screen(problem: SearchProblem, topology: Topology, candidates: list, workers: int, seed: int,
            progress: Callable[[Evaluation], None] | None, time_budget_s: float | None,
            ray_address: str | None, strategy: str = "screen") -> SearchResult:
    """The screen strategy (and relaxed, the same with the relaxation's refinement): bound every candidate (spread
    over the workers), refine the best layouts, then prove the pick with the engine (:mod:`sim.search.screen`). Under
    a time budget the screen and the proof share it; evaluations come back in the space's order."""
    if time_budget_s is not None and not time_budget_s > 0:
        raise SpecError(f"{{time_budget_s}} must be > 0 seconds, got {time_budget_s!r}", "time_budget_s")
    with ExitStack() as stack:
        if ray_address is not None:  # one session for the screen and every round of the proof
            stack.enter_context(ray_session(ray_address))
        return _screen_in_session(problem, topology, candidates, workers, seed, progress, time_budget_s, ray_address,
                                  strategy)


def _screen_in_session(problem: SearchProblem, topology: Topology, candidates: list, workers: int, seed: int,
                       progress: Callable[[Evaluation], None] | None, time_budget_s: float | None,
                       ray_address: str | None, strategy: str) -> SearchResult:
    start = time.monotonic()
    # Wall-clock deadlines, which the workers read too: the screen's share of the budget, then the whole.
    deadline = None if time_budget_s is None else time.time() + time_budget_s
    screen_deadline = None if time_budget_s is None else time.time() + SCREEN_BUDGET_SHARE * time_budget_s
    screener = Screener(problem, topology)
    bounds = screen_in_parallel(screener, candidates, workers=workers, deadline=screen_deadline,
                                ray_address=ray_address)
    # The best layouts' partition and placement refined on the bound (sim.search.refine): plans added, none removed.
    refined, refined_bounds = refine(screener, candidates, bounds, deadline=screen_deadline,
                                     method="relaxation" if strategy == "relaxed" else "descent")
    screened_at = time.monotonic()
    every_candidate = [*candidates, *refined]
    every_bound = [*bounds, *refined_bounds]
    proved, lowest, stopped = prove(screener, every_candidate, every_bound, workers=workers,
                                    deadline=deadline, seed=seed, progress=progress, ray_address=ray_address,
                                    grace_s=PROOF_GRACE_S)
    with collector_paused():  # tens of thousands of records and no cycle (sim.core.collector)
        # The proof reaches only plans whose bound fits, so only those are looked up: hashing a candidate hashes the
        # tuple of its fields, and doing it for every plan of a large space took a tenth of a second after a Ctrl-C.
        positions: dict[Candidate, list[int]] = {}
        for i, (candidate, bound) in enumerate(zip(every_candidate, every_bound)):
            if bound is not None and bound.fits:
                positions.setdefault(candidate, []).append(i)
        reached = {i for e in proved for i in positions[e.candidate]}
        # The infeasible candidates the screen found say why, as an evaluation would; every evaluation in the order
        # of the space (a plan listed twice, by its last place).
        refused = [(i, Evaluation(c, False, reason=b.reason)) for i, (c, b) in enumerate(zip(candidates, bounds))
                   if b is not None and not b.fits]
        placed = [(positions[e.candidate][-1], e) for e in proved] + refused
        every = tuple(e for _, e in sorted(placed, key=lambda pair: pair[0]))
        summary = screen_summary(bounds, proved, lowest, screened_at - start, refined=len(refined))
        bounded = tuple((b.peak_bytes, b.time_s) for i, b in enumerate(every_bound)
                        if b is not None and b.fits and b.time_s < math.inf and i not in reached)
    return SearchResult(problem, strategy, len(candidates), every,
                        stopped or summary.screened < len(candidates), time.monotonic() - start, seed, summary,
                        bounded)


def _anneal(problem: SearchProblem, topology: Topology, candidates: list, workers: int, seed: int,
            progress: Callable[[Evaluation], None] | None, evaluations: int | None, chains: int,
            time_budget_s: float | None, ray_address: str | None) -> SearchResult:
    """The anneal strategy: ``chains`` chains sharing the evaluation budget (and the time budget), merged, started
    from the dynamic program's best plans (their estimates get a tenth of the time budget)."""
    if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
        raise SpecError(f"{{chains}} must be an integer >= 1, got {chains!r}", "chains")
    total = max(50, len(candidates) // 4) if evaluations is None else evaluations
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise SpecError(f"{{evaluations}} must be an integer >= 1, got {evaluations!r}", "evaluations")
    if time_budget_s is not None and not time_budget_s > 0:
        raise SpecError(f"{{time_budget_s}} must be > 0 seconds, got {time_budget_s!r}", "time_budget_s")
    start = time.monotonic()
    # Wall-clock time, which every worker process reads alike; the polish gets the last tenth of the budget.
    deadline = None if time_budget_s is None else time.time() + 0.9 * time_budget_s
    candidates, starts = _dp_starts(problem, topology, candidates, chains,
                                    None if time_budget_s is None else time.time() + 0.1 * time_budget_s, seed)
    share = [total // chains + (1 if k < total % chains else 0) for k in range(chains)]
    tasks = [(problem, candidates, share[k], seed * 1_000_003 + k, deadline, starts[k] if k < len(starts) else None)
             for k in range(chains) if share[k]]
    merged: dict[int, Evaluation] = {}
    for result in map_tasks(anneal_chain, tasks, workers, ray_address):
        for index, evaluation in result.costed:
            if index not in merged:
                merged[index] = evaluation
                if progress is not None:
                    progress(evaluation)
    chained = len(merged)
    final = None if time_budget_s is None else deadline + 0.1 * time_budget_s
    for _, evaluation in polish(problem, candidates, merged, final):
        if progress is not None:
            progress(evaluation)
    stopped = time_budget_s is not None and (chained < min(total, len(candidates))
                                             or time.time() >= final)  # type: ignore[operator]
    return SearchResult(problem, "anneal", len(candidates), tuple(merged[i] for i in sorted(merged)), stopped,
                        time.monotonic() - start, seed)


def _dp_starts(problem: SearchProblem, topology: Topology, candidates: list, chains: int, deadline: float | None,
               seed: int) -> tuple[list, list[int]]:
    """The list with the dynamic program's plans appended (those not in it already), and the indices of the best
    ``chains`` of them by the planner's estimate (fewer when the deadline leaves some unestimated)."""
    joint = joint_candidates(problem, topology, candidates)
    index = {candidate: i for i, candidate in enumerate(candidates)}
    added = [candidate for candidate in joint if candidate not in index]
    extended = candidates + added
    index.update((candidate, len(candidates) + k) for k, candidate in enumerate(added))
    estimates = estimate_all(problem, topology, joint, deadline=deadline, seed=seed)
    ranked = sorted((value, k) for k, value in enumerate(estimates) if value is not None and value < float("inf"))
    return extended, [index[joint[k]] for _, k in ranked[:chains]]


def _planner(problem: SearchProblem, topology: Topology, candidates: list, workers: int, seed: int,
             progress: Callable[[Evaluation], None] | None, evaluations: int | None,
             time_budget_s: float | None, ray_address: str | None, *, strategy: str = "planner") -> SearchResult:
    """The planner strategy, and dp's (the planner over the program's placements): estimate everything, cost the
    best estimates first. The default budget is a tenth of the listed space either way."""
    listed = len(candidates)
    total = max(50, listed // 10) if evaluations is None else evaluations
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise SpecError(f"{{evaluations}} must be an integer >= 1, got {evaluations!r}", "evaluations")
    start = time.monotonic()
    if strategy == "dp":
        candidates = joint_candidates(problem, topology, candidates)
    deadline = None if time_budget_s is None else time.time() + 0.5 * time_budget_s
    estimates = estimate_all(problem, topology, candidates, deadline=deadline, seed=seed)
    reached = [i for i, value in enumerate(estimates) if value is not None]
    ranked = sorted(reached, key=lambda i: (estimates[i], i))[:total]
    left = None if time_budget_s is None else max(time_budget_s - (time.monotonic() - start), 1e-3)
    done = evaluate_all(problem, [candidates[i] for i in ranked], workers=workers, time_budget_s=left, seed=seed,
                        progress=progress, in_order=True, ray_address=ray_address)
    # Back to the space's order, which every strategy reports, from the order they were costed in.
    index_of = {candidates[i]: i for i in ranked}
    evaluations_ = tuple(sorted(done.evaluations, key=lambda e: index_of[e.candidate]))
    return SearchResult(problem, strategy, listed, evaluations_,
                        done.stopped_by_budget or len(reached) < len(candidates), time.monotonic() - start, seed)
