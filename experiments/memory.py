"""Peak activation memory per pipeline stage, simulated, against the closed forms.

For gpipe, 1f1b, interleaved (v = 2 chunks), zb1p and pipedream, each without and with ``--recompute``, every plan is
built and simulated by the product (:func:`sim.plan.build.build_plan`, :func:`sim.predict.predict`), and a stage's
activation memory is what the engine reports beyond the training state: ``peak_memory_bytes`` of the device minus
``state_bytes`` of its stages (weights, gradients, optimizer state; the plan's cost view). It is set beside a closed
form in the plan's own per-stage sizes, all in bytes:

* ``A`` = ``activation_bytes(v)``: one microbatch's activations of the (virtual) stage, its input included;
* ``C`` = ``checkpoint_bytes(v)``: the input of every layer of the stage, all that a microbatch keeps under full
  recomputation (Megatron-LM's ``uniform`` checkpointing with one layer per checkpoint; torchtitan's per-block AC);
* ``R`` = ``rebuilt_bytes(v)``: one layer's activations, the largest layer's, which the backward of a recomputed
  microbatch rebuilds one layer at a time (Chen et al. 2016 §3);
* ``P`` = ``param_bytes(v)``: one copy of the stage's weights (a stashed version);
* ``W`` = ``workspace_bytes(v)``: the running op's transient buffer, held at the peak (a forward or recompute runs).

With n microbatches in flight on stage r, the forms are n·A + W, and with recomputation n·C + k·R + W, where k
microbatches hold a rebuilt layer at once:

* gpipe (GPipe §2.3; Megatron SC'21 §2.2.1): n = m on every stage; k = 1;
* 1f1b (Megatron §2.2.1, warm-up p − r − 1 forwards): n = p − r; k = 1;
* interleaved (Megatron's warm-up 2(p − r − 1) + (v − 1)·p chunk forwards, +1 in the steady state): n = min(pv + p −
  1 − 2r, m·v) chunk activations, A and C per chunk; on the first stage this is p·A·(1 + (p − 1)/(p·v)) in
  stage-sized A (our reference table, §5); k = 1;
* zb1p: n = p on every stage. The engine frees a microbatch's activations after its W (the weight gradient needs the
  inputs of the stage's GEMMs) and ZB-H1 defers W: of the p, p − r wait for their backward (1F1B's count) and r for
  their W. With recomputation those r hold their rebuilt layer too, so k = r + 1;
* pipedream: n = p − r, plus weight copies: the first p − r forwards of an iteration run on the starting weights and
  each later one on a newer version, so min(p − r, m − (p − r) + 1) versions are alive at once, each one more P on
  top of the state (PipeDream §3.3's p − r stashed versions once m ≥ 2(p − r) − 1; fewer in a short iteration).

On ``uniform:..`` models over ``Nxideal`` topologies every stage is the same and links are free, so the forms are
exact and the simulated bytes equal them to the byte (the tests assert it); ``p`` ∈ {4, 8} and ``m`` ∈ {p, 2p, 4p}.
For scale, the same table for a GPT-3 6.7B-shaped GPT on one 8 × A100 80 GB node at m = 32: GB per stage, and which
plans overflow the device (simulated with the memory check off, so an overflowing plan still reports its peak).

Writes ``memory.csv`` (one row per plan and stage) and ``memory.png``, all or none, and prints the tables.
``--quick`` runs p = 4 only and the GPT at m = 8 (CI).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["SCHEDULES", "UNIFORM", "GPT", "GPT_TOPOLOGY", "StageRow", "closed_form", "simulate", "Result", "parser",
           "run", "report", "write"]

#: (schedule, chunks per rank) measured, in the table's order.
SCHEDULES: tuple[tuple[str, int], ...] = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1),
                                          ("pipedream", 1))
#: 16 layers of 1 MB activations and 10 MB weights per sample: 16 = p·v for p = 8, v = 2, so every chunk has a layer.
UNIFORM = "uniform:layers=16,fwd_ms=1,bwd_ms=2,act_mb=1,param_mb=10"
#: GPT-3 6.7B's shape (Brown et al. 2020, Table 2.1: 32 layers, d_model 4096, 32 heads, context 2048).
GPT = "gpt:layers=32,hidden=4096,heads=32,seq=2048"
GPT_TOPOLOGY = "8xA100"
MAX_STAGES = 8  # the uniform model's 16 layers over p·2 interleaved chunks: at least one layer per chunk


@dataclass(frozen=True)
class StageRow:
    """One stage of one simulated plan, bytes throughout.

    Attributes:
        part: ``uniform`` (exact closed forms) or ``gpt`` (scale).
        model, topology, schedule, chunks, recompute, p, m, stage: the plan and the pipeline rank.
        activation, checkpoint, rebuilt_layer, param, workspace: A, C, R, P and W of the rank's first (virtual) stage
            (module doc).
        state: the training state of the rank's stages.
        peak: the device's simulated peak memory.
        in_flight, rebuilt, copies: the closed form's n, k and weight copies.
        formula: the closed form's bytes beyond the state.
        capacity: the device's memory (bytes; infinite on ``ideal`` devices).
    """

    part: str
    model: str
    topology: str
    schedule: str
    chunks: int
    recompute: bool
    p: int
    m: int
    stage: int
    activation: int
    checkpoint: int
    rebuilt_layer: int
    param: int
    workspace: int
    state: int
    peak: int
    in_flight: int
    rebuilt: int
    copies: int
    formula: int
    capacity: float

    @property
    def simulated(self) -> int:
        """Bytes beyond the training state at the simulated peak."""
        return self.peak - self.state


def closed_form(schedule: str, recompute: bool, p: int, m: int, v: int, r: int) -> tuple[int, int, int]:
    """``(n, k, copies)`` of the module docstring for stage ``r`` of ``p`` with ``m`` microbatches and ``v`` chunks:
    microbatches (chunk activations for interleaved) in flight, how many of them hold rebuilt activations under
    recomputation (0 without), and stashed weight copies."""
    copies = 0
    if schedule == "gpipe":
        n = m
    elif schedule == "1f1b":
        n = p - r
    elif schedule == "interleaved":
        n = min(p * v + p - 1 - 2 * r, m * v)
    elif schedule == "zb1p":
        n = p
    elif schedule == "pipedream":
        n = p - r
        copies = min(p - r, m - (p - r) + 1)
    else:
        raise SpecError(f"no closed form for schedule {schedule!r}")
    rebuilt = (r + 1 if schedule == "zb1p" else 1) if recompute else 0
    return n, rebuilt, copies


def simulate(part: str, model: str, topology: str, schedule: str, chunks: int, recompute: bool,
             m: int) -> list[StageRow]:
    """Build and simulate one plan (the one prediction path, memory check off) and return its stages' rows."""
    built = build_plan(PlanInputs(model, topology, schedule, microbatches=m, chunks=chunks, recompute=recompute))
    prediction = predict_built(built, check_memory=False)
    costs, placement, p = built.costs, built.plan.placement, built.plan.num_ranks
    rows = []
    for r in range(p):
        vstages = placement.vstages_of(r)
        v0 = vstages[0]
        a, c, param = costs.activation_bytes(v0), costs.checkpoint_bytes(v0), costs.param_bytes(v0)
        layer = costs.rebuilt_bytes(v0)
        w = max(costs.workspace_bytes(v) for v in vstages)  # the largest op's buffer: the peak is while it runs
        n, k, copies = closed_form(schedule, recompute, p, m, chunks, r)
        held = n * c + k * layer if recompute else n * a
        peak = prediction.metrics["devices"][r]["peak_memory_bytes"]
        rows.append(StageRow(part, model, topology, schedule, chunks, recompute, p, m, r, a, c, layer, param, w,
                             sum(costs.state_bytes(v) for v in vstages), peak, n, k, copies,
                             held + copies * param + w, built.topology.devices[costs.device_index_of(r)].memory_bytes))
    return rows


