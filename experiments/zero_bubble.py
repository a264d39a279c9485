"""ZB-H1 against 1F1B, simulated (Qi et al., ICLR'24 §2–3): the bubble over p and m, beside the closed forms and the
published gain.

Qi et al. (Zero Bubble Pipeline Parallelism, ICLR'24, arXiv 2401.10241 §2–3) split each backward into B, the input
gradient the previous stage waits for, and W, the weight gradient nobody waits for, and defer W into 1F1B's idle
slots. With uniform stages and free links, in the paper's time-domain notation (T_B the input-gradient half)::

    1F1B:   iteration = m·(T_F + T_B + T_W) + (p − 1)·(T_F + T_B + T_W),  bubble ÷ ideal = (p − 1)/m
    ZB-H1:  iteration = m·(T_F + T_B + T_W) + (p − 1)·(T_F + T_B − T_W),  bubble ÷ ideal = (p − 1)/(3m) at
            T_F = T_B = T_W

(``zb1p`` in the table of ``docs/guides/schedules.md``), at the same peak activation memory on the first stage
(p microbatches).
Published: ZB-H1 "outperforms the 1F1B schedule up to 23% in throughput under a similar memory limit", 31 % when
the memory constraint is relaxed (ZB-H2; arXiv abstract).

For p ∈ {2, 4, 8} and m ∈ {p, 2p, 4p, 8p}, ``1f1b`` and ``zb1p`` are simulated by the product
(:func:`sim.plan.build.build_plan` then :func:`sim.predict.predict`) in two cases:

* ``ideal``: :data:`UNIFORM` (8 identical layers, 1 ms forward, 2 ms backward per sample: the cost view charges
  half a backward to I and half to W, so T_F = T_B = T_W = 8/p ms per stage) on ``{p}xideal``, where the closed
  forms hold exactly and are printed beside the simulated times;
* ``a100``: :data:`GPT` on ``{p}xA100``: messages, the heavier first and last stages (embedding, head) and the
  optimizer step cost, and W is half of each layer's backward by the cost view's rule, as in the ideal case.

Prints per case the times, the closed forms where exact, the gain over 1F1B, both bubbles against (p − 1)/m and
(p − 1)/(3m), and the peak memory of each schedule; writes ``zero_bubble.csv`` and ``zero_bubble.png``, all or
none. ``--quick``: p ∈ {2, 4} (CI).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from experiments.harness import write_csv_png
from experiments.schedule_cases import GPT, Case, GridResult, chosen_cases, grid_parser
from sim.core.cli import CliParser
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built
from sim.report.png import figure_png

__all__ = ["Case", "Row", "CASES", "UNIFORM", "GPT", "PAPER_GAIN", "simulate", "closed_form_s", "grid", "Result",
           "parser", "run", "report", "write"]

#: 8 identical layers, forward 1 ms and backward 2 ms per sample: a stage of 8/p layers has T_F = T_B = T_W = 8/p ms.
UNIFORM = "uniform:layers=8,fwd_ms=1,bwd_ms=2"
UNIFORM_LAYERS, UNIFORM_LAYER_F_S = 8, 1e-3
#: Published (arXiv 2401.10241 abstract): up to 23 % over 1F1B at similar memory; 31 % with the memory relaxed.
PAPER_GAIN, PAPER_GAIN_RELAXED = 0.23, 0.31
PAPER_NOTE = "arXiv 2401.10241 abstract: up to 23% over 1F1B at similar memory (31% with memory relaxed, ZB-H2)"

PS, M_FACTORS, SCHEDULES = (2, 4, 8), (1, 2, 4, 8), ("1f1b", "zb1p")



CASES = (Case("ideal", UNIFORM, "ideal", True), Case("a100", GPT, "A100", False))


@dataclass(frozen=True)
class Row:
    """One simulated iteration: ``time_s`` (s), ``idle_fraction`` (the share of the ranks' time their compute is
    idle: the pipeline bubble and the exposed point-to-point transfers, which on free links are nothing), and the
    largest peak memory of a rank (bytes)."""

    case: Case
    p: int
    m: int
    schedule: str
    time_s: float
    idle_fraction: float
    peak_memory_bytes: int


def closed_form_s(schedule: str, p: int, m: int) -> float:
    """The module docstring's iteration time of :data:`UNIFORM` (s), T_F = T_B = T_W = (8/p) ms."""
    t = UNIFORM_LAYERS // p * UNIFORM_LAYER_F_S
    fill = 3 * t if schedule == "1f1b" else t  # (T_F + T_B + T_W) or (T_F + T_B - T_W)
    return m * 3 * t + (p - 1) * fill


