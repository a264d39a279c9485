"""A straggler and a crash, measured on CPU ranks and predicted (``python -m experiments.run faults_real``).

On this host with 2 CPU ranks (topology ``2xcpu``, gloo), a 1F1B plan of ``gpt:layers=4,hidden=256,heads=4,seq=128,
vocab=1000`` with 6 microbatches:

1. **Calibrate** (as ``experiments.sim_vs_real`` does): run the plan with ``executor.run --calibrate-out``; its
   per-stage medians and point-to-point fit are the profile every prediction below uses.
2. **Straggler**, twice: ``executor.run --slowdown 1:2`` (rank 1 sleeps after each compute op as long again) against
   ``sim.run --straggler 1:2 --profile`` (``sim.engine.perturbation``): the measured median iteration against the
   predicted one.
3. **Crash and restart**, twice: ``executor.run`` for 16 iterations with a checkpoint every 4, rank 1 killed before
   iteration 10 (``--fail 1@10``) and ``--max-restarts 1``: the run's wall time, from the first iteration to the end
   of the last checkpoint, as ``metrics.json``'s ``restarts`` measures it, against the long run of
   ``sim.faults.long_run`` with the calibrated iteration time, the failure at the same point (``ScriptedFailures``),
   and the checkpoint and restart costs that run measured (as the issue asks: the prediction is of the run's
   structure, the iterations lost and done again, the costs it cannot know are the run's own). A new process's first
   iteration is slower than the rest: the restart's measured cost includes that excess (it is the restart's), and the
   run's wall time counts its very first iteration at the median's pace (start-up, not training;
   ``executor.restart.restart_record``).

Target: each within 10 % of the measured time.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.sim_vs_real import run_module
from sim.core.cli import CliParser
from sim.core.fileio import write_json_atomic
from sim.faults.checkpoint import CheckpointCost
from sim.faults.failure_mix import FailureCause, FailureMix
from sim.faults.long_run import LongRun, ScriptedFailures, simulate_long_run

__all__ = ["MODEL", "TARGET", "Result", "predict_crash", "parser", "run", "report", "write"]

MODEL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"
MICROBATCHES = 6
#: The largest |error| the issue accepts.
TARGET = 0.10
ITERATIONS, EVERY, FAIL_RANK, FAIL_AT = 16, 4, 1, 10
SLOWDOWN = "1:2"


def _simulate(out: Path, *flags: str) -> dict[str, Any]:
    run_module("sim.run", "--topology", "2xcpu", "--model", MODEL, "-m", str(MICROBATCHES), "--partition",
               "balanced", "--no-gantt", "--out", str(out), *flags)
    return json.loads((out / "metrics.json").read_text())


def predict_crash(iteration_s: float, checkpoint_s: float, restart_s: float) -> float:
    """The predicted wall time (s) of the crash case: :data:`ITERATIONS` iterations of ``iteration_s``, a checkpoint
    of ``checkpoint_s`` after every :data:`EVERY`, the failure before iteration :data:`FAIL_AT` (after its
    checkpoints), a restart of ``restart_s`` from the newest checkpoint."""
    run = LongRun(iteration_s, ITERATIONS, EVERY, CheckpointCost(0, checkpoint_s, 0.0, 0.0), 1e18, restart_s,
                  FailureMix("crash", (FailureCause("--fail", "injected", 1),)))
    failure_at = FAIL_AT * iteration_s + (FAIL_AT // EVERY) * checkpoint_s
    return simulate_long_run(run, ScriptedFailures([failure_at])).wall_s


@dataclass(frozen=True)
class Result:
    """The calibrated prediction of one iteration (s); per case and round the measured and predicted times (s), the
    error (predicted / measured − 1) and, for a crash, the restart and checkpoint it measured (s); whether every case
    is within :data:`TARGET`."""

    iteration_predicted_s: float
    cases: tuple[dict[str, Any], ...]
    target: float
    within_target: bool

    def as_json(self) -> dict[str, Any]:
        """What ``faults_real.json`` holds."""
        return {"iteration_predicted_s": self.iteration_predicted_s, "cases": list(self.cases),
                "target": self.target, "within_target": self.within_target}


def parser() -> CliParser:
    """``python -m experiments.run faults_real [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run faults_real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/faults_real", help="output directory (default runs/faults_real)")
    return parser


def run(*, out: Path, rounds: int = 2) -> Result:
    """Calibrate, then measure and predict each case ``rounds`` times; every run's directory is written into
    ``out``."""
    plan = out / "sim"
    _simulate(plan)
    profile = out / "calibration.json"
    run_module("executor.run", "--plan", str(plan / "plan.json"), "--out", str(out / "calibration-run"),
               "--iterations", "10", "--warmup", "2", "--calibrate-out", str(profile), "--no-gantt")
    predicted_s = _simulate(out / "predicted", "--profile", str(profile))["iteration_time_s"]
    straggled_s = _simulate(out / "straggler", "--profile", str(profile), "--straggler", SLOWDOWN)["iteration_time_s"]
    cases: list[dict[str, Any]] = []
    for round_ in range(rounds):
        slowed = out / f"slowdown-{round_}"
        run_module("executor.run", "--plan", str(plan / "plan.json"), "--out", str(slowed), "--iterations", "8",
                   "--warmup", "2", "--slowdown", SLOWDOWN, "--no-gantt")
        measured = json.loads((slowed / "metrics.json").read_text())["iteration_time_s"]
        cases.append({"case": "straggler", "round": round_, "measured_s": measured, "predicted_s": straggled_s})
        crashed, checkpoints = out / f"crash-{round_}", out / f"checkpoints-{round_}"
        shutil.rmtree(checkpoints, ignore_errors=True)  # a fresh run with restarts wants an empty folder
        run_module("executor.run", "--plan", str(plan / "plan.json"), "--out", str(crashed), "--iterations",
                   str(ITERATIONS), "--warmup", "0", "--checkpoint-every", str(EVERY), "--checkpoint-dir",
                   str(checkpoints), "--max-restarts", "1", "--fail", f"{FAIL_RANK}@{FAIL_AT}",
                   "--no-gantt")
        restarts = json.loads((crashed / "metrics.json").read_text())["restarts"]
        predicted = predict_crash(predicted_s, restarts["checkpoint_mean_s"], restarts["restart_s"])
        cases.append({"case": "crash", "round": round_, "measured_s": restarts["run_wall_s"], "predicted_s": predicted,
                      "restart_s": restarts["restart_s"], "checkpoint_s": restarts["checkpoint_mean_s"]})
    for case in cases:
        case["error"] = case["predicted_s"] / case["measured_s"] - 1
    return Result(predicted_s, tuple(cases), TARGET, all(abs(c["error"]) <= TARGET for c in cases))


def report(result: Result) -> str:
    """Each case and round, measured against predicted, and the verdict."""
    lines = [f"2 CPU ranks, 1F1B, {MODEL}, m={MICROBATCHES}; predictions from the calibrated profile "
             f"(iteration {result.iteration_predicted_s * 1e3:.1f} ms)",
             "  case       round  measured     predicted    error"]
    for case in result.cases:
        crash = (f"   (restart {case['restart_s']:.2f} s, checkpoint {case['checkpoint_s'] * 1e3:.0f} ms, measured)"
                 if case["case"] == "crash" else "")
        lines.append(f"  {case['case']:<9}  {case['round']:>5}  {case['measured_s']:>9.3f} s  "
                     f"{case['predicted_s']:>9.3f} s  {case['error']:+6.1%}{crash}")
    lines.append(f"target: every case within {TARGET:.0%}: {'met' if result.within_target else 'not met'}")
    return "\n".join(lines)


def write(result: Result, out: Path) -> list[Path]:
    """``faults_real.json`` in ``out`` (beside the runs' directories)."""
    write_json_atomic(result.as_json(), out / "faults_real.json")
    return [out / "faults_real.json"]
