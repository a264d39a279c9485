"""Goodput under failures: the four recovery policies of ``sim.faults.recovery`` over scale and MTBF for a 70B-class
plan, beside the Llama 3 report and the published recovery claims (``python -m experiments.run faults``).

The plan: Llama 3.1 70B at 8K tokens, TP 8 × PP 4 (1F1B, full recomputation, ZeRO-1), 16 sequences per replica per
iteration, on N H100s in servers of 8, N = 1,024, 4,096 and 16,384 (DP = N/32, weak scaling); its iteration time is
the simulator's (``sim.plan.build``, ``sim.predict``). The run: 720 hours of failure-free training. Failures: the
built-in mix (Llama 3 405B's 419 interruptions, arXiv 2407.21783 Table 5) at a per-GPU MTBF of half, once and twice
the one that mix implies (50,676 h), restart 10 minutes [assumed], checkpoints of the whole model's state at Llama 3's
storage bandwidth per GPU (``sim.faults.checkpoint``), written synchronously.

Policies (``sim.faults.recovery``): ``restart`` from the last checkpoint; ``drop-replica`` (D/(D − k) slower with k
replicas out); ``recycle`` (the failed stage's work on its data-parallel peers: its slowdown is the plan simulated with
those peers as stragglers of D/(D − 1), averaged over the four stages, on a two-replica copy of the plan, since a slow
stage in every replica but one costs the iteration what it costs in every one); ``oobleck`` (re-planned onto the
survivors, N/(N − 8k) slower). A continuing policy pauses 60 s to reconfigure [assumed] and runs degraded until the
failed server is replaced, the restart time later. Each policy checkpoints at the interval of a grid around Young's
that gives it the least expected wall time; every figure is the mean of 8 seeded runs (the same failures' luck for
every policy and interval).

Beside it: Llama 3's "higher than 90 % effective training time" at 16,384 H100s over 54 days with 419 unexpected
interruptions (§3.3.4), and the recovery systems' own claims (../shared/reference/faults.md): ReCycle up to 1.46× the
throughput of Oobleck and 1.64× of Bamboo under failures; Oobleck up to 13.9× Bamboo's and Varuna's (SOSP abstract).
Those were measured on other models, clusters and failure rates, so they are listed, not matched; what is comparable
is the direction and the ratio of the policies' goodput here.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.harness import write_csv_png
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.engine.perturbation import Perturbation, Straggler
from sim.faults.checkpoint import checkpoint_cost
from sim.faults.failure_mix import builtin_mix, job_mtbf_s
from sim.faults.interval import young_interval
from sim.faults.long_run import LongRun, LongRunResult, expected_long_run
from sim.faults.recovery import POLICIES, RESTART, Recovery, drop_replica, oobleck, recycle, simulate_recovery
from sim.models import build_model
from sim.plan.build import BuiltPlan, build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

__all__ = ["SCALES", "MTBF_FACTORS", "Row", "Result", "plan_inputs", "recycle_slowdown", "policies", "parser", "run",
           "report", "write"]

MODEL = "llama3.1-70b,seq=8192"
TP, PP, PER_REPLICA = 8, 4, 16
#: GPUs of the sweep.
SCALES = (1024, 4096, 16384)
#: Per-GPU MTBF as multiples of the built-in mix's.
MTBF_FACTORS = (0.5, 1.0, 2.0)
TRAIN_HOURS = 720.0
RESTART_S = 600.0
RECONFIGURE_S = 60.0
TRIALS = 8
#: Checkpoint intervals tried per policy, as multiples of Young's.
INTERVALS = (1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass(frozen=True)
class Row:
    """One policy at one scale and MTBF.

    Attributes:
        gpus, device_mtbf_h, job_mtbf_h: the cluster and how often it fails (h).
        policy: the recovery policy.
        iteration_s: the simulated iteration (s).
        checkpoint_every: the interval chosen (iterations).
        ettr: expected effective training time ratio.
        goodput_tokens_per_s: expected tokens of iterations that count per second of wall time.
        failures: expected failures.
        lost_h, checkpoint_h, restart_h, degraded_h: where the time went (h).
    """

    gpus: int
    device_mtbf_h: float
    job_mtbf_h: float
    policy: str
    iteration_s: float
    checkpoint_every: int
    ettr: float
    goodput_tokens_per_s: float
    failures: float
    lost_h: float
    checkpoint_h: float
    restart_h: float
    degraded_h: float


def plan_inputs(gpus: int) -> PlanInputs:
    """The 70B plan on ``gpus`` H100s (module docstring)."""
    replicas = gpus // (TP * PP)
    return PlanInputs(MODEL, f"{gpus // 8}x8xH100", "1f1b", None, tp=TP, pp=PP, dp=replicas, zero=1,
                      global_batch=PER_REPLICA * replicas, recompute="full")


def recycle_slowdown(replicas: int) -> float:
    """One failure's slowdown under ReCycle (module docstring): the two-replica plan with stage s of both replicas
    slowed by D/(D − 1), over the plain one, averaged over the stages."""
    built = build_plan(plan_inputs(2 * TP * PP))
    plain = predict_built(built, check_memory=False).metrics["iteration_time_s"]
    layout, factor = built.plan.layout, replicas / (replicas - 1)
    ratios = []
    for stage in range(PP):
        slow = tuple(Straggler(layout.device(stage, d, 0), factor) for d in range(layout.data_ranks))
        slowed = predict_built(built, check_memory=False, perturbation=Perturbation(slow))
        ratios.append(slowed.metrics["iteration_time_s"] / plain)
    return sum(ratios) / len(ratios)


def policies(gpus: int) -> tuple[Recovery, ...]:
    """The four policies for the plan on ``gpus`` GPUs, in :data:`POLICIES` order."""
    replicas = gpus // (TP * PP)
    return (RESTART, drop_replica(replicas, reconfigure_s=RECONFIGURE_S),
            recycle(recycle_slowdown(replicas), replicas, reconfigure_s=RECONFIGURE_S),
            oobleck(gpus, 8, reconfigure_s=RECONFIGURE_S))


def _best(run: LongRun, recovery: Recovery) -> tuple[LongRun, LongRunResult]:
    """The run at the interval of :data:`INTERVALS` with the least expected wall time under ``recovery``."""
    young = young_interval(run.checkpoint.blocking_s, run.mtbf_s) / run.iteration_s

    def simulate(candidate, rng):
        return simulate_recovery(candidate, recovery, rng)

    best = None
    for multiple in INTERVALS:
        every = max(1, min(run.iterations, round(young * multiple)))
        candidate = replace(run, checkpoint_every=every)
        try:
            result = expected_long_run(candidate, trials=TRIALS, seed=0, simulate=simulate)
        except SpecError:  # an interval too long to finish is no candidate (sim.faults.long_run refuses it)
            continue
        if best is None or result.wall_s < best[1].wall_s:
            best = (candidate, result)
    assert best is not None
    return best


@dataclass(frozen=True)
class Result:
    """Every row of the sweep: scale by scale, MTBF factor by factor, policy by policy."""

    rows: tuple[Row, ...]


def run(*, scales: tuple[int, ...] = SCALES, mtbf_factors: tuple[float, ...] = MTBF_FACTORS) -> Result:
    """Every row of the sweep (module docstring) over ``scales`` (GPUs) and ``mtbf_factors`` (× Llama 3's per-GPU
    MTBF); the command runs the defaults."""
    mix = builtin_mix()
    base_mtbf = mix.device_mtbf_s()
    assert base_mtbf is not None
    rows = []
    for gpus in scales:
        built: BuiltPlan = build_plan(plan_inputs(gpus))
        metrics = predict_built(built, check_memory=False).metrics
        iteration_s, tokens = metrics["iteration_time_s"], metrics["tokens_per_iteration"]
        cost = checkpoint_cost(build_model(MODEL), built.topology)
        recoveries = policies(gpus)
        for factor in mtbf_factors:
            mtbf = job_mtbf_s(base_mtbf * factor, gpus)
            long_run = LongRun(iteration_s, round(TRAIN_HOURS * 3600 / iteration_s), 1, cost, mtbf, RESTART_S, mix)
            for recovery in recoveries:
                chosen, result = _best(long_run, recovery)
                rows.append(Row(gpus, base_mtbf * factor / 3600, mtbf / 3600, recovery.name, iteration_s,
                                chosen.checkpoint_every, result.effective_training_time_ratio,
                                tokens * chosen.iterations / result.wall_s, result.failure_count,
                                result.lost_work_s / 3600, result.checkpoint_s / 3600, result.restart_s / 3600,
                                result.degraded_s / 3600))
    return Result(tuple(rows))


def _table(rows: list[Row]) -> list[str]:
    lines = ["  GPUs  GPU MTBF h  job MTBF h  policy         iter s  ckpt every  ETTR    goodput tok/s  failures  "
             "lost h  ckpt h  restart h  degraded h"]
    for r in rows:
        lines.append(f"{r.gpus:>6}  {r.device_mtbf_h:>10,.0f}  {r.job_mtbf_h:>10.2f}  {r.policy:<13} "
                     f"{r.iteration_s:>6.2f}  {r.checkpoint_every:>10}  {r.ettr:6.1%}  "
                     f"{r.goodput_tokens_per_s:>13,.0f}  {r.failures:>8.1f}  {r.lost_h:>6.1f}  "
                     f"{r.checkpoint_h:>6.1f}  {r.restart_h:>9.1f}  {r.degraded_h:>10.1f}")
    return lines


def _plot(rows: list[Row]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.report.png import figure_png

    factors = sorted({r.device_mtbf_h for r in rows})
    fig, axes = plt.subplots(1, len(factors), figsize=(4.2 * len(factors), 4.0), dpi=110, sharey=True, squeeze=False)
    colours = {"restart": "#d62728", "drop-replica": "#1f77b4", "recycle": "#2ca02c", "oobleck": "#9467bd"}
    for ax, mtbf in zip(axes[0], factors, strict=True):
        for policy in POLICIES:
            points = sorted((r.gpus, r.ettr) for r in rows if r.policy == policy and r.device_mtbf_h == mtbf)
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=policy,
                    color=colours[policy])
        ax.axhline(90, color="#999999", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(f"GPU MTBF {mtbf:,.0f} h", fontsize=9)
        ax.grid(True, linewidth=0.3)
    axes[0][0].set_ylabel("effective training time (%)")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle("70B-class plan, 720 h of training: recovery policies (dashed: Llama 3's 90 % at 16k GPUs)",
                 fontsize=9)
    fig.tight_layout()
    return figure_png(fig)


def write(result: Result, out: Path) -> list[Path]:
    """``faults.csv`` (every row) and ``faults.png`` in ``out``."""
    rows = list(result.rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    fields = list(Row.__dataclass_fields__)
    writer.writerow(fields)
    for r in rows:
        writer.writerow([f"{getattr(r, f):.6g}" if isinstance(getattr(r, f), float) else getattr(r, f)
                         for f in fields])
    return write_csv_png(out, "faults", buffer.getvalue(), _plot(rows))


def parser() -> CliParser:
    """``python -m experiments.run faults [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/faults", help="output directory (default runs/faults)")
    return parser


def report(result: Result) -> str:
    """The plan and failure model, the table, and the largest scale beside Llama 3's and ReCycle's claims."""
    rows = list(result.rows)
    lines = [f"70B-class plan (TP {TP} x PP {PP}, {PER_REPLICA} sequences of 8K per replica), {TRAIN_HOURS:g} h of "
             f"training; failures: Llama 3's mix at x{', x'.join(f'{f:g}' for f in MTBF_FACTORS)} its per-GPU MTBF; "
             f"restart {RESTART_S / 60:g} min, reconfigure {RECONFIGURE_S:g} s [assumed]; mean of {TRIALS} seeded "
             f"runs", *_table(rows)]
    llama = builtin_mix().device_mtbf_s() / 3600
    at_scale = {r.policy: r for r in rows if r.gpus == max(SCALES) and math.isclose(r.device_mtbf_h, llama)}
    if at_scale:
        lines.append(f"at {max(SCALES):,} GPUs with Llama 3's MTBF: restart {at_scale['restart'].ettr:.1%} effective "
                     f"training time (Llama 3 405B on 16,384 H100s: > 90 %); recycle / oobleck goodput "
                     f"{at_scale['recycle'].goodput_tokens_per_s / at_scale['oobleck'].goodput_tokens_per_s:.3f} "
                     f"(ReCycle's claim: up to 1.46); oobleck / restart "
                     f"{at_scale['oobleck'].goodput_tokens_per_s / at_scale['restart'].goodput_tokens_per_s:.3f}")
    return "\n".join(lines)
