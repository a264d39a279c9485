"""Checkpoints of a run and resuming from them (``executor.run --checkpoint-every K --checkpoint-dir DIR``,
``--resume DIR``).

After every K-th iteration (counting from the run's first, warm-up included) each process writes its shard of the
training state, and the run can later continue from the newest complete checkpoint up to the same total of
iterations, ending with parameters bitwise equal to a run that was never interrupted.

What a shard holds (:func:`capture`): the process's vstages' parameters (under ZeRO-3 the unit shards the optimizer
owns, which are the parameters), every vstage optimizer's state (Adam's moments and step counts; a ZeRO slice's
values), torch's global RNG states, and the iteration to run next, which is also the data position: a process's
microbatches are a pure function of the data seed and the iteration (``executor.parallel.microbatch_index``,
``executor.partime.video``), and the pipeline drains at every iteration's end, so nothing else carries over.

Layout and atomicity::

    DIR/step-000000012/rank-00000.pt     each process's shard, written to a temporary file and renamed
    DIR/step-000000012/COMPLETE.json     written by process 0, atomically, once every shard is in place

A step directory counts only with its ``COMPLETE.json``: a process killed while writing leaves at most a temporary
file and no marker, and the previous checkpoint stays whole and is the one a resume finds. Older complete
checkpoints than the newest :data:`KEEP` are removed after a new one completes.

The marker records what must agree for the continuation to be the same run (:func:`run_identity`): the plan (its
digest), the processes, the parameter and data seeds, the optimizer and learning rate; a resume with another is
refused before launch.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sim.core.errors import SpecError
from sim.core.fileio import read_text, write_bytes_atomic, write_text_atomic

__all__ = ["KEEP", "Checkpoint", "run_identity", "capture", "restore", "write_shard", "complete", "latest",
           "read_shard", "step_dir"]

#: Complete checkpoints kept: the newest and the one before it (so one is always whole while the next is written).
KEEP = 2
_MARKER = "COMPLETE.json"


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk.

    Attributes:
        path: its step directory.
        iteration: the iteration it resumes at (iterations done).
        identity: what it was written by (:func:`run_identity`).
    """

    path: Path
    iteration: int
    identity: dict[str, Any]


def run_identity(plan_text: str, *, world_size: int, seed: int, data_seed: int, optimizer: str,
                 lr: float | None) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint (module docstring)."""
    return {"plan_sha256": hashlib.sha256(plan_text.encode()).hexdigest(), "world_size": world_size, "seed": seed,
            "data_seed": data_seed, "optimizer": optimizer, "lr": lr}


def step_dir(directory: str | Path, iteration: int) -> Path:
    """The step directory of the checkpoint taken after ``iteration`` iterations."""
    return Path(directory) / f"step-{iteration:09d}"


def capture(stages: Mapping[int, torch.nn.Module], optimizers: Mapping[int, Any], *, fully_sharded: bool,
            next_iteration: int) -> dict[str, Any]:
    """One process's training state (module docstring); tensors are copied to the CPU."""
    state: dict[str, Any] = {"next_iteration": next_iteration, "rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    if not fully_sharded:  # under ZeRO-3 the parameters are the optimizer's shards, saved with it
        state["stages"] = {v: {key: tensor.detach().cpu().clone() for key, tensor in stage.state_dict().items()}
                           for v, stage in stages.items()}
    state["optimizers"] = {v: optimizer.state_dict() for v, optimizer in optimizers.items()}
    return state


def restore(stages: Mapping[int, torch.nn.Module], optimizers: Mapping[int, Any], state: Mapping[str, Any], *,
            fully_sharded: bool) -> int:
    """Put ``state`` (from :func:`capture`) back into the process; returns the iteration to run next.

    Raises:
        SpecError: a shard for other vstages than this process runs.
    """
    saved = set(state["optimizers"])
    if saved != set(optimizers):
        raise SpecError(f"the checkpoint's shard holds vstages {sorted(saved)}, this process runs "
                        f"{sorted(optimizers)}")
    if not fully_sharded:
        for v, stage in stages.items():
            stage.load_state_dict(state["stages"][v])
    for v, optimizer in optimizers.items():
        optimizer.load_state_dict(state["optimizers"][v])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["next_iteration"])


def _serialised(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def write_shard(directory: str | Path, iteration: int, rank: int, state: Mapping[str, Any], *,
                die_midway: bool = False) -> None:
    """Write process ``rank``'s shard of the checkpoint after ``iteration`` iterations, atomically. ``die_midway``
    (``--inject-failure RANK:checkpoint@ITERATION``, for the torn-checkpoint test) kills the process with SIGKILL
    after half the bytes, as a crash would."""
    target = step_dir(directory, iteration)
    target.mkdir(parents=True, exist_ok=True)
    data = _serialised(state)

    def chunks() -> Iterator[bytes]:
        half = len(data) // 2
        yield data[:half]
        if die_midway:
            os.kill(os.getpid(), signal.SIGKILL)
        yield data[half:]

    write_bytes_atomic(target / f"rank-{rank:05d}.pt", chunks())


def complete(directory: str | Path, iteration: int, identity: Mapping[str, Any]) -> None:
    """Mark the checkpoint after ``iteration`` complete (process 0, once every shard is written) and remove complete
    checkpoints older than the newest :data:`KEEP` (and any torn step directory older than the newest)."""
    write_text_atomic(json.dumps({"iteration": iteration, **identity}, sort_keys=True) + "\n",
                      step_dir(directory, iteration) / _MARKER)
    steps = sorted(Path(directory).glob("step-*"))
    kept = [step for step in steps if (step / _MARKER).is_file()][-KEEP:]
    for step in steps:
        if step not in kept and step.name < kept[-1].name:
            shutil.rmtree(step, ignore_errors=True)


def latest(directory: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory``, or ``None`` when there is none.

    Raises:
        SpecError: a marker that is not the JSON this module writes.
    """
    for step in sorted(Path(directory).glob("step-*"), reverse=True):
        marker = step / _MARKER
        if not marker.is_file():
            continue  # torn: a process died before every shard was written
        try:
            data = json.loads(read_text(marker, "checkpoint marker"))
            iteration = int(data.pop("iteration"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SpecError(f"checkpoint marker {marker} is not one executor.run wrote") from None
        return Checkpoint(step, iteration, data)
    return None


def read_shard(step: str | Path, rank: int) -> dict[str, Any]:
    """Process ``rank``'s shard of the checkpoint in step directory ``step``.

    Raises:
        SpecError: the shard is missing.
    """
    path = Path(step) / f"rank-{rank:05d}.pt"
    if not path.is_file():
        raise SpecError(f"checkpoint {step} has no shard for rank {rank} ({path.name})")
    return torch.load(path, map_location="cpu", weights_only=True)
