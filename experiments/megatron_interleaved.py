"""Megatron's interleaved 1F1B against 1F1B, simulated (Narayanan et al., SC'21 §2.2.2): the gain as a function of the
microbatch count m and the chunks per rank v, and the extra point-to-point communication it costs.

Narayanan et al. (SC'21, arXiv 2104.04473 §2.2.2) cut each rank's share of the model into v chunks placed in a
loop, so a microbatch visits every rank v times and the pipeline fills and drains in (p − 1)/v stage-times instead
of p − 1: with uniform stages and free links

    1F1B:         iteration = (m + p − 1)·(t_f + t_b),      bubble ÷ ideal = (p − 1)/m
    interleaved:  iteration = (m + (p − 1)/v)·(t_f + t_b),  bubble ÷ ideal = (p − 1)/(v·m)

(t_f, t_b: a full stage's forward and backward time of one microbatch), at the cost of v times the messages: a
microbatch crosses p·v − 1 vstage boundaries each way instead of p − 1, so an iteration sends 2·m·(p·v − 1)
activations and gradients of b·s·h elements each (§2.2.2; §3.1 for the b·s·h). m must be a multiple of p. The
paper's throughput claim: the interleaved schedule improves throughput by "10+%" at comparable memory (abstract;
"as much as 10%" in the body), on large GPT models on DGX A100 clusters.

For p ∈ {4, 8}, v ∈ {1 (= ``1f1b``), 2, 4} and m ∈ {p, 2p, 4p, 8p}, three cases, each simulated by the product
(:func:`sim.plan.build.build_plan` then :func:`sim.predict.predict`):

* ``ideal``: :data:`UNIFORM` (32 identical layers, 1 ms forward and 2 ms backward per sample) on ``{p}xideal``
  (infinitely fast links), where the closed forms above hold exactly and are printed beside the simulated time;
* ``a100``: :data:`GPT` on ``{p}xA100`` (NVSwitch, 235 GB/s per message): messages cost, the embedding and the head
  make the first and last stage heavier, and the gain is what the product predicts;
* ``v100``: the same GPT on ``{p}xV100`` (DGX-1 cube mesh: 21 GB/s NVLink between neighbours, PCIe where two GPUs
  share no NVLink, which the loop placement's wrap from rank p − 1 to rank 0 crosses at p = 8).

Prints one table per case (time, closed form where exact, gain over 1F1B, idle share, SEND ops and their bytes against
2·m·(p·v − 1)), then where interleaving stops paying. Writes ``megatron_interleaved.csv`` and
``megatron_interleaved.png``, all or none. ``--quick``: p = 4 only (CI).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from experiments.harness import write_csv_png
from experiments.schedule_cases import GPT, Case, GridResult, chosen_cases, grid_parser
from sim.core.cli import CliParser
from sim.ir.plan import OpKind
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["Case", "Row", "CASES", "UNIFORM", "GPT", "PAPER_GAIN", "simulate", "closed_form_s", "closed_sends",
           "grid", "Result", "parser", "run", "report", "write"]

#: 32 identical layers, forward 1 ms and backward 2 ms per sample, 1 MB of activation: a full stage of 32/p layers
#: takes t_f + t_b = 96/p ms per microbatch of one sample.
UNIFORM = "uniform:layers=32,fwd_ms=1,bwd_ms=2"
UNIFORM_LAYER_S, UNIFORM_LAYERS = 3e-3, 32
#: The paper's claim (SC'21, abstract): "10+%" higher throughput than 1F1B at comparable memory.
PAPER_GAIN = 0.10
PAPER_NOTE = "SC'21 abstract: interleaving improves throughput by 10+% at comparable memory (body: as much as 10%)"

PS, VS, M_FACTORS = (4, 8), (1, 2, 4), (1, 2, 4, 8)



CASES = (Case("ideal", UNIFORM, "ideal", True), Case("a100", GPT, "A100", False), Case("v100", GPT, "V100", False))


@dataclass(frozen=True)
class Row:
    """One simulated iteration: ``time_s`` (s), ``idle_fraction`` (the share of the ranks' time their compute is idle:
    the pipeline bubble and the exposed point-to-point transfers, which on free links are nothing), SEND ops and the
    bytes they carry (every point-to-point message of the iteration, bytes)."""

    case: Case
    p: int
    v: int
    m: int
    time_s: float
    idle_fraction: float
    sends: int
    p2p_bytes: int

    @property
    def schedule(self) -> str:
        return "1f1b" if self.v == 1 else "interleaved"


def closed_form_s(p: int, v: int, m: int) -> float:
    """(m + (p − 1)/v)·(t_f + t_b) for :data:`UNIFORM` (s): a stage of 32/p layers at 3 ms a layer."""
    return (m + (p - 1) / v) * (UNIFORM_LAYERS // p) * UNIFORM_LAYER_S


def closed_sends(p: int, v: int, m: int) -> int:
    """SEND ops of one iteration: each of m microbatches crosses p·v − 1 vstage boundaries forward and backward."""
    return 2 * m * (p * v - 1)


def simulate(case: Case, p: int, v: int, m: int) -> Row:
    """One iteration of ``case`` at p ranks, v chunks (1: ``1f1b``) and m microbatches of one sample."""
    schedule = "1f1b" if v == 1 else "interleaved"
    built = build_plan(PlanInputs(case.model, f"{p}x{case.device}", schedule, microbatches=m, chunks=v))
    prediction = predict_built(built)
    metrics = prediction.metrics
    # Messages from the plan itself, each at the cost view's size (the metrics' link bytes count every hop of a
    # path, twice through an NVSwitch, so they are not the bytes sent).
    sends = [op for program in built.plan.programs for op in program if op.kind in (OpKind.SEND_F, OpKind.SEND_B)]
    return Row(case, p, v, m, metrics["iteration_time_s"], metrics["idle_fraction"], len(sends),
               sum(built.costs.message_bytes(op.kind, op.vstage) for op in sends))


def grid(cases: tuple[Case, ...], ps: tuple[int, ...]) -> list[Row]:
    """Every (case, p, m, v) of the grid, 1F1B (v = 1) first in each (case, p, m)."""
    return [simulate(case, p, v, p * k) for case in cases for p in ps for k in M_FACTORS for v in VS]


def _baseline(rows: list[Row], row: Row) -> Row:
    return next(r for r in rows if (r.case, r.p, r.m, r.v) == (row.case, row.p, row.m, 1))


def gain(rows: list[Row], row: Row) -> float:
    """Throughput over 1F1B's at the same case, p and m, minus one (0.1: 10 % faster)."""
    return _baseline(rows, row).time_s / row.time_s - 1.0


