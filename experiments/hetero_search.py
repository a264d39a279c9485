"""Where hardware awareness pays: the searched plan against two assumptions, on mixed clusters.

For each cluster of :data:`CLUSTERS` (8 GPUs of two device models each; every device and link is an entry of the
catalog, ``profiles/hardware/devices.yaml`` and ``links.yaml``, with its source there; the clusters themselves are
illustrations, not systems someone measured) three plans are costed by the same simulator on the real cluster:

1. **searched**: :func:`sim.search.search.run_search`, exhaustive, placements on (which device blocks serve which
   stage), over :data:`SPACE`;
2. **Alpa assumption**: the same over the candidates :mod:`sim.search.alpa` keeps (each stage's devices inside one
   server, the pipeline across servers in the cluster's own order; Alpa's own submeshes may also span whole servers,
   so this baseline is the stricter reading of it that the search implements);
3. **homogeneous assumption**: the plan a search picks when it believes every device is the cluster's most common
   model (ties: the first rank's). The stand-in cluster (:func:`stand_in`, written as ``NAME.standin.yaml``) keeps
   every server, its GPU count and wiring (``intra``; the stand-in device's own default only where it cannot be
   wired so), the network port type and the NIC ports per server (the real count when all servers agree, since a
   YAML file has one ``nics_per_node``; else each server's default for the stand-in device); only the device model
   changes. Its best candidate's settings, with the layer counts the stand-in's balanced partition gave (a plan
   fixes its stages; rebalancing them on the real devices would be hardware awareness), are costed on the real
   cluster by :func:`sim.search.evaluate.evaluate`. When that plan does not fit the real devices, the stand-in's
   ranking is walked down to the first plan that does, and both are reported.

The searched space is :data:`SPACE` with the homogeneous plans' layer counts added as partition choices (candidates
whose stage count differs are infeasible and cost a millisecond), so it holds all three plans: the searched best is
never slower than either (a test checks it). Alpa's search runs over :data:`SPACE` itself.

The space is narrowed so that the five clusters take a few minutes on 2 cores: schedules 1f1b and zb1p (gpipe runs
the same ops as 1f1b and holds more; interleaved's balanced partition is refused on mixed devices,
:mod:`sim.plan.partition`), microbatch sizes 1 and 2 (with 4 as well, every plan and time of the table was the
same, in 5.5 instead of 3.5 minutes), every recompute mode, sequence parallelism off and on, ZeRO
0 and 1, the ``tp-dp-pp`` rank order, the balanced partition. ``--quick`` runs two clusters with a 12-layer GPT over a
narrower space (CI).

Prints a table per cluster (plan settings, iteration time, how much slower than the searched best) and which clusters
show a plan >= :data:`SLOWER` slower; writes ``hetero_search.csv`` (a row per cluster and plan), ``hetero_search.png``
(iteration time over the searched best, bars per cluster) and the topology files, all or none.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_text_atomic
from sim.hw.node_shapes import check_shape, default_shape
from sim.hw.topology import Topology
from sim.report.png import figure_png
from sim.search.evaluate import Evaluation, evaluate
from sim.search.search import SearchResult, run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace

__all__ = ["Cluster", "Comparison", "CLUSTERS", "QUICK_CLUSTERS", "SPACE", "QUICK_SPACE", "SLOWER", "stand_in",
           "fixed_partition", "compare", "Result", "parser", "run", "report", "write", "wrote"]

#: How much slower than the searched best a plan must be to count as the assumption's failure (20 %): the
#: experiment is to show at least one cluster where an assumption costs that much.
SLOWER = 0.20
_MODEL = "gpt:layers=40,hidden=3072,heads=24,seq=2048"  # 4.8 billion parameters: tight on 24 GB cards
_QUICK_MODEL = "gpt:layers=12,hidden=1024,heads=16,seq=1024"


@dataclass(frozen=True)
class Cluster:
    """A cluster to compare on.

    Attributes:
        name: short name, also the stem of its files.
        description: one line for the table.
        topology: a topology spec (``4xV100+4xA100``), used when ``yaml`` is empty.
        yaml: a YAML topology file's text, written as ``NAME.yaml`` into the output folder and searched from there.
        model: model spec.
        global_batch: samples per iteration.
    """

    name: str
    description: str
    topology: str = ""
    yaml: str = ""
    model: str = _MODEL
    global_batch: int = 32


def _yaml(nodes: str, network: str) -> str:
    return f"nodes:\n{nodes}network: {network}\nnics_per_node: 1\n"


CLUSTERS: tuple[Cluster, ...] = (
    Cluster("v100-a100", "4 x V100 SXM2 (cube-mesh NVLink) + 4 x A100 SXM4 (NVSwitch), EDR InfiniBand",
            topology="4xV100+4xA100"),
    Cluster("consumer-ib", "2 x (2 x RTX 4090) + 2 x (2 x RTX 3090), PCIe only, one NDR InfiniBand port per box",
            yaml=_yaml("  - {device: RTX4090, count: 2, intra: pcie, repeat: 2}\n"
                       "  - {device: RTX3090, count: 2, intra: pcie, repeat: 2}\n", "ib-ndr")),
    Cluster("pcie-slower-than-ib", "4 x A100 PCIe (Gen4) + 4 x V100 PCIe (Gen3), PCIe only, one NDR port each: "
            "PCIe 25 / 11 GB/s, network 47 GB/s",
            yaml=_yaml("  - {device: A100-PCIE, count: 4, intra: pcie}\n"
                       "  - {device: V100-PCIE, count: 4, intra: pcie}\n", "ib-ndr")),
    Cluster("h100-a100-25gbe", "4 x H100 SXM5 + 4 x A100 SXM4 (NVSwitch each), one 25 GbE port per server",
            yaml=_yaml("  - {device: H100, count: 4}\n  - {device: A100, count: 4}\n", "eth-25g")),
    Cluster("desktops-ib", "8 one-GPU desktops: 4 x RTX 4090 + 4 x RTX 3090, one HDR InfiniBand port each",
            yaml=_yaml("  - {device: RTX4090, count: 1, intra: pcie, repeat: 4}\n"
                       "  - {device: RTX3090, count: 1, intra: pcie, repeat: 4}\n", "ib-hdr")),
)
QUICK_CLUSTERS: tuple[Cluster, ...] = tuple(replace(c, model=_QUICK_MODEL, global_batch=16)
                                            for c in (CLUSTERS[0], CLUSTERS[1]))

SPACE = SearchSpace(schedules=("1f1b", "zb1p"), microbatch_sizes=(1, 2), partitions=("balanced",))
QUICK_SPACE = SearchSpace(schedules=("1f1b",), recompute=("none",), microbatch_sizes=(1, 2), sequence_parallel=(False,),
                          partitions=("balanced",))


def stand_in(topology: Topology) -> tuple[str, str]:
    """The homogeneous stand-in of ``topology`` as YAML text, and its device's catalog name (the module docstring
    says what is kept)."""
    counts = Counter(device.name for device in topology.devices)
    device = next(d for d in topology.devices if counts[d.name] == max(counts.values()))
    lines = [f"# {Path(topology.spec).name} as if every device were {device.name}: the same servers, GPU counts, "
             "wiring and network", "nodes:"]
    for server in topology.nodes:
        try:
            check_shape(device, server.count, server.intra)
            intra = server.intra
        except SpecError:
            intra = default_shape(device, server.count).intra  # this device cannot be wired so
        lines.append(f"  - {{device: {device.name}, count: {server.count}, intra: {intra}}}")
    lines.append(f"network: {topology.nodes[0].network.name}")  # every server's port after sim.hw.servers.unify_network
    nics = {server.nics for server in topology.nodes}
    if len(nics) == 1:
        lines.append(f"nics_per_node: {nics.pop()}")
    return "\n".join(lines) + "\n", device.name


def fixed_partition(evaluation: Evaluation) -> Candidate:
    """``evaluation``'s candidate with its partition fixed to the layer counts it was costed with."""
    return replace(evaluation.candidate, partition=",".join(map(str, evaluation.layer_counts)))


