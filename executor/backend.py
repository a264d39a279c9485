"""Which process-group backend and devices a run uses, from the plan's devices and what torch sees here
(:func:`choose_backend`), and what those devices cannot do yet: a captured CUDA graph, a calibrated profile from
ranks on different devices. ``executor.run`` asks before anything starts."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.plan import Plan

__all__ = ["choose_backend", "planned_devices", "check_cuda_graphs", "check_calibration_device"]


def choose_backend(requested: str | None, planned_devices: Sequence[str], *, cuda_available: bool,
                   cuda_devices: int | None = None) -> tuple[str, str | None]:
    """The process-group backend for a plan, and a warning to show first (or ``None``).

    Pure: the caller says what torch sees. The plan's devices decide, not the host (DESIGN §7: gloo on CPU, NCCL on
    CUDA, one rank per GPU); a rank runs on CUDA exactly when the backend is nccl (``executor.rank_process``):

    - every rank planned on ``cpu``: gloo; nccl is refused.
    - a rank planned on a GPU, CUDA here: nccl, unless ``--backend gloo`` (which runs every rank on the CPU, with a
      warning). A plan that also has ``cpu`` ranks gets gloo (NCCL cannot serve them), with the same warning.
    - a rank planned on a GPU, no CUDA here: gloo on the CPU with a warning that the measurement describes this CPU,
      not the planned devices; this still checks a GPU plan's correctness (and losses) on any machine. nccl is
      refused.

    Args:
        requested: ``--backend``, or ``None`` for the default.
        planned_devices: the plan's device of each rank (catalog ids, ``topology.devices[r].name``).
        cuda_available: ``torch.cuda.is_available()``.
        cuda_devices: CUDA devices on this host, checked against the ranks when nccl is chosen for a launch on this
            host; ``None`` skips the check (ranks spread over hosts by the user's torchrun).

    Raises:
        SpecError: nccl asked for a plan with ``cpu`` ranks, or with no CUDA here, or too few CUDA devices.
    """
    cpu_ranks = [rank for rank, name in enumerate(planned_devices) if name == "cpu"]
    gpus = sorted({name for name in planned_devices if name != "cpu"})
    if requested == "nccl" and cpu_ranks:
        which = "every rank" if not gpus else f"rank(s) {', '.join(map(str, cpu_ranks))}"
        raise SpecError(f"--backend nccl: the plan puts {which} on cpu, and NCCL runs on CUDA devices only; "
                        f"use gloo (the default for cpu plans)")
    if not gpus:
        return "gloo", None
    on_cpu = (f"warning: the plan puts ranks on {', '.join(gpus)}, but every rank will run on this host's CPU with "
              f"gloo ({{why}}); the measurement describes this CPU, not the planned devices")
    if requested == "gloo":
        return "gloo", on_cpu.format(why="--backend gloo")
    if not cuda_available:
        if requested == "nccl":
            raise SpecError("--backend nccl needs CUDA, and torch sees no CUDA device here")
        return "gloo", on_cpu.format(why="torch sees no CUDA device here")
    if cpu_ranks:
        return "gloo", on_cpu.format(why=f"rank(s) {', '.join(map(str, cpu_ranks))} are planned on cpu, which NCCL "
                                         f"cannot serve")
    if cuda_devices is not None and cuda_devices < len(planned_devices):
        raise SpecError(f"the plan has {len(planned_devices)} ranks but this host has {cuda_devices} CUDA device(s) "
                        f"(one rank per GPU)")
    return "nccl", None


def planned_devices(plan: Plan, topology: Topology) -> list[str]:
    """The catalog device of each of the plan's processes, as ``choose_backend`` takes them."""
    # A slowed device (a topology file's slowdown:) runs on its catalog device; --slowdown emulates the rest.
    return [device.hardware.name for device in topology.devices[: plan.world_size]]


def check_cuda_graphs(plan: Plan, backend: str) -> None:
    """A plan simulated with ``--cuda-graphs`` (a captured step): its capture is not built here, since no machine of
    this project has had a GPU to build and test it on; on the CPU the step runs eagerly, as said."""
    if not plan.option("cuda_graphs", False):
        return
    if backend == "nccl":
        raise SpecError("the plan was simulated with --cuda-graphs, and executor.run cannot capture a step as a "
                        "CUDA graph yet (never built or tested on a GPU); simulate it without --cuda-graphs to "
                        "compare an eager run")
    print("warning: the plan was simulated with --cuda-graphs; on the CPU (gloo) its steps run eagerly, so the "
          "prediction's graph launches are not what is measured", file=sys.stderr)


def check_calibration_device(backend: str, num_ranks: int) -> None:
    """``--calibrate-out`` before a launch on this host: the ranks' devices must make one profile (``compare``)."""
    from executor.calibration import profile_device

    if backend == "gloo":
        names = ["cpu"] * num_ranks
    else:
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(num_ranks)]  # rank r runs on cuda:r
    profile_device(names)