def _table(rows: list[Row], case: Case) -> list[str]:
    lines = [f"## {case.key}: {case.model} on {{p}}x{case.device}", "",
             "| p | m | v | schedule | time (ms) | closed form (ms) | gain over 1F1B | closed-form gain | idle | "
             "SEND ops (2m(pv-1)) | p2p MB | x 1F1B's bytes |", "|" + "---:|" * 3 + "---|" + "---:|" * 8]
    for row in (r for r in rows if r.case == case):
        base = _baseline(rows, row)
        closed = closed_form_s(row.p, row.v, row.m) if case.exact else None
        closed_gain = (closed_form_s(row.p, 1, row.m) / closed - 1.0) if closed else None
        lines.append(f"| {row.p} | {row.m} | {row.v} | {row.schedule} | {row.time_s * 1e3:.2f} | "
                     f"{'' if closed is None else f'{closed * 1e3:.2f}'} | {gain(rows, row):+.1%} | "
                     f"{'' if closed_gain is None else f'{closed_gain:+.1%}'} | {row.idle_fraction:.3f} | "
                     f"{row.sends} ({closed_sends(row.p, row.v, row.m)}) | {row.p2p_bytes / 1e6:.0f} | "
                     f"{row.p2p_bytes / base.p2p_bytes:.2f} |")
    return lines


def _verdicts(rows: list[Row]) -> list[str]:
    """Per real case and p: the best v at each m, and the m from which v = 4 no longer beats v = 2."""
    lines = []
    for case in sorted({r.case for r in rows if not r.case.exact}, key=CASES.index):
        for p in sorted({r.p for r in rows if r.case == case}):
            best = []
            for m in sorted({r.m for r in rows if r.case == case and r.p == p}):
                group = [r for r in rows if (r.case, r.p, r.m) == (case, p, m)]
                top = min(group, key=lambda r: r.time_s)
                best.append(f"m={m}: v={top.v} ({gain(rows, top):+.1%})")
            lines.append(f"{case.key} p={p}: best " + ", ".join(best))
    most = max((r for r in rows if not r.case.exact), key=lambda r: gain(rows, r), default=None)
    if most is not None:
        lines.append(f"largest simulated gain on a real node: {gain(rows, most):+.1%} ({most.case.key}, p={most.p}, "
                     f"m={most.m}, v={most.v}); paper: {PAPER_NOTE}")
    return lines