def uniform_rows(stages: tuple[int, ...]) -> list[StageRow]:
    """Every schedule, with and without recomputation, for p in ``stages`` and m in {p, 2p, 4p}, on ``pxideal``."""
    return [row for p in stages for m in (p, 2 * p, 4 * p) for schedule, chunks in SCHEDULES
            for recompute in (False, True)
            for row in simulate("uniform", UNIFORM, f"{p}xideal", schedule, chunks, recompute, m)]


def gpt_rows(m: int) -> list[StageRow]:
    """Every schedule, with and without recomputation, for :data:`GPT` on :data:`GPT_TOPOLOGY` (8 stages)."""
    return [row for schedule, chunks in SCHEDULES for recompute in (False, True)
            for row in simulate("gpt", GPT, GPT_TOPOLOGY, schedule, chunks, recompute, m)]


def _plans(rows: list[StageRow]) -> list[list[StageRow]]:
    """``rows`` grouped by plan, in order."""
    groups: dict[tuple, list[StageRow]] = {}
    for row in rows:
        groups.setdefault((row.part, row.schedule, row.recompute, row.p, row.m), []).append(row)
    return list(groups.values())


def _label(row: StageRow) -> str:
    name = f"interleaved v={row.chunks}" if row.schedule == "interleaved" else row.schedule
    return name + (" +recompute" if row.recompute else "")


