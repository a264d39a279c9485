"""PipeDream (SOSP'19) against data parallelism, simulated: the best pipeline plan beside pure DP (its Table 1).

For each model and cluster, on all N devices of the cluster and a fixed global batch per model:

* **data parallelism**: dp = N replicas, pp = 1 (one stage; 1F1B and GPipe are the same program), gradients
  reduced by the fastest of ring, tree and hierarchical all-reduce (:mod:`sim.cost.collectives`), either after the
  backward pass (Megatron's default) or in 25 MiB buckets overlapping it (PyTorch DDP's); the faster counts;
* **pipelines**: every depth pp ≥ 2 that divides N (and is at most the model's layer count), the remaining devices
  as dp = N / pp replicas, schedules ``1f1b`` and ``gpipe``, both nestings of the replicas (``tp-dp-pp``: a stage's
  replicas on adjacent devices, so the gradient all-reduce stays in a server and the pipeline crosses servers;
  ``tp-pp-dp``: a pipeline on adjacent devices, the all-reduce across servers), gradients reduced after the
  backward; and the asynchronous ``pipedream`` schedule (weight stashing, one update per microbatch) at pp = N,
  dp = 1, the only layout the simulator gives it. Always the balanced partition, the model's fixed microbatch size,
  and memory checked: a plan that does not fit its devices is recorded as out of memory and left out of the best.

Every plan is built and simulated by the product's own path (:func:`sim.plan.build.build_plan`,
:func:`sim.predict.predict`), one iteration of the global batch each; the speed-up is DP's iteration time over the
best pipeline plan's (below 1: data parallelism wins). PipeDream's figures beside them (Narayanan et al., SOSP'19,
Table 1: epoch time over data parallelism) are recalled, not checked against the paper's text, and so are its
clusters: VGG-16 5.28× on Cluster-A (4 servers × 4 V100 16 GB, PCIe inside a server, 10 GbE between) with
PipeDream's 15-1 configuration, 2.98× on Cluster-B (2 × AWS p3.16xlarge: 8 × V100 16 GB on NVLink, 25 GbE);
ResNet-50 1× (PipeDream picks data parallelism); GNMT-16 2.2–3.1×. ``docs/experiments/pipedream_vs_dp.md`` has
the results and where they differ from the paper.

Writes ``pipedream_vs_dp.csv`` (one row per model × cluster), ``plans.csv`` (every plan tried) and
``pipedream_vs_dp.png`` (grouped bars), all or none, and prints the table.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path

from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_bytes_atomic, write_text_atomic
from sim.engine.simpy_engine import OutOfMemoryError
from sim.hw.topology import Topology
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["ModelCase", "ClusterCase", "PlanCase", "PlanResult", "Comparison", "MODELS", "CLUSTERS", "PAPER",
           "candidates", "compare", "Result", "parser", "run", "report", "write"]


@dataclass(frozen=True)
class ModelCase:
    """A model of the comparison.

    Attributes:
        key: its name in the table and on ``--models``.
        spec: the zoo spec.
        microbatch_size: samples per microbatch, every plan (a DP replica accumulates its share in microbatches).
        global_batch: samples per iteration over all replicas, every plan; a multiple of microbatch_size × N.
        why: where the batch comes from, printed under the table.
    """

    key: str
    spec: str
    microbatch_size: int
    global_batch: int
    why: str = ""


@dataclass(frozen=True)
class ClusterCase:
    """A cluster of the comparison: ``key`` on ``--clusters``, its topology spec and a description."""

    key: str
    topology: str
    description: str


MODELS: dict[str, ModelCase] = {m.key: m for m in (
    ModelCase("vgg16", "vgg16", 16, 1024, "64 images per GPU under DP on 16 GPUs, PipeDream's VGG-16 minibatch per "
              "worker [recalled]"),
    ModelCase("gpt", "gpt:layers=24,hidden=1024", 1, 128, "GPT-2 medium's shape (untied head, 406M parameters, fp16), "
              "128 sequences of 1024 tokens (8 per GPU under DP)"),
    ModelCase("cnn", "cnn", 4, 256, "PARTIME's conv stack (60K parameters, fp32, 256x256 frames), 16 frames per GPU "
              "under DP: a model whose gradients are tiny and whose activations are large"),
)}

CLUSTERS: dict[str, ClusterCase] = {c.key: c for c in (
    ClusterCase("A", "4x4xv100-pcie-16gb", "PipeDream's Cluster-A [recalled]: 4 servers x 4 V100 16 GB, PCIe, 10 GbE"),
    ClusterCase("B", "2xp3.16xlarge", "PipeDream's Cluster-B [recalled]: 2 x p3.16xlarge, 8 x V100 16 GB NVLink, "
                "25 GbE"),
    ClusterCase("dgx2", "16xV100", "one DGX-2: 16 x V100 32 GB on NVSwitch (a cheap all-reduce)"),
)}

#: PipeDream's speed-up over data parallelism (epoch time; SOSP'19 Table 1, recalled, not checked against the
#: paper's text) for the (model, cluster) pairs the paper ran, and its nearest figures for the others.
PAPER: dict[tuple[str, str], tuple[float | None, str]] = {
    ("vgg16", "A"): (5.28, "VGG-16 on 4x4 (A), config 15-1"),
    ("vgg16", "B"): (2.98, "VGG-16 on 2x8 (B)"),
    ("gpt", "A"): (None, "no GPT in the paper; GNMT-16 2.2-3.1x"),
    ("gpt", "B"): (None, "no GPT in the paper; GNMT-16 2.2-3.1x"),
    ("cnn", "A"): (None, "not in the paper; ResNet-50 1x (PipeDream picks DP)"),
    ("cnn", "B"): (None, "not in the paper; ResNet-50 1x (PipeDream picks DP)"),
}

#: What the table says for a cluster the paper did not use.
NO_PAPER: tuple[float | None, str] = (None, "no such cluster in the paper")

#: What ``--quick`` runs unless told otherwise: one model where pipelining should win, one where DP should, on an
#: expensive and a cheap all-reduce.
QUICK_MODELS, QUICK_CLUSTERS = ("vgg16", "cnn"), ("A", "dgx2")

#: Rank orders tried for hybrid plans, with how they read in the table.
ORDERS = {"tp-dp-pp": "replicas adjacent", "tp-pp-dp": "stages adjacent"}


@dataclass(frozen=True)
class PlanCase:
    """One plan to simulate: schedule, pipeline depth, replicas, their nesting, and whether the gradient reduction
    overlaps the backward in buckets (``grad_overlap``, tried for pure DP only)."""

    schedule: str
    pp: int
    dp: int
    order: str = "tp-dp-pp"
    overlap: bool = False

    @property
    def label(self) -> str:
        """E.g. ``1f1b pp4 x dp4 (replicas adjacent)``; ``DP x16`` or ``DP x16 (overlapped)`` for pure DP."""
        if self.pp == 1:
            return f"DP x{self.dp}" + (" (overlapped)" if self.overlap else "")
        text = f"{self.schedule} pp{self.pp}" + (f" x dp{self.dp}" if self.dp > 1 else "")
        return text + (f" ({ORDERS[self.order]})" if self.dp > 1 else "")


@dataclass(frozen=True)
class PlanResult:
    """A candidate's simulated iteration: ``time_s`` (s, ``None`` when it did not fit), microbatches, peak memory of
    the fullest device (bytes), idle fraction (the share of device-time compute is idle), and ``status``
    (``ok`` or why not)."""

    candidate: PlanCase
    status: str
    microbatches: int
    time_s: float | None = None
    idle_fraction: float | None = None
    peak_memory_bytes: int | None = None


@dataclass(frozen=True)
class Comparison:
    """Every plan of one model on one cluster; ``dp`` is the faster pure data parallelism (its ``time_s`` is ``None``
    if it does not fit), ``best`` the fastest pipeline plan that fits (``None`` if none does), ``speedup`` DP's time
    over its."""

    model: ModelCase
    cluster: ClusterCase
    plans: tuple[PlanResult, ...]
    dp: PlanResult
    best: PlanResult | None

    @property
    def speedup(self) -> float | None:
        """DP's iteration time over the best pipeline plan's (> 1: pipelining wins); ``None`` if either lacks one."""
        if self.best is None or self.dp.time_s is None or self.best.time_s is None:
            return None
        return self.dp.time_s / self.best.time_s


def candidates(devices: int, layers: int) -> list[PlanCase]:
    """Pure DP first (its reduction after the backward, then overlapped with it), then every pipeline depth
    2..devices that divides ``devices`` and is at most ``layers`` (module docstring), in a fixed order (the first of
    equal times wins)."""
    plans = [PlanCase("1f1b", 1, devices)] + ([PlanCase("1f1b", 1, devices, overlap=True)] if devices > 1 else [])
    for pp in range(2, min(devices, layers) + 1):
        if devices % pp:
            continue
        dp = devices // pp
        for schedule in ("1f1b", "gpipe"):
            plans += [PlanCase(schedule, pp, dp, order) for order in (ORDERS if dp > 1 else ("tp-dp-pp",))]
        if dp == 1:
            plans.append(PlanCase("pipedream", pp, 1))
    return plans


def _simulate(model: ModelCase, topology: str, candidate: PlanCase) -> PlanResult:
    built = build_plan(PlanInputs(model.spec, topology, candidate.schedule, microbatch_size=model.microbatch_size,
                                  global_batch=model.global_batch, dp=candidate.dp, pp=candidate.pp,
                                  rank_order=candidate.order, grad_overlap=candidate.overlap))
    m = built.plan.num_microbatches
    try:
        prediction = predict_built(built)
    except OutOfMemoryError as exc:
        return PlanResult(candidate, str(exc).split(" (fewer")[0], m)  # "out of memory on rank ...", no advice
    metrics = prediction.metrics
    return PlanResult(candidate, "ok", m, metrics["iteration_time_s"], metrics["idle_fraction"],
                      max(prediction.peak_memory_bytes))


def compare(model: ModelCase, cluster: ClusterCase) -> Comparison:
    """Simulate every candidate of ``model`` on ``cluster`` (module docstring).

    Raises:
        SpecError: a bad spec, or a global batch that is not a whole number of microbatches on every replica of
            pure data parallelism (named).
    """
    devices = Topology.parse(cluster.topology).num_ranks
    layers = len(build_model(model.spec))
    if model.global_batch % (model.microbatch_size * devices):
        raise SpecError(f"{model.key}: global batch {model.global_batch} is not a multiple of microbatch size "
                        f"{model.microbatch_size} x {devices} devices of {cluster.topology}")
    plans = tuple(_simulate(model, cluster.topology, c) for c in candidates(devices, layers))
    dps = [p for p in plans if p.candidate.pp == 1]
    dp = _first_fastest(dps) or dps[0]  # a model too large for one device: DP's row says out of memory
    return Comparison(model, cluster, plans, dp, _first_fastest([p for p in plans if p.candidate.pp > 1]))


def _first_fastest(plans: list[PlanResult]) -> PlanResult | None:
    """The first of the fastest plans that fit, in candidates' order: equal plans (1F1B and GPipe with the same
    bubble) can differ in the last bits of a float sum, and the earlier one (1F1B, with less memory) should win."""
    fastest = min((p.time_s for p in plans if p.time_s is not None), default=math.inf)
    return next((p for p in plans if p.time_s is not None and p.time_s <= fastest * (1 + 1e-9)), None)


# --- outputs -------------------------------------------------------------------------------------------------------

SUMMARY_FIELDS = ("model", "model_spec", "cluster", "topology", "global_batch", "microbatch_size", "dp_plan",
                  "dp_time_s", "dp_samples_per_s", "best_plan", "best_schedule", "best_pp", "best_dp",
                  "best_rank_order", "best_time_s", "best_samples_per_s", "speedup", "paper_speedup", "paper_note",
                  "plans_tried", "plans_out_of_memory")
PLAN_FIELDS = ("model", "cluster", "plan", "schedule", "pp", "dp", "rank_order", "grad_overlap", "microbatches",
               "status", "iteration_time_s", "samples_per_s", "idle_fraction", "peak_memory_bytes")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.9g}"


def summary_row(c: Comparison) -> dict[str, str]:
    """One row of ``pipedream_vs_dp.csv``."""
    g, best = c.model.global_batch, c.best
    paper, note = PAPER.get((c.model.key, c.cluster.key), NO_PAPER)
    bc = best.candidate if best else None
    row = {"model": c.model.key, "model_spec": c.model.spec, "cluster": c.cluster.key, "topology": c.cluster.topology,
           "global_batch": str(g), "microbatch_size": str(c.model.microbatch_size), "dp_plan": c.dp.candidate.label,
           "dp_time_s": _num(c.dp.time_s), "dp_samples_per_s": _num(g / c.dp.time_s if c.dp.time_s else None),
           "best_plan": bc.label if bc else "", "best_schedule": bc.schedule if bc else "",
           "best_pp": str(bc.pp) if bc else "", "best_dp": str(bc.dp) if bc else "",
           "best_rank_order": bc.order if bc else "", "best_time_s": _num(best.time_s if best else None),
           "best_samples_per_s": _num(g / best.time_s if best and best.time_s else None),
           "speedup": _num(c.speedup), "paper_speedup": _num(paper), "paper_note": note,
           "plans_tried": str(len(c.plans)),
           "plans_out_of_memory": str(sum(p.status.startswith("out of memory") for p in c.plans))}
    assert tuple(row) == SUMMARY_FIELDS
    return row


def plan_rows(c: Comparison) -> list[dict[str, str]]:
    """The rows of ``plans.csv`` for one comparison."""
    g = c.model.global_batch
    return [{"model": c.model.key, "cluster": c.cluster.key, "plan": p.candidate.label,
             "schedule": p.candidate.schedule, "pp": str(p.candidate.pp), "dp": str(p.candidate.dp),
             "rank_order": p.candidate.order, "grad_overlap": str(p.candidate.overlap).lower(),
             "microbatches": str(p.microbatches), "status": p.status,
             "iteration_time_s": _num(p.time_s), "samples_per_s": _num(g / p.time_s if p.time_s else None),
             "idle_fraction": _num(p.idle_fraction),
             "peak_memory_bytes": "" if p.peak_memory_bytes is None else str(p.peak_memory_bytes)} for p in c.plans]


def _csv(fields: tuple[str, ...], rows: list[dict[str, str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def format_table(comparisons: list[Comparison]) -> str:
    """The printed table: per model × cluster, DP's and the best pipeline's time, the speed-up and the paper's."""
    lines = ["| model | cluster | DP (ms) | best pipeline plan | its time (ms) | speed-up | paper |",
             "|---|---|---:|---|---:|---:|---|"]
    for c in comparisons:
        paper, note = PAPER.get((c.model.key, c.cluster.key), NO_PAPER)
        best = c.best
        lines.append(f"| {c.model.key} | {c.cluster.key} ({c.cluster.topology}) | {_ms(c.dp.time_s)} | "
                     f"{best.candidate.label if best else 'none fits'} | {_ms(best.time_s if best else None)} | "
                     f"{'' if c.speedup is None else f'{c.speedup:.2f}x'} | "
                     f"{f'{paper:.2f}x ({note})' if paper else note} |")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def _plot(comparisons: list[Comparison]) -> bytes:
    """Grouped bars per model × cluster: throughput relative to DP of DP (1) and of the best pipeline plan, on a log
    axis, the paper's speed-up as a star where it has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(comparisons)), 4.5))
    xs = list(range(len(comparisons)))
    speedups = [c.speedup or 0.0 for c in comparisons]
    ax.bar([x - 0.2 for x in xs], [1.0] * len(xs), 0.4, label="data parallelism", color="#8c8c8c")
    ax.bar([x + 0.2 for x in xs], speedups, 0.4, label="best pipeline plan", color="#1f77b4")
    labelled = False
    for x, c, s in zip(xs, comparisons, speedups):
        if c.best is not None:  # inside the bar's top, so that a paper star just above it stays readable
            ax.annotate(f"{s:.2f}x", (x + 0.2, s), xytext=(0, -3),
                        textcoords="offset points", ha="center", va="top", fontsize=7, color="white")
        paper = PAPER.get((c.model.key, c.cluster.key), (None, ""))[0]
        if paper:
            ax.plot([x + 0.2], [paper], "*", color="black", markersize=12,
                    label=None if labelled else "PipeDream's speed-up (paper, recalled)")
            labelled = True
            ax.annotate(f"paper {paper:.2f}x", (x + 0.2, paper), xytext=(7, 0), textcoords="offset points",
                        fontsize=7, va="center")
    ax.set_yscale("log")
    ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16) if min(speedups + [1]) / 2 <= t <= 2 * max(speedups + [8])]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(min(speedups + [1]) / 1.6, max(speedups + [6]) * 1.6)
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_xticks(xs, [f"{c.model.key} on {c.cluster.key}\n" + (c.best.candidate.label.split(" (")[0] if c.best else "")
                       for c in comparisons], fontsize=8)
    ax.set_ylabel("throughput / data parallelism (log)")
    ax.set_title("Best pipeline plan vs pure data parallelism on 16 GPUs, simulated (roofline; the GPT by the GPU "
                 "kernel model)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return figure_png(fig, dpi=120)


def _keys(text: str, known: dict, flag: str) -> list:
    keys = [k for k in text.split(",") if k]
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        raise SpecError(f"{flag}: unknown {', '.join(map(repr, unknown)) or 'empty list'} (known: "
                        f"{', '.join(known)})")
    return [known[k] for k in keys]


@dataclass(frozen=True)
class Result:
    """The models and clusters compared, whether quick (one microbatch per device), and every comparison, model by
    model, cluster by cluster."""

    models: tuple[ModelCase, ...]
    clusters: tuple[ClusterCase, ...]
    quick: bool
    comparisons: tuple[Comparison, ...]


def parser() -> CliParser:
    """``python -m experiments.run pipedream_vs_dp [--quick] [--models ...] [--clusters ...] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run pipedream_vs_dp", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/pipedream_vs_dp", help="output directory (default runs/pipedream_vs_dp)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default all; --quick: "
                        f"{','.join(QUICK_MODELS)})")
    parser.add_argument("--clusters", help=f"comma-separated, of {', '.join(CLUSTERS)} (default all; --quick: "
                        f"{','.join(QUICK_CLUSTERS)})")
    parser.add_argument("--quick", action="store_true", help="fewer models and clusters by default, and each "
                        "model's global batch cut to one microbatch per device (seconds; the figures differ from "
                        "the full run's)")
    return parser


