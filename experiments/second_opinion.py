"""A second opinion on published plans: for every published row of torchtitan (``experiments/data/torchtitan``) and
Megatron-Bridge (``experiments/data/megatron-bridge``), the plan search's best plan for the same model, GPUs, global
batch and precision, beside the published plan: its predicted speed-up, and which dimensions moved. Every number is
the simulator's prediction, not a measurement; the plans that beat the published one by more than
:data:`TRY_ABOVE` are listed for a person to try, not claimed.

**Rows.** torchtitan's current rows and Megatron-Bridge's newest expressible rows, each turned into its ``sim.run``
inputs by its own experiment (:func:`experiments.torchtitan.plan_inputs`, :func:`experiments.megatron_bridge.
plan_inputs`) and predicted by it (``predict_row``); the Megatron-Bridge rows it cannot express are listed as refused,
with its reason, and its superseded rows (an older container's run of the same configuration) are counted, not
judged.

**Problem.** A row's problem is its model preset and sequence length, the topology its ``plan_inputs`` uses, its
global batch, precision and torch.compile choice; rows that share a problem share one search (in the rows' order).

**Published candidate.** The row's inputs as a search :class:`~sim.search.space.Candidate`
(:func:`published_candidate`), costed by :func:`sim.search.evaluate.evaluate`, the engine the search ranks with, so
both sides of the speed-up are costed alike. What of the inputs a candidate cannot carry is named (``not searched``)
and left out of that costing: torchtitan's pipeline rows keep FSDP's parameters from forward to backward
(``reshard_after_forward`` off), which no candidate does, so their search-side time is a little slower than
``predict_row``'s; every other row's two figures are the same engine run.

**Space** (:func:`search_space`; the published candidate's own values are added to each tuple, and a check asserts
it is listed):

* TP, CP, DP, PP: every layout of the GPUs (the search lists every divisor; TP beyond a model's heads or a GPU's
  NVLink domain is listed, and refused or out-raced by the screen at no cost to the answer);
* CP: 1, 2, 4, 8 where each CP rank keeps at least :data:`MIN_CP_TOKENS` tokens, exchanging keys and values by
  all-gather (both frameworks' default); EP (mixtures of experts only): 1, 2, 4, ..., 64; ETP 1;
* schedules 1f1b, interleaved (2 chunks per rank, and the row's own count) and zb1p (gpipe runs 1f1b's ops and holds
  more activations; pipedream's stale weights are not the published runs' semantics);
* microbatch sizes 1 and 2 (and the row's own); recomputation none, selective, full; sequence parallelism with TP
  (both frameworks'); ZeRO 1 (Megatron's distributed optimizer) and 3 (FSDP), for the mixtures of experts ZeRO 1 (and
  the row's own); no HSDP replication; Megatron's ``tp-dp-pp`` rank order; the balanced partition; the row's
  precision and compile choice.

Narrowed for time, and what it leaves out: a first run with 2 and 4 chunks for every row and FSDP for the mixtures
too took 45 minutes on the shared 2-core machine, most of it in the screen of the 256-GPU mixtures (2-4 minutes each;
their expert-parallel bounds are slow to compute); FSDP of a mixture's experts is what no published mixture row runs
(all use Megatron's distributed optimizer), and four chunks per rank are searched where a row uses them.

The strategy is ``screen``: every plan bounded, the engine run on the best bounds until the pick is proven within 1 %
of every plan left (:mod:`sim.search.screen`); memory is each device's own capacity by the ledger. ``--quick`` runs
:data:`QUICK_ROWS` (one 8-GPU torchtitan row, two 8-GPU Megatron-Bridge rows sharing a search) over the same space.

Writes ``second_opinion.csv`` (a row per published row), ``second_opinion.md`` (the table, the plans to try) and
``second_opinion_refused.csv`` (the rows not searched, and why), all or none; the files hold no time, so two runs
with the same workers write the same bytes (the proof simulates ``2 × workers`` plans a round, so its pick may
differ with another worker count, within the 1 % it proves). ``--time-budget`` caps each search and makes the pick
depend on the machine's speed.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

from experiments import megatron_bridge
from experiments.second_opinion_rows import (
    QUICK_ROWS,
    SOURCES,
    Published,
    Refused,
    load_published,
    problem_key,
    published_candidate,
)
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.hw.topology import Topology
from sim.schedules import SCHEDULES
from sim.search.evaluate import Evaluation, evaluate
from sim.search.search import SearchResult, run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace, enumerate_candidates
from sim.search.trust import Trust

__all__ = ["Published", "Refused", "Search", "Opinion", "Result", "SOURCES", "QUICK_ROWS", "TRY_ABOVE",
           "MIN_CP_TOKENS", "load_published", "published_candidate", "problem_key", "search_space", "second_opinion",
           "moved", "summary", "parser", "run", "report", "write"]

#: A searched plan predicted this much faster than the published one (speed-up − 1) is listed for a person to try.
TRY_ABOVE = 0.05
#: Context parallelism is searched down to this many tokens of the sequence per CP rank.
MIN_CP_TOKENS = 2048
#: Candidate fields as the table names them (``moved``).
_FIELD_NAMES = {"microbatch_size": "mb", "sequence_parallel": "sp", "dp_replicate": "hsdp"}


@dataclass(frozen=True)
class Search:
    """One problem's search, shared by the rows of that problem.

    Attributes:
        problem: model, topology, global batch and space.
        space_size: plans in the space.
        simulated: plans the engine costed.
        gap: how much faster than the pick a plan not simulated could be, a fraction of its time (the screen's proof).
        best: the fastest feasible plan (``None``: none fits).
        elapsed_s: wall-clock time of the search, s (not written to the files).
        screen_s: of which the screen's, s (the rest is the proof's engine runs).
    """

    problem: SearchProblem
    space_size: int
    simulated: int
    gap: float
    best: Evaluation | None
    elapsed_s: float
    screen_s: float

    @cached_property
    def trust(self) -> Trust:
        """The regimes and calibrations of this problem's candidates (:mod:`sim.search.trust`)."""
        return Trust(self.problem, Topology.parse(self.problem.topology))