def uniform_table(rows: list[StageRow]) -> list[str]:
    """Per plan: the first stage's simulated and closed-form bytes in units of its A, the last stage's, and whether
    every stage equals its closed form."""
    lines = ["| schedule | p | m | stage 0: simulated / A | formula / A | last stage: simulated / A | formula / A | "
             "every stage equal |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for plan in _plans(rows):
        first, last = plan[0], plan[-1]
        equal = all(r.simulated == r.formula for r in plan)
        lines.append(f"| {_label(first)} | {first.p} | {first.m} | {first.simulated / first.activation:.3g} | "
                     f"{first.formula / first.activation:.3g} | {last.simulated / last.activation:.3g} | "
                     f"{last.formula / last.activation:.3g} | {'yes' if equal else 'NO'} |")
    return lines


def gpt_table(rows: list[StageRow]) -> list[str]:
    """Per plan: each stage's simulated peak in GB (state included), the largest beside the closed form's, the
    stage farthest from its closed form, and the stages that overflow the device."""
    plans = _plans(rows)
    p = plans[0][0].p
    lines = ["| schedule | " + " | ".join(f"stage {r} GB" for r in range(p)) +
             " | worst: formula GB | largest simulated − formula (MB) | overflows |",
             "|---|" + "---:|" * p + "---:|---:|---|"]
    for plan in plans:
        worst = max(plan, key=lambda r: r.peak)
        over = [str(r.stage) for r in plan if r.peak > r.capacity]
        lines.append(f"| {_label(plan[0])} | " + " | ".join(f"{r.peak / 1e9:.1f}" for r in plan) +
                     f" | {(worst.state + worst.formula) / 1e9:.1f} | "
                     f"{max((r.simulated - r.formula for r in plan), key=abs) / 1e6:+.1f} | "
                     f"{'stages ' + ','.join(over) if over else 'no'} |")
    return lines


FIELDS = ("part", "model", "topology", "schedule", "chunks", "recompute", "p", "m", "stage", "activation_bytes",
          "checkpoint_bytes", "rebuilt_layer_bytes", "param_bytes", "workspace_bytes", "state_bytes", "peak_bytes",
          "simulated_bytes",
          "formula_bytes", "in_flight", "rebuilt", "weight_copies", "equal", "capacity_bytes", "overflows")


def to_csv(rows: list[StageRow]) -> str:
    """``memory.csv``: one row per plan and stage, bytes as integers."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(FIELDS)
    for r in rows:
        writer.writerow([r.part, r.model, r.topology, r.schedule, r.chunks, str(r.recompute).lower(), r.p, r.m,
                         r.stage, r.activation, r.checkpoint, r.rebuilt_layer, r.param, r.workspace, r.state, r.peak,
                         r.simulated,
                         r.formula, r.in_flight, r.rebuilt, r.copies, str(r.simulated == r.formula).lower(),
                         f"{r.capacity:.0f}", str(r.peak > r.capacity).lower()])
    return buffer.getvalue()


def _plot(uniform: list[StageRow], gpt: list[StageRow]) -> bytes:
    """Three panels: the uniform model at the largest p and m without and with recomputation (simulated MB per
    stage as lines, the closed forms as open markers), and the GPT's GB per stage with the device's capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    colors = dict(zip((s for s, _ in SCHEDULES), ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")))
    p, m = max(r.p for r in uniform), max(r.m for r in uniform if r.p == max(x.p for x in uniform))
    for ax, recompute in zip(axes[:2], (False, True)):
        for plan in _plans([r for r in uniform if r.p == p and r.m == m and r.recompute == recompute]):
            stages = [r.stage for r in plan]
            color = colors[plan[0].schedule]
            ax.plot(stages, [r.simulated / 1e6 for r in plan], "-", color=color, label=_label(plan[0]))
            ax.plot(stages, [r.formula / 1e6 for r in plan], "o", color=color, fillstyle="none", markersize=8)
        ax.set_xlabel("stage")
        ax.set_ylabel("beyond the training state (MB; pipedream: with weight copies)")
        ax.set_title(f"uniform, p={p}, m={m}{', recompute' if recompute else ''}\nlines: simulated; circles: "
                     f"closed form", fontsize=9)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax = axes[2]
    for plan in _plans(gpt):
        style = "--" if plan[0].recompute else "-"
        ax.plot([r.stage for r in plan], [r.peak / 1e9 for r in plan], style, marker=".",
                color=colors[plan[0].schedule], label=_label(plan[0]))
    capacity = gpt[0].capacity / 1e9
    ax.axhline(capacity, color="black", linewidth=1)
    ax.annotate(f"{capacity:.0f} GB device", (0, capacity), xytext=(2, 3), textcoords="offset points", fontsize=8)
    ax.set_xlabel("stage")
    ax.set_ylabel("simulated peak memory, state included (GB)")
    ax.set_title(f"GPT 6.7B shape on {GPT_TOPOLOGY}, m={gpt[0].m}, microbatch 1 x 2048 tokens", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below: the lines fill the box
    fig.tight_layout()
    return figure_png(fig, dpi=110)


def _stages(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(f"--stages must be comma-separated integers, got {text!r}") from None
    bad = [v for v in values if not 2 <= v <= MAX_STAGES]
    if bad or len(set(values)) != len(values):
        raise SpecError(f"--stages: each p from 2 to {MAX_STAGES} (16 layers over p·2 interleaved chunks), once "
                        f"each, got {text!r}")
    return values


@dataclass(frozen=True)
class Result:
    """Every stage of every simulated plan: the uniform part (p over ``stages``, m ∈ {p, 2p, 4p}) and the GPT part
    (8 stages, m microbatches), each schedule with and without recomputation."""

    uniform: tuple[StageRow, ...]
    gpt: tuple[StageRow, ...]


def parser() -> CliParser:
    """``python -m experiments.run memory [--quick] [--stages 4,8] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/memory", help="output directory (default runs/memory)")
    parser.add_argument("--quick", action="store_true", help="p = 4 only and the GPT at m = 8 (CI)")
    parser.add_argument("--stages", help="comma-separated pipeline depths of the uniform part (default 4,8)")
    return parser


def run(*, quick: bool = False, stages: str | None = None) -> Result:
    """Both parts; ``stages``: the uniform part's depths, comma-separated (default 4,8; 4 with ``quick``), and
    ``quick`` the GPT at m = 8 instead of 32."""
    depths = _stages(stages or ("4" if quick else "4,8"))
    return Result(tuple(uniform_rows(depths)), tuple(gpt_rows(8 if quick else 32)))


def report(result: Result) -> str:
    """The uniform part's table in units of A beside the closed forms, then the GPT's peaks per stage."""
    return "\n".join([f"{UNIFORM} on pxideal: memory beyond the training state, in units of A (one microbatch's "
                      f"activations of the stage; of one chunk for interleaved)", *uniform_table(list(result.uniform)),
                      "", f"{GPT} on {GPT_TOPOLOGY}, microbatch 1, m = {result.gpt[0].m}: simulated peak memory per "
                      f"stage (state included)", *gpt_table(list(result.gpt))])


def write(result: Result, out: Path) -> list[Path]:
    """``memory.csv`` (every row) and ``memory.png`` in ``out``."""
    uniform, gpt = list(result.uniform), list(result.gpt)
    png = _plot(uniform, gpt)
    return write_csv_png(out, "memory", to_csv(uniform + gpt), png)
