"""The plan search on vTrain's measured runs: does it pick the configuration that was measured fastest?

The runs of ``data/vtrain/ground_truth_single.csv`` (or of ``--data``, a file with the same columns) are grouped by
(model, GPU count, global batch). Each group's measured (TP, DP, PP, microbatch size) settings are written as a
``--candidates`` CSV and read back by :func:`sim.search.settings.load_settings` (what ``python -m sim.search
--candidates FILE`` reads), and :func:`sim.search.search.run_search` searches exactly those, with every other choice
fixed to what the runs used (Megatron-DeepSpeed: 1F1B, full recomputation, no ZeRO, no sequence parallelism, its
``blocks`` partition, ranks nested tp-dp-pp). Per group: Spearman's ρ between the search's ranking and the measured
times, and the top-1 regret, measured time of the search's pick / the group's measured best − 1. Targets: median
ρ ≥ 0.9, regret ≤ 5 % in ≥ 90 % of the groups.

A group with one configuration has nothing to rank and is counted apart; ρ is taken over groups of three or more
(two points give ±1 by construction), regret over groups of two or more. A setting measured more than once counts
with the mean of its times. A configuration the search rejects (the simulator says it does not fit, though it ran)
is out of the search's ranking but stays in the measured best, so rejecting the fastest run costs regret.

Nothing is fitted here; the kernel model's constants were fitted on the fit half of :mod:`experiments.vtrain`'s
seed-0 split of the shipped file, so the figures are given for all runs and for the held-out half: each group
restricted to its held-out runs, in the search's order. Exhaustive search costs each candidate on its own, so a
search over the held-out settings alone ranks them in that same order (a test checks it). For another ``--data``
file every run is held out.

Writes ``search_vtrain.csv`` (one row per group) and ``search_vtrain.png`` (regret and ρ per group, sorted), all or
none, and prints the table and the summary. ``--quick`` searches a seeded sample of 12 groups.
"""

from __future__ import annotations

import csv
import io
import random
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from experiments.harness import write_csv_png
from experiments.vtrain import DATA, Run, load_runs, spearman, split_runs, topology_of
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.report.png import figure_png
from sim.search.search import SearchResult, run_search
from sim.search.settings import Setting, load_settings
from sim.search.space import SearchProblem, SearchSpace

__all__ = ["Figures", "GroupResult", "group_runs", "megatron_space", "write_candidates", "search_group", "score",
           "Result", "parser", "run", "report", "write", "TARGET_SPEARMAN", "TARGET_REGRET", "TARGET_SHARE"]

TARGET_SPEARMAN = 0.9
#: Top-1 regret allowed in a group (measured time of the pick / measured best − 1) ...
TARGET_REGRET = 0.05
#: ... in at least this share of the groups.
TARGET_SHARE = 0.9
QUICK_GROUPS = 12

Key = tuple[str, int, int]  # (model spec, GPUs, global batch)


@dataclass(frozen=True)
class Figures:
    """How a ranking compares with the measured times of one group (or of its held-out runs).

    Attributes:
        configurations: distinct settings measured.
        ranked: the settings the search ranked (feasible), fastest predicted first.
        spearman: ρ between that order and their measured times (``None`` under three ranked settings).
        pick: the search's pick (``None`` when it ranked none).
        best: the setting measured fastest.
        regret: measured time of the pick / measured best − 1 (``None`` with one configuration or no pick).
    """

    configurations: int
    ranked: tuple[Setting, ...]
    spearman: float | None
    pick: Setting | None
    best: Setting
    regret: float | None


def score(ranked: list[Setting], measured: dict[Setting, float]) -> Figures:
    """Compare ``ranked`` (the search's order; settings absent from ``measured`` are ignored) with ``measured``
    (setting → measured time, s)."""
    order = tuple(s for s in ranked if s in measured)
    best = min(measured, key=lambda s: (measured[s], s))
    rho = spearman(list(range(len(order))), [measured[s] for s in order]) if len(order) >= 3 else None
    pick = order[0] if order else None
    regret = measured[pick] / measured[best] - 1 if pick is not None and len(measured) >= 2 else None
    return Figures(len(measured), order, rho, pick, best, regret)