@dataclass(frozen=True)
class Comparison:
    """One cluster's three plans.

    Attributes:
        cluster: the cluster.
        problem: what was searched on the real cluster (the Alpa search's; the searched one adds partitions).
        stand_in_device: the stand-in's device (catalog name).
        searched: the exhaustive search on the real cluster.
        alpa: the Alpa-assumption search on the real cluster.
        homogeneous: the exhaustive search on the stand-in.
        pick: the stand-in's best, costed on the real cluster (``None`` when nothing fits the stand-in).
        fits: the first of the stand-in's ranking that fits the real cluster (``pick`` when it does; ``None`` when
            none does).
    """

    cluster: Cluster
    problem: SearchProblem
    stand_in_device: str
    searched: SearchResult
    alpa: SearchResult
    homogeneous: SearchResult
    pick: Evaluation | None
    fits: Evaluation | None

    def relative(self, evaluation: Evaluation | None) -> float | None:
        """``evaluation``'s iteration time over the searched best's (``None`` when either is missing)."""
        best = self.searched.best
        if evaluation is None or best is None or evaluation.iteration_time_s is None:
            return None
        return evaluation.iteration_time_s / best.iteration_time_s

    def plans(self) -> list[tuple[str, Evaluation | None]]:
        """(name, plan) rows: searched, Alpa, the homogeneous pick, and the first that fits when it differs."""
        rows = [("searched", self.searched.best), ("alpa", self.alpa.best), ("homogeneous", self.pick)]
        if self.fits is not self.pick:
            rows.append(("homogeneous-fits", self.fits))
        return rows