def bubble_over_ideal(schedule: str, p: int, m: int) -> float:
    """The closed-form bubble ÷ ideal at T_F = T_B = T_W: (p − 1)/m for 1F1B, (p − 1)/(3m) for ZB-H1."""
    return (p - 1) / m if schedule == "1f1b" else (p - 1) / (3 * m)


def simulate(case: Case, p: int, m: int, schedule: str) -> Row:
    """One iteration of ``case`` at p ranks and m microbatches of one sample."""
    built = build_plan(PlanInputs(case.model, f"{p}x{case.device}", schedule, microbatches=m))
    prediction = predict_built(built)
    metrics = prediction.metrics
    return Row(case, p, m, schedule, metrics["iteration_time_s"], metrics["idle_fraction"],
               max(prediction.peak_memory_bytes))


def grid(cases: tuple[Case, ...], ps: tuple[int, ...]) -> list[Row]:
    """Every (case, p, m) of the grid, 1F1B then ZB-H1."""
    return [simulate(case, p, p * k, s) for case in cases for p in ps for k in M_FACTORS for s in SCHEDULES]


def _pair(rows: list[Row], row: Row, schedule: str) -> Row:
    return next(r for r in rows if (r.case, r.p, r.m, r.schedule) == (row.case, row.p, row.m, schedule))


def gain(rows: list[Row], row: Row) -> float:
    """ZB-H1's throughput over 1F1B's at the same case, p and m, minus one (0.23: 23 % faster)."""
    return _pair(rows, row, "1f1b").time_s / _pair(rows, row, "zb1p").time_s - 1.0


def closed_gain(p: int, m: int) -> float:
    """The closed-form gain 3(m + p − 1)/(3m + p − 1) − 1 = 2(p − 1)/(3m + p − 1)."""
    return closed_form_s("1f1b", p, m) / closed_form_s("zb1p", p, m) - 1.0


def _bubble_over_ideal(row: Row) -> float:
    """The simulated bubble ÷ ideal from the idle fraction f of the total: f / (1 − f). The idle share, not the
    pipeline bubble alone, as the page's tables were taken; on the uniform cases' free links the two are equal."""
    return row.idle_fraction / (1.0 - row.idle_fraction)


def _table(rows: list[Row], case: Case) -> list[str]:
    lines = [f"## {case.key}: {case.model} on {{p}}x{case.device}", "",
             "| p | m | 1F1B (ms) | closed form | ZB-H1 (ms) | closed form | gain | closed-form gain | "
             "1F1B bubble/ideal ((p-1)/m) | ZB-H1 bubble/ideal ((p-1)/3m) | peak memory 1F1B / ZB-H1 (GB) |",
             "|" + "---:|" * 11]
    for one in (r for r in rows if r.case == case and r.schedule == "1f1b"):
        zb = _pair(rows, one, "zb1p")
        closed = {s: f"{closed_form_s(s, one.p, one.m) * 1e3:.2f}" if case.exact else "" for s in SCHEDULES}
        lines.append(f"| {one.p} | {one.m} | {one.time_s * 1e3:.2f} | {closed['1f1b']} | {zb.time_s * 1e3:.2f} | "
                     f"{closed['zb1p']} | {gain(rows, one):+.1%} | {closed_gain(one.p, one.m):+.1%} | "
                     f"{_bubble_over_ideal(one):.3f} ({bubble_over_ideal('1f1b', one.p, one.m):.3f}) | "
                     f"{_bubble_over_ideal(zb):.3f} ({bubble_over_ideal('zb1p', one.p, one.m):.3f}) | "
                     f"{one.peak_memory_bytes / 1e9:.2f} / {zb.peak_memory_bytes / 1e9:.2f} |")
    return lines


