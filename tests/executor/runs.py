"""Helpers shared by the executor tests that start real runs: a plan from ``sim.run``, ``executor.run`` in a process
of its own (forked from a zygote that has done the imports once), the saved stage states merged, and the equality
with single-process training."""

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor.interpreter import RankInterpreter
from executor.nn.optim import make_optimizer
from executor.nn.stages import boundary_specs, build_stage, loss_fn, synthetic_batch
from executor.reference import train_reference
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.run import main as sim_main
from tests.executor.zygote import run_executor

ROOT = Path(__file__).resolve().parents[2]
SPEC = "gpt:heads=2,hidden=32,layers=2,seq=8,vocab=50"  # 4 layers: embed, 2 blocks, head


def sim_plan(out: Path, ranks: int, m: int, *flags: str, model: str = SPEC) -> Path:
    """``sim.run`` on ``{ranks}xcpu`` with a uniform partition and no chart; ``flags`` add e.g. ``--schedule``."""
    assert sim_main(["--topology", f"{ranks}xcpu", "--model", model, "-m", str(m), "--partition", "uniform",
                     "--no-gantt", "--out", str(out), *flags]) == 0
    return out / "plan.json"


def execute(plan: Path, out: Path, *extra: str, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m executor.run --plan plan --out out *extra``, forked from this test process's zygote (a process that
    has imported torch and the executor once: ``tests/executor/zygote.py``) with ``env`` added to the environment;
    its result, whatever the status. Its output is captured beside ``out`` (``OUT.captured/``)."""
    return run_executor(["--plan", str(plan), "--out", str(out), *extra], {**os.environ, **(env or {})},
                        out.with_name(out.name + ".captured"), timeout)


def edited_plan(plan: Path, target: Path, edit: Callable[[dict], object]) -> Path:
    """A copy of the plan file at ``target`` after ``edit`` changed its JSON in place (to make a bad plan)."""
    data = json.loads(plan.read_text())
    edit(data)
    target.write_text(json.dumps(data))
    return target


def merged_state(state_dir: Path, num_vstages: int) -> dict[str, torch.Tensor]:
    """The parameters every vstage saved with ``--save-state``, as one state dict of the whole model."""
    merged: dict[str, torch.Tensor] = {}
    for v in range(num_vstages):
        merged.update(torch.load(state_dir / f"stage{v}.pt"))
    return merged


def assert_state_equals(merged: dict[str, torch.Tensor], reference_state: dict[str, torch.Tensor], *,
                        spec: str = SPEC, atol: float, rtol: float = 1e-5) -> None:
    """Every parameter equals the reference's within the tolerances, and training moved the weights more than 100
    times ``atol``, so that agreeing is not agreeing on nothing (the negative control)."""
    assert sorted(merged) == sorted(reference_state)
    for key, value in reference_state.items():
        torch.testing.assert_close(merged[key], value, rtol=rtol, atol=atol, msg=key)
    initial = train_reference(spec, steps=0, num_microbatches=1, microbatch_size=1).state
    moved = max((reference_state[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * atol, moved


def built_plan(schedule="1f1b", topology="1xcpu", m=3):
    """The lowered plan of :data:`SPEC`, built in this process (uniform partition)."""
    return build_plan(PlanInputs(model=SPEC, topology=topology, schedule=schedule, microbatches=m,
                                 partition="uniform")).plan


def run_single_rank(plan, steps, optimizer):
    """Run a one-rank plan in this process (no process group needed: it has no sends) for ``steps`` iterations on
    the seeded batches; returns the stage, the per-step losses and the last iteration's op records."""
    stage = build_stage(SPEC, 0, 4, seed=0)
    opt = make_optimizer(optimizer, stage.parameters())
    boundary = {0: boundary_specs(SPEC, [0], plan.microbatch_size)[0]}
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: opt}, loss_fn(SPEC), boundary)
    losses, records = [], None
    m = plan.num_microbatches
    for step in range(steps):
        batches = [synthetic_batch(SPEC, plan.microbatch_size, seed=0, index=step * m + j) for j in range(m)]
        records, step_losses = interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
        losses.append(tuple(step_losses))
    return stage, losses, records


def refused(capsys, plan: Path, out: Path, *extra: str) -> str:
    """Run ``executor.run`` on ``plan`` in-process and check it is refused before launch: exit status 2, one
    ``error:`` line, nothing written to ``out``; returns the line."""
    from executor.run import main as executor_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        executor_main(["--plan", str(plan), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    return err