@dataclass(frozen=True)
class Opinion:
    """A published row beside its problem's searched best.

    Attributes:
        row: the published row.
        published: its plan as a search candidate.
        not_searched: options of the row's inputs the candidate cannot carry (costed without them).
        published_eval: the candidate costed by the search's engine.
        search: its problem's search (the same object for rows of one problem).
    """

    row: Published
    published: Candidate
    not_searched: tuple[str, ...]
    published_eval: Evaluation
    search: Search

    def tokens_per_s_per_gpu(self, evaluation: Evaluation | None) -> float | None:
        """``evaluation``'s throughput on this row's problem, tokens/s per GPU (``None`` when not timed)."""
        if evaluation is None or not evaluation.iteration_time_s:
            return None
        return self.row.inputs.global_batch * self.row.seq / evaluation.iteration_time_s / self.row.gpus

    @property
    def published_fits(self) -> bool:
        """Whether the published plan fits in every device's memory by the ledger."""
        return self.published_eval.feasible

    @property
    def speedup(self) -> float | None:
        """The published plan's engine time over the searched best's (``None`` when either is not timed)."""
        best = self.search.best
        if best is None or best.iteration_time_s is None or self.published_eval.iteration_time_s is None:
            return None
        return self.published_eval.iteration_time_s / best.iteration_time_s

    @property
    def versus_measured(self) -> float | None:
        """The searched best's predicted throughput over the published, measured one: the speed-up with the model's
        error on the published plan left in (``None`` when no plan fits)."""
        best = self.tokens_per_s_per_gpu(self.search.best)
        return None if best is None else best / self.row.published_tokens_per_s_per_gpu

    @property
    def speedup_interval(self) -> tuple[float, float] | None:
        """The 90 % interval of the speed-up a person would measure, published plan's measured time over the searched
        best's: the published side is a measurement, so only the best's prediction is uncertain, and its interval
        (:mod:`sim.search.trust`, the published runs of its regime) bounds the ratio: ``versus_measured`` divided by
        the exponentials of the best's residual bounds. ``None`` when no plan fits or nothing calibrates it."""
        ratio, best = self.versus_measured, self.search.best
        if ratio is None or best is None:
            return None
        calibration = self.search.trust.calibration(best.candidate)
        if calibration.low is None or calibration.high is None:
            return None
        return ratio / math.exp(calibration.high), ratio / math.exp(calibration.low)

    @property
    def outside_regime(self) -> tuple[str, ...]:
        """The features of the searched best's regime it lies outside the validated regimes along (empty: inside)."""
        best = self.search.best
        return () if best is None else self.search.trust.calibration(best.candidate).relaxed

    @property
    def surely_faster(self) -> bool:
        """Whether the whole interval of the speed-up lies above 1: called faster only then (issue #40)."""
        interval = self.speedup_interval
        return interval is not None and interval[0] > 1

    @property
    def moved(self) -> tuple[str, ...]:
        """The dimensions in which the searched best differs from the published plan."""
        return () if self.search.best is None else moved(self.published, self.search.best.candidate)

    @property
    def to_try(self) -> bool:
        """Predicted more than :data:`TRY_ABOVE` faster than the published plan."""
        return self.speedup is not None and self.speedup > 1 + TRY_ABOVE


