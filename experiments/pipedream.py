"""PipeDream's claims on its own terms, simulated (PipeDream, SOSP'19 §3.2–3.3): a steady state without stalls, the
memory of weight stashing against GPipe and 1F1B, and the throughput against data parallelism.

PipeDream (Narayanan et al., SOSP'19) runs 1F1B across minibatch boundaries with no flush (§3.2) and keeps one
stashed weight version per minibatch in flight (§3.3, ``num_versions = warmup + 1 = p − r`` on stage r in its
runtime). Every simulated figure comes from the product (:func:`sim.plan.build.build_plan` then
:func:`sim.predict.predict`), in three parts:

1. ``steady``: :data:`UNIFORM` (8 identical layers, 1 ms forward and 2 ms backward per sample, no weights) on
   ``{p}xideal`` for p ∈ {2, 4, 8} and m ∈ {p, 4p, 16p}. On stage r the steady-state window runs from the start of
   its first backward (the pipeline is full: microbatch 0 has come back) to the end of its backward number
   m − p + r (what follows is the drain, the last p − r − 1 backwards, mirror of the p − r − 1 warm-up forwards).
   The busy fraction of the ``pipedream`` plan in that window, measured from the trace's compute spans, is set
   beside its closed form 1 and the window's length beside (m − p + r + 1)·t_b + (m − p + r)·t_f, with
   t_f = 8/p ms and t_b = 16/p ms per stage. A ``1f1b`` plan flushes after every minibatch of m microbatches, so a
   run of them repeats the whole iteration, fill and drain included: its busy fraction over the iteration (every
   stage) is set beside m/(m + p − 1), an idle (p − 1)/(m + p − 1). Inside one iteration 1F1B's window is just as
   full; the difference is that PipeDream fills and drains once per run, not once per minibatch.
2. ``memory``: per stage, weight copies and activations in flight of ``pipedream``, ``1f1b`` and ``gpipe`` from
   :func:`experiments.memory.simulate` (its uniform model, its closed forms), beside PipeDream's p − r.
3. ``throughput``: :func:`experiments.pipedream_vs_dp.compare` for its models and clusters (its logic, unchanged),
   DP's time against the best pipeline plan's, beside the published 5.28× (Cluster-A) and 2.98× (Cluster-B).

Writes ``pipedream.csv`` (one row per measured quantity, long form) and ``pipedream.png``, all or none.
``--quick``: p ∈ {2, 4} and VGG-16 on Clusters A and B with one microbatch per device (CI).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from pathlib import Path

from experiments import memory, pipedream_vs_dp
from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.hw.topology import Topology
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["UNIFORM", "PS", "SteadyRow", "steady_window", "simulate_steady", "memory_rows", "throughput", "Result",
           "parser", "run", "report", "write"]

#: 8 identical layers, forward 1 ms and backward 2 ms per sample, no weights (so the optimizer steps take no time).
UNIFORM = "uniform:layers=8,fwd_ms=1,bwd_ms=2"
LAYERS, LAYER_F_S, LAYER_B_S = 8, 1e-3, 2e-3
PS, M_FACTORS = (2, 4, 8), (1, 4, 16)
MEMORY_SCHEDULES = ("pipedream", "1f1b", "gpipe")
#: The published speed-ups over DP (SOSP'19 Table 1, recalled; the abstract's "up to 5.3x" is verified).
PAPER = {"A": 5.28, "B": 2.98}
REASON = ("PipeDream's 15-1 plan replicates the convolutions on 15 GPUs and gives the FC layers one GPU; every "
          "stage of our plans has the same replica count, so the FC gradients cross Ethernet as under DP")


@dataclass(frozen=True)
class SteadyRow:
    """One stage of one simulated plan of the steady part; times in s.

    Attributes:
        schedule, p, m, stage: the plan and the pipeline rank.
        window_s: the steady-state window's length (0 when the stage has none: never at m ≥ p).
        window_busy_s: compute time inside the window.
        busy_s: the stage's compute time over the whole plan.
        makespan_s: the plan's iteration time.
    """

    schedule: str
    p: int
    m: int
    stage: int
    window_s: float
    window_busy_s: float
    busy_s: float
    makespan_s: float

    @property
    def window_fraction(self) -> float:
        """Busy fraction in the steady-state window."""
        return self.window_busy_s / self.window_s

    @property
    def plan_fraction(self) -> float:
        """Busy fraction over the whole plan."""
        return self.busy_s / self.makespan_s

    def closed_window_s(self) -> float:
        """(m − p + r + 1)·t_b + (m − p + r)·t_f of :data:`UNIFORM` on p stages (s)."""
        k = self.m - self.p + self.stage
        per = LAYERS // self.p
        return (k + 1) * per * LAYER_B_S + k * per * LAYER_F_S


def steady_window(spans: list, p: int, m: int, rank: int) -> tuple[float, float]:
    """``(start, end)`` of rank's steady-state window (module docstring) from its compute spans (s)."""
    backwards = sorted((s for s in spans if s.kind == "B"), key=lambda s: s.start)
    if len(backwards) != m or m < p:  # m < p: the warm-up never ends on the first stages
        raise ValueError(f"rank {rank}: {len(backwards)} backwards, expected m = {m} >= p = {p}")
    return backwards[0].start, backwards[m - p + rank].end


