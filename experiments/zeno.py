"""One Byzantine replica of four: the loss of plain averaging against Zeno's aggregation, and what Zeno costs per
step, simulated and measured (``python -m experiments.run zeno``).

On this host, 4 CPU ranks of data parallelism (gloo) train ``cnn:layers=4,features=8,kernel=3,size=16`` with
SGD (learning rate 0.05) for 30 iterations of 2 microbatches per replica, three ways: every replica honest and the
gradients averaged; replica 3 sending −4 times its gradient (``--byzantine 3:sign-flip``) and the gradients
averaged; the same replica and Zeno dropping the lowest-scored of the four each step (``--aggregate zeno:1``,
``executor.zeno``). The curves are each iteration's mean training loss over the global batch (``metrics.json``).

What Zeno costs per step: measured, the mean ``REDUCE_GRAD`` span with Zeno against with the mean (``compare.json``;
Zeno's span holds the all-gather and the scoring); simulated, the plan's all-reduce against an all-gather of the four
gradients plus five forward passes of the model on a microbatch, both from the plan's cost model (the one cost
oracle: ``sim.cost.cost_view.CostView``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.sim_vs_real import run_module
from sim.core.cli import CliParser
from sim.core.fileio import write_bytes_atomic, write_json_atomic
from sim.ir.ops import OpKind
from sim.ir.plan import Plan
from sim.predict import predict

__all__ = ["MODEL", "RUNS", "Result", "simulated_cost", "parser", "run", "report", "write"]

MODEL = "cnn:layers=4,features=8,kernel=3,size=16"
ITERATIONS, LR, REPLICAS = 30, "0.05", 4
#: name → the executor.run flags of each run.
RUNS = {"clean, mean": [], "one Byzantine, mean": ["--byzantine", "3:sign-flip"],
        "one Byzantine, zeno:1": ["--byzantine", "3:sign-flip", "--aggregate", "zeno:1"]}


def simulated_cost(plan: Plan) -> dict[str, float]:
    """The simulated REDUCE_GRAD of ``plan`` with the mean and with Zeno (module docstring), in s."""
    costs = predict(plan, check_memory=False).costs
    assert costs is not None
    layout = plan.layout
    group = (layout.dp_group(0, 0),)
    gradients = costs.param_bytes(0)
    zeno = (costs.oracle.collective("all_gather", group, layout.dp * gradients).seconds
            + (layout.dp + 1) * costs.compute_time(OpKind.F, 0))
    return {"mean_s": costs.collective_op(OpKind.REDUCE_GRAD, 0).seconds, "zeno_s": zeno}


@dataclass(frozen=True)
class Result:
    """Per run of :data:`RUNS`: the mean loss over the replicas per iteration (``None`` once diverged) and the
    measured mean REDUCE_GRAD (s); the simulated REDUCE_GRAD with the mean and with Zeno (``mean_s``, ``zeno_s``)."""

    curves: dict[str, list[float | None]]
    measured_reduce_s: dict[str, float]
    simulated: dict[str, float]

    def as_json(self) -> dict[str, Any]:
        """What ``zeno.json`` holds."""
        return {"curves": self.curves, "measured_reduce_s": self.measured_reduce_s, "simulated": self.simulated}


def parser() -> CliParser:
    """``python -m experiments.run zeno [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run zeno", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/zeno", help="output directory (default runs/zeno)")
    return parser


def run(*, out: Path) -> Result:
    """The plan simulated, the three runs measured (their directories written into ``out``), and the costs."""
    run_module("sim.run", "--topology", f"{REPLICAS}xcpu", "--model", MODEL, "--dp", str(REPLICAS), "--global-batch",
               str(2 * REPLICAS), "--no-gantt", "--out", str(out / "sim"))
    plan_path = out / "sim" / "plan.json"
    curves, measured = {}, {}
    for name, flags in RUNS.items():
        target = out / name.replace(", ", "-").replace(" ", "-").replace(":", "")
        run_module("executor.run", "--plan", str(plan_path), "--out", str(target), "--warmup", "0", "--iterations",
                   str(ITERATIONS), "--optimizer", "sgd", "--lr", LR, "--threads", "1", "--no-gantt", *flags)
        losses = json.loads((target / "metrics.json").read_text())["measurement"]["losses"]
        # A diverged run's NaN is written as null (JSON has no NaN).
        curves[name] = [value if math.isfinite(value) else None
                        for value in (sum(step) / len(step) for step in losses)]
        measured[name] = json.loads((target / "compare.json").read_text())["ops"]["REDUCE_GRAD"]["measured_mean_s"]
    plan = Plan.loads(plan_path.read_text())
    return Result(curves, measured, simulated_cost(plan))


def _plot(curves: dict[str, list[float | None]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.report.png import figure_png

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for (name, losses), colour in zip(curves.items(), ("#2ca02c", "#d62728", "#1f77b4"), strict=True):
        ax.plot(range(1, len(losses) + 1), [math.nan if v is None else v for v in losses], label=name, color=colour)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (mean over the global batch)")
    ax.set_title("4 data-parallel replicas, replica 3 sends -4x its gradient", fontsize=9)
    ax.grid(True, linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return figure_png(fig)


def report(result: Result) -> str:
    """Each run's first, last and lowest loss, then REDUCE_GRAD measured and simulated."""
    lines = [f"{REPLICAS} CPU replicas, {MODEL}, SGD lr {LR}, {ITERATIONS} iterations",
             "  run                      loss: first    last    min"]
    for name, losses in result.curves.items():
        finite = [value for value in losses if value is not None]
        last = f"{losses[-1]:7.3f}" if losses[-1] is not None else "diverged"
        lines.append(f"  {name:<24} {losses[0]:10.3f} {last:>7} {min(finite):6.3f}")
    measured, simulated = result.measured_reduce_s, result.simulated
    lines.append(f"REDUCE_GRAD per step, measured: mean {measured['one Byzantine, mean'] * 1e3:.2f} ms, zeno "
                 f"{measured['one Byzantine, zeno:1'] * 1e3:.2f} ms; simulated: mean {simulated['mean_s'] * 1e3:.3f} "
                 f"ms, zeno {simulated['zeno_s'] * 1e3:.3f} ms")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``zeno.json`` and ``zeno.png`` in ``out`` (beside the runs' directories)."""
    write_json_atomic(result.as_json(), out / "zeno.json")
    write_bytes_atomic(out / "zeno.png", _plot(result.curves))
    return [out / "zeno.json", out / "zeno.png"]