def _measured(runs: list[Run]) -> dict[Setting, float]:
    """Setting → mean measured time (s) of ``runs``."""
    times: dict[Setting, list[float]] = defaultdict(list)
    for run in runs:
        times[(run.tp, run.dp, run.pp, run.microbatch)].append(run.measured_s)
    return {setting: statistics.fmean(values) for setting, values in times.items()}


@dataclass(frozen=True)
class GroupResult:
    """One group's search and its figures, for all its runs and for its held-out runs (``None`` when it has none)."""

    key: Key
    runs: tuple[Run, ...]
    result: SearchResult
    all: Figures
    held_out: Figures | None

    @property
    def predicted(self) -> dict[Setting, float]:
        """Setting → the search's simulated iteration time, s (feasible or not)."""
        return {(e.candidate.tp, e.candidate.dp, e.candidate.pp, e.candidate.microbatch_size): e.iteration_time_s
                for e in self.result.evaluations if e.iteration_time_s is not None}


def group_runs(runs: list[Run]) -> dict[Key, list[int]]:
    """Indices of ``runs`` by (model, GPUs, global batch), groups ordered by layers, hidden, heads, sequence, GPUs
    and batch (numerically, so the table reads in order)."""
    groups: dict[Key, list[int]] = defaultdict(list)
    for i, run in enumerate(runs):
        groups[(run.model, run.gpus, run.global_batch)].append(i)
    first = {key: runs[members[0]] for key, members in groups.items()}
    return {key: groups[key] for key in sorted(groups, key=lambda k: (
        first[k].layers, first[k].hidden, first[k].heads, first[k].seq, k[1], k[2]))}


def megatron_space(settings: tuple[Setting, ...]) -> SearchSpace:
    """The space of ``settings`` with every other choice as the Megatron-DeepSpeed runs made it."""
    return SearchSpace(schedules=("1f1b",), recompute=("full",), sequence_parallel=(False,), zero=(0,),
                       rank_orders=("tp-dp-pp",), partitions=("blocks",), settings=settings)


def write_candidates(settings: list[Setting], path: Path) -> None:
    """A ``--candidates`` CSV of ``settings``."""
    text = "tp,dp,pp,microbatch_size\n" + "".join(f"{tp},{dp},{pp},{b}\n" for tp, dp, pp, b in settings)
    write_text_atomic(text, path)


def search_group(runs: list[Run], folder: Path, workers: int = 1) -> SearchResult:
    """Search the settings measured in ``runs`` (one group) through a candidates file written into ``folder`` (with
    any multi-server topology file)."""
    run = runs[0]
    for other in runs:
        if other.tp * other.dp * other.pp != other.gpus:
            raise SpecError(f"a run with TP {other.tp} × DP {other.dp} × PP {other.pp} on {other.gpus} GPUs: the "
                            f"search uses every device")
    path = folder / f"candidates-{run.layers}-{run.hidden}-{run.heads}-{run.seq}-{run.gpus}-{run.global_batch}.csv"
    write_candidates(list(_measured(runs)), path)
    problem = SearchProblem(model=run.model, topology=topology_of(run, folder), global_batch=run.global_batch,
                            space=megatron_space(load_settings(path, run.gpus)))
    return run_search(problem, workers=workers)


def _setting_text(setting: Setting | None) -> str:
    return "-" if setting is None else "tp{} dp{} pp{} b{}".format(*setting)


def _model_text(run: Run) -> str:
    return f"L{run.layers} H{run.hidden} A{run.heads} S{run.seq}"


def _summary(name: str, figures: list[Figures]) -> tuple[str, bool]:
    """One line of figures over groups against the targets, and whether both are met."""
    single = sum(f.configurations == 1 for f in figures)
    rhos = [f.spearman for f in figures if f.spearman is not None]
    regrets = [f.regret for f in figures if f.regret is not None]
    unpicked = sum(f.pick is None for f in figures)
    if not rhos or not regrets:
        return f"{name}: {len(figures)} groups, too few configurations to rank", False
    share = sum(r <= TARGET_REGRET for r in regrets) / len(regrets)
    met = statistics.median(rhos) >= TARGET_SPEARMAN and share >= TARGET_SHARE
    return (f"{name}: {len(figures)} groups ({single} with one configuration, not ranked"
            f"{f'; {unpicked} with no configuration the search accepts' if unpicked else ''}); median Spearman "
            f"{statistics.median(rhos):.3f} over {len(rhos)} groups of >= 3 (target {TARGET_SPEARMAN}); regret <= "
            f"{TARGET_REGRET:.0%} in {share:.0%} of {len(regrets)} groups of >= 2 (target {TARGET_SHARE:.0%}); median "
            f"regret {statistics.median(regrets):.1%}, max {max(regrets):.1%}: {'met' if met else 'NOT met'}"), met