def _union(base: Sequence, *extra) -> tuple:
    return tuple(sorted(set(base) | set(extra)))


def search_space(rows: Sequence[Published], candidates: Sequence[Candidate]) -> SearchSpace:
    """The space searched for ``rows`` (one problem) holding each row's published ``candidates`` (module docstring)."""
    seq = rows[0].seq
    moe = rows[0].inputs.model.split(",")[0] in megatron_bridge.MOE_MODELS
    own = {f.name: {getattr(c, f.name) for c in candidates} for f in fields(Candidate)}
    # the values a candidate's listing keeps (sequence parallelism only under TP, ZeRO only with data-parallel
    # devices, the exchange only under CP, HSDP only under FSDP): a published plan's others are listed regardless
    own["sequence_parallel"] = {c.sequence_parallel for c in candidates if c.tp > 1}
    own["zero"] = {c.zero for c in candidates if c.dp * c.cp > 1}
    own["cp_comm"] = {c.cp_comm for c in candidates if c.cp > 1}
    own["dp_replicate"] = {c.dp_replicate for c in candidates if c.zero == 3}
    return SearchSpace(
        schedules=_union(("1f1b", "interleaved", "zb1p"), *own["schedule"]),
        chunks=_union((2,), *(chunks for chunks in own["chunks"] if chunks > 1)),
        recompute=("none", "selective", "full"),
        microbatch_sizes=_union((1, 2), *own["microbatch_size"]),
        sequence_parallel=_union((True,), *own["sequence_parallel"]),
        zero=_union((1,) if moe else (1, 3), *own["zero"]),
        rank_orders=_union((), *own["rank_order"]),
        partitions=_union((), *own["partition"]),
        cp=_union([cp for cp in (1, 2, 4, 8) if seq // cp >= MIN_CP_TOKENS], *own["cp"]),
        cp_comms=_union(("allgather",), *own["cp_comm"]),
        dp_replicate=_union((1,), *own["dp_replicate"]),
        precisions=_union((), *own["precision"]),
        compile=_union((), *own["compiled"]),
        ep=_union((1, 2, 4, 8, 16, 32, 64) if moe else (1,), *own["ep"]),
        etp=_union((1,), *own["etp"]))


def _in_effect(candidate: Candidate, name: str) -> bool:
    """Whether field ``name`` of ``candidate`` has an effect (sequence parallelism needs TP, the CP exchange CP, ZeRO
    data-parallel devices, HSDP FSDP, chunks an interleaving schedule)."""
    return {"sequence_parallel": candidate.tp > 1, "cp_comm": candidate.cp > 1,
            "zero": candidate.dp * candidate.cp > 1, "dp_replicate": candidate.zero == 3,
            "chunks": SCHEDULES[candidate.schedule].chunked}.get(name, True)


def moved(published: Candidate, best: Candidate) -> tuple[str, ...]:
    """The candidate fields (as the table names them) in which ``best`` differs from ``published``, in field order;
    a field that follows another (sequence parallelism, the CP exchange, ZeRO, HSDP, chunks) only where it has an
    effect in both (TP 8 → 1 moves TP, not sequence parallelism)."""
    return tuple(_FIELD_NAMES.get(f.name, f.name) for f in fields(Candidate)
                 if getattr(published, f.name) != getattr(best, f.name)
                 and _in_effect(published, f.name) and _in_effect(best, f.name))


def _search(problem: SearchProblem, workers: int, time_budget_s: float | None) -> Search:
    start = time.monotonic()
    result: SearchResult = run_search(problem, strategy="screen", workers=workers, time_budget_s=time_budget_s)
    screen = result.screen
    assert screen is not None
    return Search(problem, result.space_size, screen.simulated, screen.gap, result.best, time.monotonic() - start,
                  screen.screen_s)


def second_opinion(rows: Sequence[Published], *, workers: int = 2, time_budget_s: float | None = None,
                   progress: Callable[[int, int, Search], None] | None = None) -> list[Opinion]:
    """Each of ``rows`` beside its problem's searched best, in the rows' order; one search per problem, in the
    order of each problem's first row. ``progress(k, problems, search)`` is called after each search.

    Raises:
        SpecError: a published plan the space does not list (a bug of :func:`search_space`, said plainly).
    """
    groups: dict[tuple, list[Published]] = {}
    for row in rows:
        groups.setdefault(problem_key(row), []).append(row)
    opinions: dict[str, Opinion] = {}
    for k, members in enumerate(groups.values(), start=1):
        published = {row.key: published_candidate(row.inputs) for row in members}
        space = search_space(members, [candidate for candidate, _ in published.values()])
        first = members[0].inputs
        problem = SearchProblem(first.model, first.topology, first.global_batch or 0, space=space, loss=first.loss,
                                blocks=first.blocks, deallocate_pipeline_outputs=first.deallocate_pipeline_outputs,
                                recompute_modules=first.recompute_modules)
        topology = Topology.parse(problem.topology)
        listed = set(enumerate_candidates(problem, topology.num_ranks, topology))
        for key, (candidate, _) in published.items():
            if candidate not in listed:
                raise SpecError(f"the space searched for {key} does not list its published plan "
                                f"{candidate.label()}")
        search = _search(problem, workers, time_budget_s)
        for row in members:
            candidate, left = published[row.key]
            opinions[row.key] = Opinion(row, candidate, left, evaluate(problem, candidate), search)
        if progress is not None:
            progress(k, len(groups), search)
    return [opinions[row.key] for row in rows]


def plan_text(candidate: Candidate) -> str:
    """A compact plan: ``TP8 PP8 DP8 FSDP interleaved v2 mb2 full`` (CP and EP where above 1; ZeRO-1 is Megatron's
    distributed optimizer, FSDP ZeRO-3; the layers of each stage where the partition is not the balanced rule's)."""
    parts = [f"TP{candidate.tp}", f"PP{candidate.pp}", *([f"CP{candidate.cp}"] if candidate.cp > 1 else []),
             f"DP{candidate.dp}", *([f"EP{candidate.ep}"] if candidate.ep > 1 else []),
             *([f"ETP{candidate.etp}"] if candidate.etp > 1 else []),
             *({1: ["ZeRO-1"], 2: ["ZeRO-2"], 3: ["FSDP"]}.get(candidate.zero, [])),
             *([f"HSDP{candidate.dp_replicate}"] if candidate.dp_replicate > 1 else []),
             candidate.schedule + (f" v{candidate.chunks}" if candidate.chunks > 1 else ""),
             f"mb{candidate.microbatch_size}", candidate.recompute]
    if candidate.tp > 1 and not candidate.sequence_parallel:
        parts.append("no-SP")
    if candidate.partition != "balanced":
        parts.append(f"layers {candidate.partition}")
    return " ".join(parts)


def changes(opinion: Opinion) -> str:
    """What moved, from the published value to the searched one: ``tp 8→1; dp 32→256``."""
    best = opinion.search.best
    if best is None:
        return ""
    names = {_FIELD_NAMES.get(f.name, f.name): f.name for f in fields(Candidate)}
    return "; ".join(f"{name} {_value(getattr(opinion.published, names[name]))}→"
                     f"{_value(getattr(best.candidate, names[name]))}" for name in opinion.moved)


def _value(value: object) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def summary(opinions: Sequence[Opinion]) -> dict[str, dict[str, float]]:
    """Per source and in all: rows, rows whose published plan fits by the ledger, rows to try (speed-up above
    1 + :data:`TRY_ABOVE`), the median and largest predicted speed-up, and the median searched best's prediction over
    the published measurement."""
    stats = {}
    for name in (*SOURCES, "all"):
        pick = [o for o in opinions if name in (o.row.source, "all")]
        speedups = [o.speedup for o in pick if o.speedup is not None]
        measured = [o.versus_measured for o in pick if o.versus_measured is not None]
        stats[name] = {"rows": len(pick), "published_fits": sum(o.published_fits for o in pick),
                       "to_try": sum(o.to_try for o in pick),
                       "median_speedup": statistics.median(speedups) if speedups else float("nan"),
                       "max_speedup": max(speedups, default=float("nan")),
                       "median_versus_measured": statistics.median(measured) if measured else float("nan")}
    return stats


def _gb(evaluation: Evaluation | None) -> str:
    return "" if evaluation is None or not evaluation.peak_memory_bytes else \
        f"{evaluation.max_peak_memory_bytes / 1e9:.3f}"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _problem_text(row: Published) -> str:
    inputs = row.inputs
    return (f"{inputs.model} on {inputs.topology}, batch {inputs.global_batch}, {inputs.precision or 'bf16'}"
            f"{', compiled' if inputs.compiled else ''}")


def _csv(opinions: Sequence[Opinion]) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["source", "row", "model", "gpus", "topology", "global_batch", "seq", "precision", "compile",
                     "published_plan", "published_tps_per_gpu", "row_predicted_tps_per_gpu",
                     "search_published_tps_per_gpu", "not_searched", "published_fits", "published_peak_gb",
                     "published_memory", "best_plan", "best_tps_per_gpu", "best_peak_gb", "speedup", "best_vs_measured",
                     "speedup_low", "speedup_high", "surely_faster", "outside_regime", "moved", "changes", "to_try",
                     "space_size", "simulated", "proven_gap", "best_flags"])
    for o in opinions:
        row, best = o.row, o.search.best
        writer.writerow([
            row.source, row.row_id, row.model, row.gpus, row.inputs.topology, row.inputs.global_batch, row.seq,
            row.inputs.precision or "bf16", int(row.inputs.compiled), plan_text(o.published),
            repr(row.published_tokens_per_s_per_gpu), f"{row.predicted_tokens_per_s_per_gpu:.3f}",
            _fmt(o.tokens_per_s_per_gpu(o.published_eval), ".3f"), "; ".join(o.not_searched), int(o.published_fits),
            _gb(o.published_eval), o.published_eval.reason, "" if best is None else plan_text(best.candidate),
            _fmt(o.tokens_per_s_per_gpu(best), ".3f"), _gb(best), _fmt(o.speedup, ".6f"),
            _fmt(o.versus_measured, ".6f"), *_interval_cells(o), int(o.surely_faster), ";".join(o.outside_regime),
            " ".join(o.moved),
            changes(o), int(o.to_try), o.search.space_size, o.search.simulated, f"{o.search.gap:.6f}",
            "" if best is None else " ".join(best.candidate.run_flags(o.search.problem))])
    return text.getvalue()


def _interval_cells(o: Opinion) -> tuple[str, str]:
    interval = o.speedup_interval
    return ("", "") if interval is None else (f"{interval[0]:.6f}", f"{interval[1]:.6f}")


def _interval_text(o: Opinion) -> str:
    """``0.91-1.35×`` (``‡`` outside the validated regimes), ``-`` without one."""
    interval = o.speedup_interval
    if interval is None:
        return "-"
    return f"{interval[0]:.2f}-{interval[1]:.2f}×" + ("‡" if o.outside_regime else "")


def _refused_csv(refused: Sequence[Refused]) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["source", "row", "model", "gpus", "reason"])
    for r in refused:
        writer.writerow([r.source, r.row_id, r.model, r.gpus, r.reason])
    return text.getvalue()