def _summary(rows: list[Row]) -> list[str]:
    lines = []
    for case in sorted({r.case for r in rows}, key=CASES.index):
        ones = [r for r in rows if r.case == case and r.schedule == "1f1b"]
        best = max(ones, key=lambda r: gain(rows, r))
        lines.append(f"{case.key}: largest gain {gain(rows, best):+.1%} (p={best.p}, m={best.m}; closed form "
                     f"{closed_gain(best.p, best.m):+.1%}), smallest {min(gain(rows, r) for r in ones):+.1%}")
    lines.append(f"paper: {PAPER_NOTE}")
    return lines


FIELDS = ("case", "model", "topology", "p", "m", "schedule", "iteration_time_s", "closed_form_s", "gain_over_1f1b",
          "closed_form_gain", "idle_fraction", "bubble_over_ideal", "closed_form_bubble_over_ideal",
          "peak_memory_bytes", "paper_gain")


def _csv(rows: list[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(FIELDS)
    for row in rows:
        writer.writerow([row.case.key, row.case.model, f"{row.p}x{row.case.device}", row.p, row.m, row.schedule,
                         repr(row.time_s), repr(closed_form_s(row.schedule, row.p, row.m)) if row.case.exact else "",
                         f"{gain(rows, row):.6f}", f"{closed_gain(row.p, row.m):.6f}", f"{row.idle_fraction:.6f}",
                         f"{_bubble_over_ideal(row):.6f}", f"{bubble_over_ideal(row.schedule, row.p, row.m):.6f}",
                         row.peak_memory_bytes, PAPER_GAIN])
    return buffer.getvalue()


def _plot(rows: list[Row]) -> bytes:
    """ZB-H1's gain over 1F1B against m/p, one line per case and p, the closed form as crosses, the paper's 23 % and
    31 % as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    colors = {2: "#2ca02c", 4: "#1f77b4", 8: "#d62728"}
    styles = {"ideal": "-", "a100": "--"}
    for case in CASES:
        for p in PS:
            line = [r for r in rows if (r.case, r.p, r.schedule) == (case, p, "1f1b")]
            if not line:
                continue
            ax.plot([r.m // p for r in line], [100 * gain(rows, r) for r in line], styles[case.key], color=colors[p],
                    marker="o", markersize=3, label=f"{case.key}, p={p}")
            if case.exact:
                ax.plot([r.m // p for r in line], [100 * closed_gain(p, r.m) for r in line], "x", color="black",
                        markersize=7, label="closed form" if p == PS[0] else None)
    ax.axhline(100 * PAPER_GAIN, color="gray", linestyle="-.", linewidth=1, label="paper: up to 23% (ZB-H1)")
    ax.axhline(100 * PAPER_GAIN_RELAXED, color="gray", linestyle=":", linewidth=1, label="paper: 31% (relaxed)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["p", "2p", "4p", "8p"])
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("ZB-H1 throughput gain over 1F1B (%)")
    ax.set_title("ZB-H1 vs 1F1B, simulated: uniform stages on free links and a 1.8B GPT on A100s", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return figure_png(fig, dpi=110)


#: The experiment's result: the cases asked for and their grid of :class:`Row`.
Result = GridResult


def parser() -> CliParser:
    """``python -m experiments.run zero_bubble [--quick] [--cases ...] [--out DIR]``."""
    return grid_parser("zero_bubble", __doc__.split("\n\n")[0], CASES, "p in {2, 4} only (CI)")


def run(*, quick: bool = False, cases: tuple[str, ...] = tuple(c.key for c in CASES)) -> Result:
    """The grid of the cases named by ``cases`` (keys of :data:`CASES`); ``quick``: p in {2, 4} only (CI)."""
    chosen = chosen_cases(cases, CASES)
    return Result(chosen, tuple(grid(chosen, PS[:2] if quick else PS)))


def report(result: Result) -> str:
    """One table per case, then the largest and smallest gains and the paper."""
    rows = list(result.rows)
    return "\n".join([*(line for case in result.cases for line in [*_table(rows, case), ""]), *_summary(rows)])


def write(result: Result, out: Path) -> list[Path]:
    """``zero_bubble.csv`` and ``zero_bubble.png`` in ``out``."""
    rows = list(result.rows)
    return write_csv_png(out, "zero_bubble", _csv(rows), _plot(rows))