def compare(cluster: Cluster, folder: Path, space: SearchSpace = SPACE, workers: int = 1) -> Comparison:
    """The three plans of ``cluster`` (module docstring); its topology files are written into ``folder``."""
    topology = cluster.topology
    if cluster.yaml:
        path = folder / f"{cluster.name}.yaml"
        write_text_atomic(cluster.yaml, path)
        topology = str(path)
    text, device = stand_in(Topology.parse(topology))
    stand_in_path = folder / f"{cluster.name}.standin.yaml"
    write_text_atomic(text, stand_in_path)
    problem = SearchProblem(model=cluster.model, topology=topology, global_batch=cluster.global_batch, space=space)
    homogeneous = run_search(replace(problem, topology=str(stand_in_path)), workers=workers)
    pick = fits = None
    for rank, chosen in enumerate(homogeneous.ranked):
        costed = evaluate(problem, fixed_partition(chosen))
        pick = costed if rank == 0 else pick
        if costed.feasible:
            fits = costed
            break
    counts = tuple(e.candidate.partition for e in (pick, fits) if e is not None)
    wider = replace(space, partitions=tuple(dict.fromkeys(space.partitions + counts)))
    searched = run_search(replace(problem, space=wider), workers=workers)
    alpa = run_search(problem, strategy="alpa", workers=workers)
    return Comparison(cluster, problem, device, searched, alpa, homogeneous, pick, fits)


_HEAD = (f"  {'plan':<17} {'TP':>2} {'DP':>2} {'PP':>2} {'b':>2} {'schedule':>8} {'recompute':>9} {'SP':>2} "
         f"{'ZeRO':>4}  {'layers per stage':<18} {'devices':<16} {'iteration (s)':>13} {'vs searched':>11}")