def table(opinions: Sequence[Opinion]) -> list[str]:
    """The Markdown table: a line per row (tokens/s per GPU; ``*`` marks a published plan the ledger says does not
    fit, ``†`` one whose search-side costing leaves an option out, ``‡`` a searched best outside the validated
    regimes)."""
    lines = ["| source | row | model | GPUs | published plan | published | predicted (row) | predicted (search) "
             "| searched best | predicted | speed-up | vs measured | 90 % interval | moved |",
             "|---|---|---|--:|---|--:|--:|--:|---|--:|--:|--:|--:|---|"]
    for o in opinions:
        row, best = o.row, o.search.best
        mark = ("" if o.published_fits else "*") + ("†" if o.not_searched else "")
        lines.append(
            f"| {row.source} | {row.row_id} | {row.model} | {row.gpus} | {plan_text(o.published)}{mark} | "
            f"{row.published_tokens_per_s_per_gpu:,.0f} | {row.predicted_tokens_per_s_per_gpu:,.0f} | "
            f"{_fmt(o.tokens_per_s_per_gpu(o.published_eval), ',.0f')} | "
            f"{'none fits' if best is None else plan_text(best.candidate)} | "
            f"{_fmt(o.tokens_per_s_per_gpu(best), ',.0f')} | {_fmt(o.speedup, '.2f')}× | "
            f"{_fmt(o.versus_measured, '.2f')}× | {_interval_text(o)} | {changes(o) or '-'} |")
    return lines


