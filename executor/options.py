"""What a run is asked to do besides the plan: the options every rank receives, and the facts of this host they
depend on (how many cores a rank may use).

``executor.run`` builds :class:`RunOptions` from its command line and hands the same object to every worker, so a
rank never parses flags of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["RunOptions", "FAILURE_DIR_ENV", "host_cores"]

#: Environment variable naming the directory where a failing rank records its error for the launcher.
FAILURE_DIR_ENV = "PIPEDEJAVU_FAILURE_DIR"


@dataclass(frozen=True)
class RunOptions:
    """Everything a rank needs besides the plan; built from the command line by ``executor.run``.

    Attributes:
        plan_path: the plan JSON.
        out: output directory (rank 0 writes into it).
        iterations: measured iterations after warm-up, >= 1.
        warmup: iterations run first and left out of the measurement (they still train).
        backend: ``"gloo"`` or ``"nccl"``.
        threads: intra-op threads per rank (``None``: this host's cores divided by the ranks on it).
        seed: parameter seed.
        data_seed: synthetic data seed.
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: learning rate (``None``: the optimizer's default).
        profile: profile JSON for the prediction (``None``: the plan's own, else roofline).
        calibrate_out: where to write a calibrated profile, or ``None``.
        save_state: directory for each stage's final ``state_dict`` (``stage<v>.pt``), or ``None``.
        inject_failure: ``(rank, op id)`` at which to raise a test failure, or ``None``.
        gantt: draw ``gantt.png``.
        timeout_s: collective and point-to-point timeout, s.
        slowdown: ``(rank, factor)`` pairs, by rank: each of these ranks stretches its compute ops by its factor,
            to emulate a slower device (``--slowdown``, ``executor.slowdown``); empty for a real run.
        measure_memory: count each CPU rank's peak tensor memory (``--measure-memory``, ``executor.memory``); it
            slows every operator a little, so it is off unless asked for. CUDA ranks always report theirs.
        checkpoint_every: write a checkpoint after every this many iterations (``executor.checkpoint``; 0: never).
        checkpoint_dir: where checkpoints go, or ``None``.
        resume_from: the step directory of the complete checkpoint to continue from (``--resume``), or ``None``.
        first_iteration: the iteration this run starts at (the checkpoint's; 0 for a fresh run). ``warmup`` and
            ``iterations`` count from it: a resumed run's are what is left of the original run's.
        identity: what a checkpoint records of the run (``executor.checkpoint.run_identity``).
        die_in_checkpoint: ``(rank, iteration)`` at whose checkpoint write that rank kills itself midway (the
            torn-checkpoint test's ``--inject-failure RANK:checkpoint@ITERATION``), or ``None``.
        max_restarts: times the group is restarted after a rank dies (``--max-restarts``, ``executor.restart``).
        fail: ``(rank, iteration)``: that rank kills itself before that iteration on the first attempt
            (``--fail``), or ``None``.
        attempt: which attempt this is (0 first; set by a restarted worker, ``executor.restart.after_restart``).
        restarts: on rank 0 of a restarted attempt, what ``metrics.json`` says of the restarts (``None`` otherwise).
        aggregate: how the data-parallel gradients combine: ``mean``, or Zeno's ``zeno:B[:RHO]`` (``executor.zeno``).
        byzantine: ``(replica, mode, strength)`` of each data-parallel replica that sends corrupted gradients
            (``executor.byzantine``).
    """

    plan_path: str
    out: str
    iterations: int = 5
    warmup: int = 2
    backend: str = "gloo"
    threads: int | None = None
    seed: int = 0
    data_seed: int = 0
    optimizer: str = "adam"
    lr: float | None = None
    profile: str | None = None
    calibrate_out: str | None = None
    save_state: str | None = None
    inject_failure: tuple[int, str] | None = None
    gantt: bool = True
    timeout_s: float = 300.0
    slowdown: tuple[tuple[int, float], ...] = ()
    measure_memory: bool = False
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    first_iteration: int = 0
    identity: tuple[tuple[str, Any], ...] = ()
    die_in_checkpoint: tuple[int, int] | None = None
    max_restarts: int = 0
    fail: tuple[int, int] | None = None
    attempt: int = 0
    restarts: dict[str, Any] | None = None
    aggregate: str = "mean"
    byzantine: tuple[tuple[int, str, float], ...] = ()

    def slowdown_of(self, rank: int) -> float:
        """The factor by which ``rank`` stretches its compute ops (1 when it is not slowed)."""
        return dict(self.slowdown).get(rank, 1.0)


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