def _row(name: str, evaluation: Evaluation | None, relative: float | None) -> str:
    if evaluation is None:
        return f"  {name:<17} no plan fits"
    c = evaluation.candidate
    devices = ",".join(map(str, c.devices)) or "cluster order"
    line = (f"  {name:<17} {c.tp:>2} {c.dp:>2} {c.pp:>2} {c.microbatch_size:>2} {c.schedule:>8} {c.recompute:>9} "
            f"{'on' if c.sequence_parallel else '-':>2} {c.zero:>4}  {_counts(evaluation):<18} {devices:<16} "
            f"{evaluation.iteration_time_s:>13.4f} {_percent(relative):>11}")
    return line + ("" if evaluation.feasible else f"  does not fit: {evaluation.reason}")


def _counts(evaluation: Evaluation) -> str:
    return ",".join(map(str, evaluation.layer_counts))


def _percent(relative: float | None) -> str:
    return "-" if relative is None else f"{relative - 1:+.1%}"


def _table(comparison: Comparison) -> list[str]:
    c = comparison
    name = Path(c.problem.topology).name
    lines = [f"{c.cluster.name}: {c.cluster.description}",
             f"  topology {name}, stand-in {c.cluster.name}.standin.yaml (every device {c.stand_in_device}); "
             f"{c.cluster.model}, global batch {c.cluster.global_batch}; plans costed: searched "
             f"{c.searched.space_size:,}, Alpa {c.alpa.space_size:,}, stand-in {c.homogeneous.space_size:,}", _HEAD]
    lines += [_row(plan, evaluation, c.relative(evaluation)) for plan, evaluation in c.plans()]
    return lines


def _summary(done: list[Comparison]) -> list[str]:
    lines = []
    for label, plan in (("Alpa assumption", lambda c: c.alpa.best), ("homogeneous assumption", lambda c: c.fits)):
        slow = [f"{c.cluster.name} ({_percent(c.relative(plan(c)))})" for c in done
                if plan(c) is not None and c.relative(plan(c)) is not None and c.relative(plan(c)) >= 1 + SLOWER]
        none = [c.cluster.name for c in done if plan(c) is None and c.searched.best is not None]
        text = f"{label}: a plan >= {SLOWER:.0%} slower than the searched best on {len(slow)} of {len(done)} clusters"
        text += f": {', '.join(slow)}" if slow else ""
        lines.append(text + (f"; no plan that fits on {', '.join(none)}" if none else ""))
    unfit = [c.cluster.name for c in done if c.pick is not None and not c.pick.feasible]
    if unfit:
        lines.append(f"the homogeneous pick does not fit the real devices on {', '.join(unfit)} (its first plan "
                     "that fits is the row 'homogeneous-fits', counted above)")
    return lines


def _csv(done: list[Comparison]) -> str:
    fields = ["cluster", "topology", "stand_in_device", "model", "global_batch", "plan", "space_size", "tp", "dp",
              "pp", "microbatch_size", "microbatches", "schedule", "recompute", "sequence_parallel", "zero",
              "layer_counts", "devices", "feasible", "reason", "iteration_time_s", "relative_to_searched"]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(fields)
    for c in done:
        sizes = {"searched": c.searched.space_size, "alpa": c.alpa.space_size}
        for plan, e in c.plans():
            head = [c.cluster.name, Path(c.problem.topology).name, c.stand_in_device, c.cluster.model,
                    c.cluster.global_batch, plan, sizes.get(plan, c.homogeneous.space_size)]
            if e is None:
                writer.writerow(head + [""] * (len(fields) - len(head) - 4) + [False, "no plan fits", "", ""])
                continue
            k, relative = e.candidate, c.relative(e)
            writer.writerow(head + [k.tp, k.dp, k.pp, k.microbatch_size, e.microbatches, k.schedule, k.recompute,
                                    k.sequence_parallel, k.zero, _counts(e), ",".join(map(str, k.devices)),
                                    e.feasible, e.reason, repr(e.iteration_time_s),
                                    "" if relative is None else repr(relative)])
    return text.getvalue()