def to_try(opinions: Sequence[Opinion]) -> list[Opinion]:
    """The rows whose searched best is predicted more than :data:`TRY_ABOVE` faster, fastest speed-up first (ties in
    the rows' order)."""
    picked = [(-(o.speedup or 0.0), k, o) for k, o in enumerate(opinions) if o.to_try]
    return [o for *_, o in sorted(picked, key=lambda item: item[:2])]


def _markdown(opinions: Sequence[Opinion], refused: Sequence[Refused], superseded: int) -> str:
    stats = summary(opinions)
    lines = ["# A second opinion on published plans", "",
             "Written by `python -m experiments.run second_opinion` (`experiments/second_opinion.py`). **Every "
             "speed-up here is the simulator's prediction, not a measurement**: the searched plans were not run. "
             "Throughputs are tokens/s per GPU: *published* is the measured figure, *predicted (row)* the row's "
             "own experiment's prediction, *predicted (search)* the published plan costed by the search's engine, "
             "which the speed-up (published plan's iteration time over the searched best's) compares with; *vs "
             "measured* is the searched best's prediction over the published measurement, the speed-up with the "
             "model's error on the published plan left in, and its *90 % interval* the range a measurement of the "
             "searched best would fall in, from the published runs of its regime (`sim.search.trust`; `‡`: outside "
             "the validated regimes, the CSV's `outside_regime` says along which features); a plan is called faster "
             "only when that whole interval lies above 1 (`surely_faster`). "
             "`*`: the ledger says the published plan does not fit in memory; `†`: an option of the published run "
             "is not a search choice and is left out of its search-side costing (the CSV's `not_searched`).", ""]
    lines += ["| source | rows | published fits | > 5 % faster | median speed-up | max | median vs measured |",
              "|---|--:|--:|--:|--:|--:|--:|"]
    for name in (*SOURCES, "all"):
        s = stats[name]
        lines.append(f"| {name} | {s['rows']} | {s['published_fits']} | {s['to_try']} | "
                     f"{s['median_speedup']:.3f}× | {s['max_speedup']:.3f}× | {s['median_versus_measured']:.3f}× |")
    if refused or superseded:
        lines += ["", f"Not searched: {len(refused)} Megatron-Bridge rows the product cannot express (see "
                  f"`second_opinion_refused.csv`) and {superseded} superseded ones (older containers of a "
                  "configuration judged at its newest)."]
    lines += ["", "## For a person to try", "",
              f"Predicted more than {TRY_ABOVE:.0%} faster than the published plan (a prediction to test, not a "
              "result):", ""]
    picks = to_try(opinions)
    for fits, heading in ((True, []), (False, ["", "Against a published plan the ledger says does not fit (its time "
                                               "is still the engine's; the published run fitted by means the row "
                                               "does not state, such as recomputation):", ""])):
        chosen = [o for o in picks if o.published_fits == fits]
        lines += heading if chosen else []
        for o in chosen:
            assert o.search.best is not None
            verdict = ("faster by its whole interval" if o.surely_faster else "not surely faster: its interval "
                       "reaches 1")
            outside = (f"; outside the validated regimes in {', '.join(o.outside_regime)}" if o.outside_regime
                       else "")
            lines.append(f"- {o.row.key} ({_problem_text(o.row)}): {plan_text(o.search.best.candidate)}, predicted "
                         f"{o.speedup:.2f}× the published {plan_text(o.published)} (against its measurement "
                         f"{_interval_text(o)}, 90 %: {verdict}{outside}): "
                         f"`python -m sim.run {' '.join(o.search.best.candidate.run_flags(o.search.problem))}`")
    lines += ["", "## Every row", "", *table(opinions)]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Result:
    """Every opinion, in the rows' order; the rows refused and why; the superseded Megatron-Bridge rows' count; and
    the number of searches (problems) run."""

    opinions: tuple[Opinion, ...]
    refused: tuple[Refused, ...]
    superseded: int
    searches: int