def run(*, quick: bool = False, models: str | None = None, clusters: str | None = None) -> Result:
    """Every model against every cluster.

    Args:
        quick: :data:`QUICK_MODELS` and :data:`QUICK_CLUSTERS` by default, and each model's global batch cut to one
            microbatch per device.
        models, clusters: comma-separated keys of :data:`MODELS` and :data:`CLUSTERS` (default all, or the quick
            ones).

    Raises:
        SpecError: an unknown key or an empty list (naming ``--models`` or ``--clusters``).
    """
    chosen_models = _keys(models or ",".join(QUICK_MODELS if quick else MODELS), MODELS, "--models")
    chosen_clusters = _keys(clusters or ",".join(QUICK_CLUSTERS if quick else CLUSTERS), CLUSTERS, "--clusters")
    comparisons = []
    for model in chosen_models:
        for cluster in chosen_clusters:
            case = model
            if quick:  # one microbatch per device: DP's smallest batch
                devices = Topology.parse(cluster.topology).num_ranks
                case = replace(model, global_batch=model.microbatch_size * devices)
            comparisons.append(compare(case, cluster))
    return Result(tuple(chosen_models), tuple(chosen_clusters), quick, tuple(comparisons))


def report(result: Result) -> str:
    """The plans tried per comparison, the summary table, then what each cluster and model is."""
    comparisons = list(result.comparisons)
    return "\n".join([*(f"  {c.model.key} on {c.cluster.key}: {len(c.plans)} plans" for c in comparisons), "",
                      format_table(comparisons), "",
                      *(f"{cluster.key}: {cluster.description}" for cluster in result.clusters),
                      *(f"{model.key}: {model.spec}, microbatch {model.microbatch_size}, global batch "
                        f"{'one microbatch per device (--quick)' if result.quick else model.global_batch}: {model.why}"
                        for model in result.models)])


def write(result: Result, out: Path) -> list[Path]:
    """``pipedream_vs_dp.csv`` (one row per comparison), ``plans.csv`` (every plan tried) and
    ``pipedream_vs_dp.png`` in ``out``."""
    comparisons = list(result.comparisons)
    write_text_atomic(_csv(SUMMARY_FIELDS, [summary_row(c) for c in comparisons]), out / "pipedream_vs_dp.csv")
    write_text_atomic(_csv(PLAN_FIELDS, [row for c in comparisons for row in plan_rows(c)]), out / "plans.csv")
    write_bytes_atomic(out / "pipedream_vs_dp.png", _plot(comparisons))
    return [out / "pipedream_vs_dp.csv", out / "plans.csv", out / "pipedream_vs_dp.png"]
