"""What a search writes and prints: the ranked table, ``candidates.csv``, ``search.json`` and ``pareto.png``.

``search.json`` holds the problem, the strategy, how much of the space was costed and every evaluated candidate
(its ``iteration_time_s``, or ``feasible: false`` and why), one candidate a line. It holds no wall-clock time, so
that the same inputs give the same bytes (the printed summary says how long the search took).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from sim.core.collector import collector_paused
from sim.core.fileio import json_with_record_lines, write_bytes_atomic
from sim.core.parallel_outputs import produce_in_parallel
from sim.hw.topology import Topology
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES
from sim.report.png import figure_png
from sim.report.titles import wrap_title
from sim.search.evaluate import Evaluation
from sim.search.search import SearchResult
from sim.search.space import MODEL_PRECISION, Candidate
from sim.search.trust import Trust

__all__ = ["format_table", "why_no_plan", "candidates_csv", "search_json", "pareto_png", "pareto_front",
           "write_search_outputs", "SEARCH_FORMAT_VERSION", "plot_title"]

SEARCH_FORMAT_VERSION = 1
_COLUMNS = ("rank", "TP", "DP", "PP", "b", "m", "schedule", "recompute", "SP", "ZeRO", "partition", "placement",
            "also", "iteration (s)", "90% interval (s)", "samples/s", "peak GB")


def _partition_text(counts: tuple[int, ...]) -> str:
    """Layer counts per stage, run-length where they repeat: ``6,6,6,6`` → ``6×4``; ``5,7,7,5`` → ``5,7×2,5``."""
    if not counts:
        return "-"
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ",".join(f"{c}×{n}" if n > 1 else f"{c}" for c, n in runs)


def _also(c: Candidate) -> str:
    """The choices beyond the Megatron-era ones: context parallelism, HSDP, precision, compile, expert parallelism
    (``-`` for none)."""
    parts = ([f"CP {c.cp} {c.cp_comm}"] if c.cp > 1 else []) + ([f"HSDP {c.dp_replicate}"] if c.dp_replicate > 1
                                                                   else [])
    parts += ([c.precision] if c.precision != MODEL_PRECISION else []) + (["compile"] if c.compiled else [])
    parts += ([f"EP {c.ep}" + (f" × ETP {c.etp}" if c.etp > 1 else "")] if c.ep * c.etp > 1 else [])
    return ", ".join(parts) or "-"


def _interval_text(e: Evaluation, trust: Trust) -> str:
    """``12.1-13.9`` (s), marked ``*`` outside the validated regimes; ``-`` without calibration."""
    calibration = trust.calibration(e.candidate)
    bounds = calibration.time_interval(e.iteration_time_s)
    if bounds is None:
        return "-"
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}" + ("" if calibration.validated else "*")


def _row(rank: int | str, e: Evaluation, trust: Trust) -> tuple[str, ...]:
    c = e.candidate
    schedule = c.schedule + (f" v={c.chunks}" if c.chunks > 1 else "")
    return (str(rank), str(c.tp), str(c.dp), str(c.pp), str(c.microbatch_size), str(e.microbatches), schedule,
            c.recompute, "yes" if c.sequence_parallel else "-", str(c.zero), _partition_text(e.layer_counts),
            c.rank_order + (f" devices {','.join(map(str, c.devices))}" if c.devices else ""), _also(c),
            f"{e.iteration_time_s:.4f}", _interval_text(e, trust), f"{e.throughput_samples_per_s:.1f}",
            f"{e.max_peak_memory_bytes / 1e9:.2f}")


def format_table(result: SearchResult, top: int) -> str:
    """The ``top`` fastest feasible plans as an aligned text table (peak GB: the highest of the devices; the interval
    of each time from the published runs of its regime, ``*`` outside the validated regimes:
    :mod:`sim.search.trust`)."""
    trust = _trust(result)
    rows = [_COLUMNS] + [_row(i + 1, e, trust) for i, e in enumerate(result.ranked[:top])]
    widths = [max(len(row[k]) for row in rows) for k in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def why_no_plan(result: SearchResult) -> str:
    """Why a search found no feasible plan, in one line for the command's ``error:``: how many plans ran out of
    memory and how many break a rule, and the closest to fitting (the smallest peak over capacity of any device,
    as a ratio, so that a mixed cluster's small and large devices compare fairly) with what it needs; where no plan
    was simulated (a rule broken everywhere, or the screen's bounds), the most common reason.
    """
    evaluations = result.evaluations
    cut = "Ctrl-C" if result.interrupted else "the time budget" if result.stopped_by_budget else ""
    remedy = "let it run longer" if result.interrupted else "give --time-budget more seconds"
    if not evaluations:
        if cut:
            return f"{cut} ended the search before any plan was costed; {remedy}"
        return f"the space has no plan to cost ({result.space_size} candidates)"
    if cut:  # the plans left might fit: say what stopped it, not why the ones reached failed
        reached = (f"{result.screen.screened:,} of {result.space_size:,} plans bounded" if result.screen is not None
                   else f"{len(evaluations):,} of {result.space_size:,} plans costed")
        return f"{cut} ended the search before a plan that fits was simulated ({reached}); {remedy}"
    over = [e for e in evaluations if e.reason.startswith("out of memory")]
    counts = [f"{len(over):,} out of memory"] if over else []
    if len(over) < len(evaluations):
        counts.append(f"{len(evaluations) - len(over):,} breaking a rule")
    head = f"none of the {len(evaluations):,} plans costed is feasible ({', '.join(counts)})"
    tail = "; search.json says why each failed"
    simulated = [(max(peak / cap for peak, cap in zip(e.peak_memory_bytes, e.memory_capacity_bytes) if cap),
                  e.candidate.label(), e) for e in over
                 if any(e.memory_capacity_bytes) and e.peak_memory_bytes]
    if simulated:
        ratio, label, closest = min(simulated, key=lambda item: item[:2])
        return (f"{head}; the closest to fitting is {label}: {closest.reason.removeprefix('out of memory: ')} "
                f"({ratio:.2f} times its memory){tail}")
    reasons: dict[str, int] = {}
    for e in over or evaluations:
        reasons[e.reason] = reasons.get(e.reason, 0) + 1
    reason, count = max(reasons.items(), key=lambda item: item[1])  # the first of the most common, in space order
    return f"{head}; {'the most common reason' if count > 1 else 'the first'}: {reason}{tail}"


def _fields(candidate: Candidate) -> dict[str, Any]:
    """``asdict(candidate)`` without its deep copy (a candidate's fields are numbers, strings and a tuple of ints):
    a screened search writes tens of thousands of them, and the copy was half of writing the files. A frozen
    dataclass's ``__dict__`` holds exactly its fields, in their order (a test holds it to ``dataclasses.fields``),
    and copying it is half the time of reading the fields one by one."""
    return dict(vars(candidate))


def _evaluation_record(e: Evaluation) -> dict[str, Any]:
    candidate = _fields(e.candidate)
    candidate["devices"] = list(candidate["devices"])  # the one tuple field, as the list JSON reads back
    record: dict[str, Any] = {"candidate": candidate, "label": e.candidate.label(), "feasible": e.feasible}
    if not e.feasible:
        record["reason"] = e.reason
    if e.iteration_time_s is not None:
        record.update(iteration_time_s=e.iteration_time_s, throughput_samples_per_s=e.throughput_samples_per_s,
                      microbatches=e.microbatches, layer_counts=list(e.layer_counts),
                      peak_memory_bytes=list(e.peak_memory_bytes),
                      memory_capacity_bytes=list(e.memory_capacity_bytes))
    return record


def search_json(result: SearchResult) -> dict[str, Any]:
    """The ``search.json`` object (see the module docstring)."""
    problem = result.problem
    best = result.best
    return {
        "format_version": SEARCH_FORMAT_VERSION,
        "problem": {"model": problem.model, "topology": problem.topology, "global_batch": problem.global_batch,
                    "memory_limit_bytes": problem.memory_limit_bytes, "memory_headroom": problem.memory_headroom,
                    "profile": problem.profile,
                    "perturbation": problem.perturbation.describe() or None,
                    "space": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(problem.space).items()},
                    # A mixture's routing, where it is not balanced and dropless (as a plan's options record it).
                    **({"routing": problem.routing} if problem.routing != "balanced" else {}),
                    **({"capacity_factor": problem.capacity_factor} if problem.capacity_factor else {}),
                    # How the framework runs every plan, where it is not the default (as the plans' options say).
                    **({"loss": problem.loss} if problem.loss != "fused" else {}),
                    **({"blocks": problem.blocks} if problem.blocks != "eager" else {}),
                    **({"deallocate_pipeline_outputs": True} if problem.deallocate_pipeline_outputs else {}),
                    **({"recompute_modules": list(problem.recompute_modules)}
                       if problem.recompute_modules != DEFAULT_RECOMPUTE_MODULES else {})},
        "strategy": result.strategy,
        "seed": result.seed,
        "space_size": result.space_size,
        "evaluated": len(result.evaluations),
        "feasible": len(result.ranked),
        "coverage": result.coverage,
        "stopped_by_budget": result.stopped_by_budget,
        # The screen's counts and proven gap (not its wall-clock time: the same inputs give the same bytes).
        "screen": None if result.screen is None else {
            key: (None if isinstance(value, float) and math.isinf(value) else value)
            for key, value in asdict(result.screen).items() if key != "screen_s"},
        "best": None if best is None else _evaluation_record(best),
        "candidates": [_evaluation_record(e) for e in result.evaluations],
    }


def _trust(result: SearchResult) -> Trust:
    return Trust(result.problem, Topology.parse(result.problem.topology))


def candidates_csv(result: SearchResult) -> str:
    """Every evaluated candidate, one row each, in the space's order, with the interval of its time and the features
    of its regime it lies outside the validated regimes along (``;``-joined; empty inside one)."""
    trust = _trust(result)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    fields = ["tp", "dp", "pp", "microbatch_size", "schedule", "chunks", "recompute", "sequence_parallel", "zero",
              "rank_order", "partition", "devices", "cp", "cp_comm", "dp_replicate", "precision", "compiled", "ep",
              "etp"]
    writer.writerow([*fields, "microbatches", "feasible", "iteration_time_s", "iteration_time_low_s",
                     "iteration_time_high_s", "outside_regime", "throughput_samples_per_s",
                     "max_peak_memory_bytes", "layer_counts", "peak_memory_bytes", "reason"])
    for e in result.evaluations:
        c = _fields(e.candidate)
        simulated = e.iteration_time_s is not None
        c["devices"] = ";".join(map(str, c["devices"]))
        calibration = trust.calibration(e.candidate)
        bounds = calibration.time_interval(e.iteration_time_s) if simulated else None
        writer.writerow([*(c[f] for f in fields), e.microbatches or "", e.feasible,
                         repr(e.iteration_time_s) if simulated else "",
                         repr(bounds[0]) if bounds else "", repr(bounds[1]) if bounds else "",
                         ";".join(calibration.relaxed),
                         repr(e.throughput_samples_per_s) if simulated else "",
                         e.max_peak_memory_bytes if simulated else "",
                         ";".join(map(str, e.layer_counts)), ";".join(map(str, e.peak_memory_bytes)), e.reason])
    return buffer.getvalue()


def pareto_front(evaluations: tuple[Evaluation, ...]) -> tuple[Evaluation, ...]:
    """Feasible evaluations no other beats in both iteration time and peak memory, by increasing memory."""
    feasible = sorted((e for e in evaluations if e.feasible),
                      key=lambda e: (e.max_peak_memory_bytes, e.iteration_time_s, e.candidate))
    front: list[Evaluation] = []
    for e in feasible:
        if not front or e.iteration_time_s < front[-1].iteration_time_s:
            front.append(e)
    return tuple(front)


def pareto_png(result: SearchResult) -> bytes:
    """Iteration time against peak memory of every plan costed: the simulated ones (feasible, or over the memory
    limit as crosses), the Pareto front of the feasible and the best plan, and behind them, in grey, the lower bounds
    of the plans the screen bounded but the engine did not simulate (each such plan lies above and right of its
    point: it can be no faster and need no less memory)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties
    from matplotlib.ticker import FuncFormatter

    simulated = [e for e in result.evaluations if e.iteration_time_s is not None]
    fig, ax = plt.subplots(figsize=(7.0, 4.6), dpi=120)
    if result.bounded:
        # Arrays, not lists: matplotlib turns a list of tens of thousands of floats into a masked array element by
        # element (0.1 s of a screened search's chart).
        count = len(result.bounded)
        ax.scatter(np.fromiter((peak / 1e9 for peak, _ in result.bounded), float, count),
                   np.fromiter((time_s for _, time_s in result.bounded), float, count), marker=".",
                   s=3, color="#c8c8c8", linewidths=0, rasterized=True,
                   label=f"lower bounds, not simulated ({count:,})")
    for feasible, style in ((True, dict(marker="o", s=14, color="#7f9fbf", label="simulated, fits")),
                            (False, dict(marker="x", s=14, color="#d08080", label="simulated, over the memory limit"))):
        points = [e for e in simulated if e.feasible is feasible]
        if points:
            ax.scatter([e.max_peak_memory_bytes / 1e9 for e in points], [e.iteration_time_s for e in points],
                       **style)
    front = pareto_front(result.evaluations)
    if front:
        ax.plot([e.max_peak_memory_bytes / 1e9 for e in front], [e.iteration_time_s for e in front], "-o",
                color="#1f4e79", markersize=4, drawstyle="steps-post", label="Pareto front")
    best = result.best
    if best is not None:
        ax.scatter([best.max_peak_memory_bytes / 1e9], [best.iteration_time_s], marker="*", s=160, color="#e0a000",
                   edgecolor="black", zorder=5, label=f"best: {best.candidate.label()}")
    if simulated or result.bounded:
        ax.set_yscale("log")
        # Plain numbers on the log axis (matplotlib's default writes a narrow range's ticks as 3.525x10^1).
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("peak memory of the fullest device (GB)")
    ax.set_ylabel("iteration time (s)")
    # Wrapped to the figure as the other charts' titles are (a long model spec or count ran off the right edge).
    renderer = fig.canvas.get_renderer()
    font = FontProperties(size=9)
    room = 0.95 * fig.get_figwidth() * fig.dpi
    lines = [line for part in plot_title(result).split("\n") for line in wrap_title(
        part, lambda text: renderer.get_text_width_height_descent(text, font, ismath=False)[0] <= room, 2)]
    ax.set_title("\n".join(lines), fontsize=9, parse_math=False)
    ax.grid(True, which="both", alpha=0.3)
    if simulated or result.bounded:
        ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return figure_png(fig)


def plot_title(result: SearchResult) -> str:
    """The chart's title: the problem, and what it shows of the space (simulated and bounded counted apart)."""
    problem = result.problem
    simulated = sum(1 for e in result.evaluations if e.iteration_time_s is not None)
    if result.screen is not None:
        shown = (f"{simulated:,} plans simulated, {len(result.bounded):,} more bounded, of {result.space_size:,} "
                 f"({result.screen.screened:,} screened)")
    else:
        shown = f"{simulated:,} of {result.space_size:,} plans simulated"
    return f"{problem.model}\non {problem.topology}, global batch {problem.global_batch}: {shown}"


def write_search_outputs(out: Path, result: SearchResult) -> list[str]:
    """Write ``candidates.csv``, ``search.json`` and ``pareto.png`` into ``out``; their names.

    The table and the chart are made in a forked child while this process encodes ``search.json``
    (:func:`~sim.core.parallel_outputs.produce_in_parallel`): the two halves take about as long (0.3 s each for a
    screened search's 23,700 records on the 2-core machine, 2026-12-07), and they stand between a Ctrl-C and the exit.
    """
    def search_bytes() -> bytes:
        with collector_paused():  # records by the ten thousand, none in a cycle (sim.core.collector)
            return json_with_record_lines(search_json(result), "candidates").encode("utf-8")

    def table_bytes() -> bytes:
        with collector_paused():
            return candidates_csv(result).encode("utf-8")

    search, table, chart = produce_in_parallel([search_bytes, table_bytes, lambda: pareto_png(result)])
    write_bytes_atomic(out / "candidates.csv", table)
    write_bytes_atomic(out / "search.json", search)
    write_bytes_atomic(out / "pareto.png", chart)
    return ["candidates.csv", "search.json", "pareto.png"]
