"""Fitting the GPU kernel model's software constants on the fit half of the vTrain runs, so that the other half can test
them.

The free parameters are the seven software constants of :class:`sim.cost.gpu_time.KernelModel` that describe a
framework, cuBLAS and NCCL rather than a device (the host's time to issue a kernel and an NCCL call, the GPU's gap
between kernels, the achieved fraction of memory bandwidth, a GEMM tile's fixed K-steps, the optimizer step's and
the microbatch's framework overheads); the GEMM tile edge is not fitted. Every device number stays the catalog's, so
what is fitted here carries to other GPUs.

Only runs of the ``fit`` half are ever predicted here: a seeded sample of them (``sample`` runs, for speed: each
evaluation predicts every sampled run through the product's one prediction path). The objective is the mean
|error| plus a tenth of the largest, so that no configuration is sacrificed for the average. It is minimised by
Nelder-Mead (Nelder & Mead 1965; the standard reflection 1, expansion 2, contraction and shrink ½) over the
logarithms of the constants, which keeps them positive and treats µs and ms alike; ``memory_efficiency`` is
capped at 1.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from sim.cost.gpu_time import KernelModel

__all__ = ["FITTED", "FIT_START", "fit_kernel_model", "nelder_mead", "kernel_model_yaml"]

#: Where the search starts, whatever the shipped constants are, so that a fit is reproducible: round figures of the
#: right order (a Python op issuing a kernel takes tens of µs; a GPU launch gap a few µs; HBM kernels reach 80 % of
#: peak; a GEMM's epilogue is worth a few tens of K-steps; framework overheads of milliseconds).
FIT_START = {"host_issue_s": 20e-6, "host_collective_s": 20e-6, "kernel_gap_s": 2e-6, "memory_efficiency": 0.8,
             "gemm_k_overhead": 64.0, "step_overhead_s": 5e-3, "microbatch_overhead_s": 1e-3}

#: The constants that are fitted, in the order of the search vector.
FITTED = ("host_issue_s", "host_collective_s", "kernel_gap_s", "memory_efficiency", "gemm_k_overhead",
          "step_overhead_s", "microbatch_overhead_s")


def _along(centre: Sequence[float], worst: Sequence[float], scale: float) -> list[float]:
    """The point ``centre + scale · (centre − worst)`` (reflection 1, expansion 2, inside contraction −½)."""
    return [c + scale * (c - w) for c, w in zip(centre, worst)]


def nelder_mead(objective: Callable[[list[float]], float], start: Sequence[float], step: float,
                iterations: int) -> tuple[list[float], float]:
    """Minimise ``objective`` from ``start`` with an initial simplex of ``step`` along each axis; the best point
    and its value after ``iterations`` iterations (deterministic: no randomness)."""
    n = len(start)
    points = [list(start)] + [[x + (step if i == j else 0.0) for j, x in enumerate(start)] for i in range(n)]
    values = [objective(p) for p in points]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        points, values = [points[i] for i in order], [values[i] for i in order]
        centre = [sum(p[j] for p in points[:-1]) / n for j in range(n)]
        worst = points[-1]
        toward = partial(_along, centre, worst)
        reflected = toward(1.0)
        value = objective(reflected)
        if value < values[0]:
            expanded = toward(2.0)
            expanded_value = objective(expanded)
            points[-1], values[-1] = (expanded, expanded_value) if expanded_value < value else (reflected, value)
        elif value < values[-2]:
            points[-1], values[-1] = reflected, value
        else:
            contracted = toward(-0.5)
            contracted_value = objective(contracted)
            if contracted_value < values[-1]:
                points[-1], values[-1] = contracted, contracted_value
            else:
                for i in range(1, n + 1):
                    points[i] = [points[0][j] + 0.5 * (points[i][j] - points[0][j]) for j in range(n)]
                    values[i] = objective(points[i])
    best = min(range(n + 1), key=values.__getitem__)
    return points[best], values[best]


def _model_at(base: KernelModel, vector: Sequence[float]) -> KernelModel:
    values = {name: math.exp(x) for name, x in zip(FITTED, vector)}
    values["memory_efficiency"] = min(1.0, values["memory_efficiency"])
    return replace(base, **values)


def fit_kernel_model(runs: Sequence, halves: Sequence[str], predict: Callable[[object, KernelModel], float],
                     base: KernelModel, *, seed: int, sample: int = 240, iterations: int = 320,
                     progress: Callable[[int, float], None] | None = None) -> tuple[KernelModel, float, int]:
    """Fit :data:`FITTED` on a seeded sample of the fit half; ``(model, objective, runs used)``.

    Args:
        runs: every run; ``halves[i]`` says whether run i is ``fit`` or ``held-out`` (only fit runs are used).
        predict: ``predict(run, model)`` → predicted iteration time, s.
        base: the unfitted constants (the search starts from :data:`FIT_START`).
        seed: seed of the sample.
        sample: fit runs predicted per evaluation.
        iterations: Nelder-Mead iterations.
        progress: called with (evaluations so far, best objective) after each evaluation.
    """
    fit_runs = [run for run, half in zip(runs, halves) if half == "fit"]
    chosen = random.Random(seed).sample(fit_runs, min(sample, len(fit_runs)))
    best = [math.inf]
    calls = [0]

    def objective(vector: list[float]) -> float:
        model = _model_at(base, vector)
        errors = [abs(predict(run, model) / run.measured_s - 1) for run in chosen]
        value = statistics.fmean(errors) + 0.1 * max(errors)
        calls[0] += 1
        best[0] = min(best[0], value)
        if progress is not None:
            progress(calls[0], best[0])
        return value

    start = [math.log(FIT_START[name]) for name in FITTED]
    vector, value = nelder_mead(objective, start, 0.4, iterations)
    return _model_at(base, vector), value, len(chosen)


def kernel_model_yaml(model: KernelModel, note: str) -> str:
    """The ``profiles/hardware/kernel_model.yaml`` document for ``model``, with ``note`` as its source."""
    lines = ["# Software constants of the kernel-level GPU cost model (sim/cost/gpu_time.py): what a framework (eager",
             "# PyTorch, Megatron-DeepSpeed), cuBLAS and NCCL add to the catalog's device numbers. They describe",
             "# software, not a device: the model carries to another GPU through devices.yaml alone.",
             "# Written by `python -m experiments.run vtrain --fit` (experiments/vtrain_fit.py), which fits them on",
             "# the fit half of the seeded split only; copy its OUT/kernel_model.yaml here to adopt a new fit.",
             "", "kernel_model:"]
    for name in ("host_issue_s", "host_collective_s", "kernel_gap_s", "memory_efficiency", "gemm_k_overhead",
                 "gemm_tile", "step_overhead_s", "microbatch_overhead_s"):
        value = getattr(model, name)
        lines.append(f"  {name}: {value if name == 'gemm_tile' else float(f'{value:.4g}')!r}")
    lines.append("  source: >-")
    lines.append(f"    {note}")
    return "\n".join(lines) + "\n"