def _plot(done: list[Comparison]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(done)), 4.2), dpi=120)
    bars = (("searched", lambda c: c.searched.best, "#332288"), ("Alpa assumption", lambda c: c.alpa.best, "#88CCEE"),
            ("homogeneous assumption", lambda c: c.fits, "#CC6677"))
    width = 0.26
    for i, (label, plan, color) in enumerate(bars):
        for x, c in enumerate(done):
            relative = c.relative(plan(c))
            at = x + (i - 1) * width
            if relative is None:
                ax.text(at, 0.05, "no plan fits", rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            ax.bar(at, relative, width, color=color, label=label if x == 0 else None)
            # the homogeneous pick that overflows the real devices is drawn by the first of its ranking that fits
            note = f"{relative - 1:+.0%}" + ("\npick OOM" if i == 2 and c.pick is not c.fits else "")
            ax.text(at, relative + 0.02, note, ha="center", va="bottom", fontsize=7)
    ax.axhline(1 + SLOWER, color="#444444", linestyle="--", linewidth=1, label=f"{SLOWER:.0%} slower")
    ax.set_xticks(range(len(done)), [c.cluster.name for c in done], fontsize=8)
    ax.set_ylabel("iteration time / searched best")
    ax.set_ylim(0, max([1 + SLOWER] + [c.relative(p(c)) or 0 for c in done for _, p, _ in bars]) * 1.25)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_title("simulated iteration time on mixed clusters: the search vs the assumptions' plans", fontsize=10)
    fig.tight_layout()
    return figure_png(fig)


@dataclass(frozen=True)
class Result:
    """Whether quick, the space searched, and the comparison of each cluster in order."""

    quick: bool
    space: SearchSpace
    comparisons: tuple[Comparison, ...]


def parser() -> CliParser:
    """``python -m experiments.run hetero_search [--quick] [--workers N] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run hetero_search", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/hetero_search", help="output directory (default runs/hetero_search)")
    parser.add_argument("--quick", action="store_true", help="two clusters, a 12-layer GPT, a narrower space (CI)")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="evaluation processes of each search (default 2)")
    return parser


def run(*, out: Path, quick: bool = False, workers: int = 2) -> Result:
    """The three plans of every cluster (``quick``: :data:`QUICK_CLUSTERS` over :data:`QUICK_SPACE`), ``workers``
    processes a search; each cluster's topology and stand-in YAML are written into ``out`` (the searches read them).

    Raises:
        SpecError: ``workers`` < 1 (named ``--workers``).
    """
    if workers < 1:
        raise SpecError(f"--workers must be an integer >= 1, got {workers}")
    clusters, space = (QUICK_CLUSTERS, QUICK_SPACE) if quick else (CLUSTERS, SPACE)
    return Result(quick, space, tuple(compare(cluster, out, space, workers) for cluster in clusters))


def report(result: Result) -> str:
    """What is compared, a table per cluster, then the summary over clusters."""
    space, done = result.space, list(result.comparisons)
    lines = [f"{len(done)} mixed clusters{' (--quick)' if result.quick else ''}: the searched plan (exhaustive, "
             f"placements on), the Alpa assumption's and the homogeneous assumption's, each costed by the simulator "
             f"on the real cluster; schedules {','.join(space.schedules)}, recompute {','.join(space.recompute)}, "
             f"microbatch sizes {','.join(map(str, space.microbatch_sizes))}"]
    for comparison in done:
        lines += ["", *_table(comparison)]
    return "\n".join([*lines, "", *_summary(done)])


def write(result: Result, out: Path) -> list[Path]:
    """``hetero_search.csv`` (one row per cluster and plan) and ``hetero_search.png`` in ``out`` (``run`` wrote the
    topology files there)."""
    done = list(result.comparisons)
    return write_csv_png(out, "hetero_search", _csv(done), _plot(done))


def wrote(out: Path, files: list[Path]) -> str:
    """The ``wrote`` line, naming the topology files ``run`` wrote beside ``write``'s."""
    return f"wrote {out}/{{hetero_search.csv, hetero_search.png, <cluster>.yaml, <cluster>.standin.yaml}}"