def _table(groups: list[GroupResult]) -> list[str]:
    head = (f"{'model':<20} {'GPUs':>4} {'batch':>5} {'configs':>7} {'rejected':>8} {'Spearman':>8}  "
            f"{'search pick':<18} {'measured best':<18} {'regret':>7}")
    lines = [head]
    for group in groups:
        f, run = group.all, group.runs[0]
        rho = "-" if f.spearman is None else f"{f.spearman:.3f}"
        regret = "-" if f.regret is None else f"{f.regret:.1%}"
        rejected = f.configurations - len(f.ranked)
        lines.append(f"{_model_text(run):<20} {run.gpus:>4} {run.global_batch:>5} {f.configurations:>7} {rejected:>8} "
                     f"{rho:>8}  {_setting_text(f.pick):<18} {_setting_text(f.best):<18} {regret:>7}")
    return lines


def _csv(groups: list[GroupResult]) -> str:
    fields = ["layers", "hidden", "heads", "seq", "gpus", "global_batch", "configurations", "ranked", "spearman",
              "pick", "pick_predicted_s", "pick_measured_s", "best", "best_measured_s", "regret",
              "held_out_configurations", "held_out_spearman", "held_out_pick", "held_out_best", "held_out_regret"]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(fields)

    def cell(value: float | None) -> str:
        return "" if value is None else repr(value)

    for group in groups:
        run, f, h = group.runs[0], group.all, group.held_out
        measured = _measured(list(group.runs))
        writer.writerow([run.layers, run.hidden, run.heads, run.seq, run.gpus, run.global_batch, f.configurations,
                         len(f.ranked), cell(f.spearman), _setting_text(f.pick),
                         cell(group.predicted.get(f.pick)) if f.pick else "",
                         cell(measured[f.pick]) if f.pick else "", _setting_text(f.best), repr(measured[f.best]),
                         cell(f.regret), h.configurations if h else 0, cell(h.spearman) if h else "",
                         _setting_text(h.pick) if h else "", _setting_text(h.best) if h else "",
                         cell(h.regret) if h else ""])
    return text.getvalue()


def _plot(groups: list[GroupResult], source: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.2), dpi=120)
    for label, pick, color in (("all runs", lambda g: g.all, "#332288"),
                               ("held-out runs", lambda g: g.held_out, "#CC6677")):
        chosen = [pick(g) for g in groups if pick(g) is not None]
        for ax, values in ((left, sorted(100 * f.regret for f in chosen if f.regret is not None)),
                           (right, sorted(f.spearman for f in chosen if f.spearman is not None))):
            # x: the share of groups at or below each value, so the targets read off the curve directly
            ax.step([(i + 1) / len(values) for i in range(len(values))], values, where="post", color=color,
                    label=f"{label} ({len(values)} groups)")
    left.axhline(100 * TARGET_REGRET, color="#444444", linestyle="--", linewidth=1, label="target: 5 % ...")
    left.axvline(TARGET_SHARE, color="#888888", linestyle=":", linewidth=1, label="... in 90 % of groups")
    left.set_xlabel("share of groups")
    left.set_ylabel("regret of the search's pick (%)")
    right.axhline(TARGET_SPEARMAN, color="#444444", linestyle="--", linewidth=1, label="target: median 0.9")
    right.axvline(0.5, color="#888888", linestyle=":", linewidth=1)
    right.set_xlabel("share of groups")
    right.set_ylabel("Spearman: search's ranking vs measured")
    for ax, corner in ((left, "upper left"), (right, "lower right")):
        ax.set_xlim(0, 1)
        ax.legend(loc=corner, fontsize=8)
    fig.suptitle(f"sim.search over the measured configurations of each group ({source})", fontsize=10)
    fig.tight_layout()
    return figure_png(fig)