def simulate_steady(schedule: str, p: int, m: int) -> list[SteadyRow]:
    """Build and simulate one plan of :data:`UNIFORM` on ``{p}xideal`` and measure every stage's window."""
    built = build_plan(PlanInputs(UNIFORM, f"{p}xideal", schedule, microbatches=m))
    trace = predict_built(built).trace
    rows = []
    for r in range(p):
        compute = trace.on_rank(r, "compute")
        start, end = steady_window(compute, p, m, r)
        inside = sum(max(0.0, min(s.end, end) - max(s.start, start)) for s in compute)
        rows.append(SteadyRow(schedule, p, m, r, end - start, inside, sum(s.duration for s in compute),
                              trace.makespan))
    return rows


def steady_rows(ps: tuple[int, ...]) -> list[SteadyRow]:
    """``pipedream`` and ``1f1b`` for every p in ``ps`` and m in {p, 4p, 16p}."""
    return [row for p in ps for k in M_FACTORS for s in ("pipedream", "1f1b") for row in simulate_steady(s, p, p * k)]


def memory_rows(ps: tuple[int, ...]) -> list[memory.StageRow]:
    """:func:`experiments.memory.simulate` of its uniform model for pipedream, 1f1b and gpipe, m ∈ {p, 4p}."""
    return [row for p in ps for m in (p, 4 * p) for s in MEMORY_SCHEDULES
            for row in memory.simulate("uniform", memory.UNIFORM, f"{p}xideal", s, 1, False, m)]


def throughput(quick: bool) -> list[pipedream_vs_dp.Comparison]:
    """``pipedream_vs_dp.compare`` over its models and clusters; quick: VGG-16 on A and B, one microbatch per
    device (its own ``--quick`` rule)."""
    if not quick:
        return [pipedream_vs_dp.compare(model, cluster) for model in pipedream_vs_dp.MODELS.values()
                for cluster in pipedream_vs_dp.CLUSTERS.values()]
    model = pipedream_vs_dp.MODELS["vgg16"]
    out = []
    for key in ("A", "B"):
        cluster = pipedream_vs_dp.CLUSTERS[key]
        devices = Topology.parse(cluster.topology).num_ranks
        out.append(pipedream_vs_dp.compare(replace(model, global_batch=model.microbatch_size * devices), cluster))
    return out


def _pair(rows: list[SteadyRow], schedule: str, p: int, m: int) -> list[SteadyRow]:
    return [r for r in rows if (r.schedule, r.p, r.m) == (schedule, p, m)]