def parser() -> CliParser:
    """``python -m experiments.run second_opinion [--quick] [--rows ...] [--workers N] [--time-budget S] [--out
    DIR]``."""
    parser = CliParser(prog="python -m experiments.run second_opinion", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/second_opinion", help="output directory (default runs/second_opinion)")
    parser.add_argument("--quick", action="store_true", help=f"rows {', '.join(QUICK_ROWS)} only (CI)")
    parser.add_argument("--rows", help="comma-separated SOURCE:ID rows to search (default: every row)")
    parser.add_argument("--workers", type=int, default=2, help="search processes (default 2)")
    parser.add_argument("--time-budget", type=float, help="seconds per search (default: none; with one, the pick "
                        "depends on the machine's speed)")
    return parser


def run(*, quick: bool = False, rows: str | None = None, workers: int = 2, time_budget: float | None = None,
        progress: Callable[[str], None] | None = None) -> Result:
    """A second opinion on every published row, the rows of ``rows`` (comma-separated ``SOURCE:ID``) or
    (``quick``) :data:`QUICK_ROWS`, with ``workers`` search processes and ``time_budget`` seconds per search;
    ``progress`` is given a line per search.

    Raises:
        SpecError: workers below 1, a budget not above 0, an empty or unknown row (each named by its flag).
    """
    if workers < 1:
        raise SpecError(f"--workers must be >= 1, got {workers}")
    if time_budget is not None and not time_budget > 0:
        raise SpecError(f"--time-budget must be > 0 seconds, got {time_budget}")
    keys = list(QUICK_ROWS) if quick else [k for k in rows.split(",") if k] if rows else None
    if keys is not None and not keys:
        raise SpecError("--rows: empty list")
    try:
        published, refused, superseded = load_published(keys)
    except SpecError as exc:
        raise SpecError(exc.for_flags({"rows": "--quick" if quick else "--rows"})) from None
    start = time.monotonic()

    def searched(k: int, problems: int, search: Search) -> None:
        if progress is not None:
            p = search.problem
            progress(f"  search {k}/{problems}: {p.model} on {p.topology}, batch {p.global_batch}: "
                     f"{search.space_size:,} plans, {search.simulated} simulated, {search.elapsed_s:.1f} s (screen "
                     f"{search.screen_s:.1f} s; {time.monotonic() - start:.0f} s in all)")

    opinions = second_opinion(published, workers=workers, time_budget_s=time_budget, progress=searched)
    return Result(tuple(opinions), tuple(refused), superseded, len({problem_key(row) for row in published}))


def report(result: Result) -> str:
    """The table, the summary per source, and the plans for a person to try."""
    opinions = list(result.opinions)
    lines = [f"{len(opinions)} published rows (torchtitan's current, Megatron-Bridge's newest expressible) beside the "
             f"search's best plan for the same model, GPUs, global batch and precision ({result.searches} searches, "
             "strategy screen, proven within 1 %); tokens/s per GPU; every speed-up is a prediction", *table(opinions)]
    stats = summary(opinions)
    for name in (*SOURCES, "all"):
        s = stats[name]
        lines.append(f"{name}: {s['rows']} rows, published plan fits by the ledger in {s['published_fits']}, median "
                     f"predicted speed-up {s['median_speedup']:.3f}x (max {s['max_speedup']:.3f}x; against the "
                     f"measurement {s['median_versus_measured']:.3f}x), {s['to_try']} predicted > {TRY_ABOVE:.0%} "
                     f"faster")
    lines.append(f"for a person to try (predicted > {TRY_ABOVE:.0%} faster; predictions, not measurements; the 90 % "
                 "interval of the speed-up against the measurement, ‡ outside the validated regimes):")
    for o in to_try(opinions):
        assert o.search.best is not None
        lines.append(f"  {o.row.key:<28} {o.speedup:.2f}x ({_interval_text(o)}: "
                     f"{'faster by its whole interval' if o.surely_faster else 'not surely faster'})  "
                     f"{plan_text(o.published)} -> {plan_text(o.search.best.candidate)}"
                     f"{'  (published over memory by the ledger)' if not o.published_fits else ''}")
    surely = sum(o.surely_faster for o in opinions)
    lines.append(f"called faster (the whole 90 % interval of the speed-up above 1): {surely} of {len(opinions)} rows")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``second_opinion.csv``, ``second_opinion.md`` and ``second_opinion_refused.csv`` in ``out``."""
    write_text_atomic(_csv(result.opinions), out / "second_opinion.csv")
    write_text_atomic(_markdown(result.opinions, result.refused, result.superseded), out / "second_opinion.md")
    write_text_atomic(_refused_csv(result.refused), out / "second_opinion_refused.csv")
    return [out / "second_opinion.csv", out / "second_opinion.md", out / "second_opinion_refused.csv"]