@dataclass(frozen=True)
class Result:
    """Every group searched (all, or ``--quick``'s seeded sample), in the file's order, from the file named ``data``;
    ``shipped``: it is the shipped file (its seed-0 split applies; another file's runs are all held out)."""

    data: str
    quick: bool
    shipped: bool
    groups: tuple[GroupResult, ...]


def parser() -> CliParser:
    """``python -m experiments.run search_vtrain [--quick] [--data CSV] [--workers N] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run search_vtrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/search_vtrain", help="output directory (default runs/search_vtrain)")
    parser.add_argument("--data", type=Path, default=DATA, help="a CSV with vTrain's columns (default: the 1,440 "
                        "single-node runs shipped in experiments/data/vtrain)")
    parser.add_argument("--quick", action="store_true", help=f"a seeded sample of {QUICK_GROUPS} groups")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="evaluation processes of each group's "
                        "search (default 1; each search starts its own pool, which costs more than the 2-47 "
                        "candidates of a group save: the full run takes about ten times as long with 2)")
    return parser


def run(*, quick: bool = False, data: Path = DATA, workers: int = 1) -> Result:
    """Search every (model, GPUs, global batch) group of ``data`` (``quick``: :data:`QUICK_GROUPS` of them, seeded)
    with ``workers`` processes per search, and score each ranking against the measured times.

    Raises:
        SpecError: ``workers`` < 1 (named ``--workers``), a malformed file, or a run the search cannot express.
    """
    if workers < 1:
        raise SpecError(f"--workers must be an integer >= 1, got {workers}")
    runs = load_runs(data)
    shipped = data.resolve() == DATA.resolve()
    # The kernel model was fitted on the shipped file's seed-0 fit half only: every run of another file is held out.
    halves = split_runs(runs, 0) if shipped else ["held-out"] * len(runs)
    groups = group_runs(runs)
    keys = list(groups)
    if quick:
        keys = [keys[i] for i in sorted(random.Random(1).sample(range(len(keys)), min(QUICK_GROUPS, len(keys))))]
    done: list[GroupResult] = []
    with tempfile.TemporaryDirectory(prefix="search-vtrain-") as folder:
        for key in keys:
            members = [runs[i] for i in groups[key]]
            held = [runs[i] for i in groups[key] if halves[i] == "held-out"]
            result = search_group(members, Path(folder), workers)
            ranked = [(e.candidate.tp, e.candidate.dp, e.candidate.pp, e.candidate.microbatch_size)
                      for e in result.ranked]
            done.append(GroupResult(key, tuple(members), result, score(ranked, _measured(members)),
                                    score(ranked, _measured(held)) if held else None))
    return Result(data.name, quick, shipped, tuple(done))


def report(result: Result) -> str:
    """What was searched, the table of groups, the configurations rejected, and the figures against the targets for
    all runs and for the held-out runs."""
    done = list(result.groups)
    searched = sum(len(g.runs) for g in done)
    split = ("split by experiments.vtrain's seed-0 shuffle, whose fit half fitted the kernel model's constants"
             if result.shipped else "all held out: the kernel model was fitted on the shipped file only")
    lines = [f"{searched} runs in {len(done)} groups of (model, GPUs, global batch) from {result.data}"
             f"{' (--quick sample)' if result.quick else ''}, {split}; the search itself fits nothing. Each group: "
             f"sim.search over its measured settings, 1F1B, full recompute, no ZeRO, no SP, blocks partition, "
             f"tp-dp-pp", *_table(done)]
    rejected = sum(len(g.result.evaluations) - len(g.result.ranked) for g in done)
    if rejected:
        lines.append(f"{rejected} measured configurations rejected by the search (it predicts they do not fit)")
    lines.append(_summary("all runs", [g.all for g in done])[0])
    lines.append(_summary("held-out runs", [g.held_out for g in done if g.held_out is not None])[0])
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``search_vtrain.csv`` (one row per group) and ``search_vtrain.png`` in ``out``."""
    done = list(result.groups)
    return write_csv_png(out, "search_vtrain", _csv(done), _plot(done, result.data))