def steady_table(rows: list[SteadyRow]) -> list[str]:
    """Per (p, m): PipeDream's least busy stage in its window and stage 0's window against the closed forms, and
    1F1B's idle over the iteration against (p − 1)/(m + p − 1)."""
    lines = ["| p | m | PipeDream: least busy stage in the window (closed form 1) | stage 0 window ms (closed form) | "
             "PipeDream idle over the plan | 1F1B idle per flushed minibatch | (p-1)/(m+p-1) | 1F1B window busy |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, m in dict.fromkeys((r.p, r.m) for r in rows):
        pd, one = _pair(rows, "pipedream", p, m), _pair(rows, "1f1b", p, m)
        lines.append(f"| {p} | {m} | {min(r.window_fraction for r in pd):.6f} | {pd[0].window_s * 1e3:.3f} "
                     f"({pd[0].closed_window_s() * 1e3:.3f}) | {1 - min(r.plan_fraction for r in pd):.4f} | "
                     f"{1 - min(r.plan_fraction for r in one):.4f} | {(p - 1) / (m + p - 1):.4f} | "
                     f"{min(r.window_fraction for r in one):.6f} |")
    return lines


def memory_table(rows: list[memory.StageRow]) -> list[str]:
    """Per (p, m, stage): PipeDream's weight copies beside p − r, activations in flight of the three schedules, and
    the simulated bytes beyond the state beside the closed forms, in MB."""
    lines = ["| p | m | stage | p - r | PipeDream weight copies | in flight PipeDream / 1F1B / GPipe | "
             "PipeDream MB (closed form) | 1F1B MB (closed form) | GPipe MB (closed form) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r.schedule, r.p, r.m, r.stage): r for r in rows}
    for (_, p, m, stage), pd in ((k, v) for k, v in by.items() if k[0] == "pipedream"):
        one, gp = by[("1f1b", p, m, stage)], by[("gpipe", p, m, stage)]
        cells = " | ".join(f"{x.simulated / 1e6:.0f} ({x.formula / 1e6:.0f})" for x in (pd, one, gp))
        lines.append(f"| {p} | {m} | {stage} | {p - stage} | {pd.copies} | {pd.in_flight} / {one.in_flight} / "
                     f"{gp.in_flight} | {cells} |")
    return lines


def throughput_table(comparisons: list[pipedream_vs_dp.Comparison]) -> list[str]:
    """``pipedream_vs_dp``'s own table, then the published figures and the reason ours tie."""
    lines = pipedream_vs_dp.format_table(comparisons).split("\n")
    for c in comparisons:
        if c.model.key == "vgg16" and c.cluster.key in PAPER and c.speedup is not None:
            lines.append(f"vgg16 on {c.cluster.key}: simulated {c.speedup:.2f}x, paper {PAPER[c.cluster.key]:.2f}x")
    lines.append(f"why: {REASON}")
    return lines


FIELDS = ("part", "schedule", "p", "m", "stage", "model", "cluster", "quantity", "simulated", "closed_form", "paper")


def _csv(steady: list[SteadyRow], mem: list[memory.StageRow],
         comparisons: list[pipedream_vs_dp.Comparison]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(FIELDS)
    for r in steady:
        base = ["steady", r.schedule, r.p, r.m, r.stage, UNIFORM, f"{r.p}xideal"]
        window_closed = "1" if r.schedule == "pipedream" else ""
        writer.writerow([*base, "window_busy_fraction", repr(r.window_fraction), window_closed, ""])
        writer.writerow([*base, "window_s", repr(r.window_s), repr(r.closed_window_s()), ""])
        plan_closed = repr(r.m / (r.m + r.p - 1))
        writer.writerow([*base, "plan_busy_fraction", repr(r.plan_fraction), plan_closed, ""])
    for r in mem:
        base = ["memory", r.schedule, r.p, r.m, r.stage, r.model, r.topology]
        writer.writerow([*base, "bytes_beyond_state", r.simulated, r.formula, ""])
        writer.writerow([*base, "microbatches_in_flight", "", r.in_flight, ""])
        writer.writerow([*base, "weight_copies", "", r.copies, r.p - r.stage if r.schedule == "pipedream" else ""])
    for c in comparisons:
        base = ["throughput", c.best.candidate.label if c.best else "", "", "", "", c.model.key, c.cluster.key]
        paper = PAPER.get(c.cluster.key, "") if c.model.key == "vgg16" else ""
        writer.writerow([*base, "dp_time_s", repr(c.dp.time_s) if c.dp.time_s else "", "", ""])
        writer.writerow([*base, "best_time_s", repr(c.best.time_s) if c.best and c.best.time_s else "", "", ""])
        writer.writerow([*base, "speedup_over_dp", repr(c.speedup) if c.speedup else "", "", paper])
    return buffer.getvalue()


def _plot(steady: list[SteadyRow], mem: list[memory.StageRow],
          comparisons: list[pipedream_vs_dp.Comparison]) -> bytes:
    """Three panels: idle fractions against m/p (closed forms as crosses), memory per stage at the largest p and
    m = 4p, and the speed-ups over DP beside the paper's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colors = {2: "#2ca02c", 4: "#1f77b4", 8: "#d62728"}
    ax = axes[0]
    for p in dict.fromkeys(r.p for r in steady):
        ms = list(dict.fromkeys(r.m for r in steady if r.p == p))
        ax.plot([m // p for m in ms], [1 - min(r.plan_fraction for r in _pair(steady, "1f1b", p, m)) for m in ms],
                "-o", color=colors[p], label=f"1F1B, flushed minibatches, p={p}")
        ax.plot([m // p for m in ms], [1 - min(r.window_fraction for r in _pair(steady, "pipedream", p, m))
                                       for m in ms], "--s", color=colors[p], label=f"PipeDream steady window, p={p}")
        ax.plot([m // p for m in ms], [(p - 1) / (m + p - 1) for m in ms], "x", color="black", markersize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches per minibatch m / p")
    ax.set_ylabel("idle fraction of a stage")
    ax.set_title("uniform stages, free links; crosses: (p-1)/(m+p-1)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    p = max(r.p for r in mem)
    for s, color in zip(MEMORY_SCHEDULES, ("#9467bd", "#ff7f0e", "#1f77b4")):
        line = [r for r in mem if (r.schedule, r.p, r.m) == (s, p, 4 * p)]
        ax.plot([r.stage for r in line], [r.simulated / 1e6 for r in line], "-", color=color, label=s)
        ax.plot([r.stage for r in line], [r.formula / 1e6 for r in line], "o", color=color, fillstyle="none")
    ax.set_yscale("log")
    ax.set_xlabel("stage")
    ax.set_ylabel("bytes beyond the training state (MB)")
    ax.set_title(f"memory's uniform model, p={p}, m={4 * p}; circles: closed forms\n(PipeDream: p-r activations "
                 f"and p-r weight copies)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[2]
    labels = [f"{c.model.key}\n{c.cluster.key}" for c in comparisons]
    ax.bar(range(len(comparisons)), [c.speedup or 0 for c in comparisons], color="#1f77b4", label="simulated")
    for i, c in enumerate(comparisons):
        if c.model.key == "vgg16" and c.cluster.key in PAPER:
            ax.plot(i, PAPER[c.cluster.key], "r*", markersize=12, label="paper" if c.cluster.key == "A" else None)
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_xticks(range(len(comparisons)), labels, fontsize=7)
    ax.set_ylabel("DP time / best pipeline plan's time")
    ax.set_title("throughput over data parallelism (pipedream_vs_dp)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_png(fig, dpi=100)


@dataclass(frozen=True)
class Result:
    """The three parts: every stage of the steady plans, every stage of the memory plans, and the throughput
    comparisons against data parallelism."""

    steady: tuple[SteadyRow, ...]
    memory: tuple[memory.StageRow, ...]
    throughput: tuple[pipedream_vs_dp.Comparison, ...]


def parser() -> CliParser:
    """``python -m experiments.run pipedream [--quick] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run pipedream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/pipedream", help="output directory (default runs/pipedream)")
    parser.add_argument("--quick", action="store_true", help="p in {2, 4} and VGG-16 on A and B only (CI)")
    return parser


def run(*, quick: bool = False) -> Result:
    """The three parts for p ∈ :data:`PS` (``quick``: p ∈ {2, 4} and VGG-16 on Clusters A and B only)."""
    ps = PS[:2] if quick else PS
    return Result(tuple(steady_rows(ps)), tuple(memory_rows(ps)), tuple(throughput(quick)))


def report(result: Result) -> str:
    """One titled table per part."""
    parts = (("steady state (uniform stages, free links)", steady_table(list(result.steady))),
             ("memory per stage (experiments.memory's uniform model)", memory_table(list(result.memory))),
             ("throughput against data parallelism (experiments.pipedream_vs_dp)",
              throughput_table(list(result.throughput))))
    return "\n".join(line for title, lines in parts for line in [f"## {title}\n", *lines, ""])


def write(result: Result, out: Path) -> list[Path]:
    """``pipedream.csv`` (long form, one row per measured quantity) and ``pipedream.png`` in ``out``."""
    parts = list(result.steady), list(result.memory), list(result.throughput)
    return write_csv_png(out, "pipedream", _csv(*parts), _plot(*parts))