FIELDS = ("case", "model", "topology", "p", "v", "m", "schedule", "iteration_time_s", "closed_form_s",
          "gain_over_1f1b", "closed_form_gain", "idle_fraction", "send_ops", "closed_form_send_ops", "p2p_bytes",
          "p2p_bytes_over_1f1b", "paper_gain")


def _csv(rows: list[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(FIELDS)
    for row in rows:
        closed = closed_form_s(row.p, row.v, row.m) if row.case.exact else None
        base = _baseline(rows, row)
        writer.writerow([row.case.key, row.case.model, f"{row.p}x{row.case.device}", row.p, row.v, row.m, row.schedule,
                         repr(row.time_s), "" if closed is None else repr(closed), f"{gain(rows, row):.6f}",
                         "" if closed is None else f"{closed_form_s(row.p, 1, row.m) / closed - 1.0:.6f}",
                         f"{row.idle_fraction:.6f}", row.sends, closed_sends(row.p, row.v, row.m), row.p2p_bytes,
                         f"{row.p2p_bytes / base.p2p_bytes:.6f}", PAPER_GAIN])
    return buffer.getvalue()


def _plot(rows: list[Row]) -> bytes:
    """Per p, the gain over 1F1B against m/p: one line per case and v > 1, the closed form as crosses, the paper's
    10 % as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r.p for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(5.5 * len(ps), 4.2), squeeze=False)
    styles = {"ideal": "-", "a100": "--", "v100": ":"}
    colors = {2: "#1f77b4", 4: "#d62728"}
    for ax, p in zip(axes[0], ps):
        for case in CASES:
            for v in VS[1:]:
                line = [r for r in rows if (r.case, r.p, r.v) == (case, p, v)]
                if not line:
                    continue
                ax.plot([r.m // p for r in line], [100 * gain(rows, r) for r in line], styles[case.key],
                        color=colors[v], marker="o", markersize=3, label=f"{case.key}, v={v}")
                if case.exact:
                    ax.plot([r.m // p for r in line],
                            [100 * (closed_form_s(p, 1, r.m) / closed_form_s(p, v, r.m) - 1) for r in line], "x",
                            color="black", markersize=7, label="closed form" if v == VS[1] else None)
        ax.axhline(100 * PAPER_GAIN, color="gray", linestyle="-.", linewidth=1, label="paper: 10+%")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["p", "2p", "4p", "8p"])
        ax.set_xlabel("microbatches m")
        ax.set_ylabel("throughput gain over 1F1B (%)")
        ax.set_title(f"interleaved 1F1B, p = {p}", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Interleaved vs 1F1B, simulated: uniform stages on free links, a 1.8B GPT on A100 and V100 nodes",
                 fontsize=10)
    fig.tight_layout()
    return figure_png(fig, dpi=110)


#: The experiment's result: the cases asked for and their grid of :class:`Row`.
Result = GridResult


def parser() -> CliParser:
    """``python -m experiments.run megatron_interleaved [--quick] [--cases ...] [--out DIR]``."""
    return grid_parser("megatron_interleaved", __doc__.split("\n\n")[0], CASES, "p = 4 only (CI)")


def run(*, quick: bool = False, cases: tuple[str, ...] = tuple(c.key for c in CASES)) -> Result:
    """The grid of the cases named by ``cases`` (keys of :data:`CASES`); ``quick``: p = 4 only (CI)."""
    chosen = chosen_cases(cases, CASES)
    return Result(chosen, tuple(grid(chosen, PS[:1] if quick else PS)))


def report(result: Result) -> str:
    """One table per case, then the verdicts beside the paper."""
    rows = list(result.rows)
    return "\n".join([*(line for case in result.cases for line in [*_table(rows, case), ""]), *_verdicts(rows)])


def write(result: Result, out: Path) -> list[Path]:
    """``megatron_interleaved.csv`` and ``megatron_interleaved.png`` in ``out``."""
    rows = list(result.rows)
    return write_csv_png(out, "megatron_interleaved", _csv(rows), _plot(rows))
