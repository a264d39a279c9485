"""Fitting the Grand Teton H100's unpublished ceilings on a seeded half of torchtitan's rows.

torchtitan's H100s are a 96 GB HBM2e part capped at 500 W, "the actual peak TFLOPs number ... between SXM and NVL",
and nobody publishes what its GEMMs and attention kernels reach. The catalog entry (``h100-sxm-96gb-hbm2e``) holds
three figures no source gives: the bf16 GEMM ceiling (``matmul_efficiency``), the FP8 one
(``fp8_matmul_efficiency``) and the attention kernel's (``attention_efficiency``), all as fractions of the SXM5's
peaks. They are fitted here, and only here, on a seeded half of the rows this experiment can model fully (nothing
unmodelled but the unpublished pipeline split, on this device): :func:`split_rows` shuffles those rows with the
seed and takes every other one. Every other row, the H200 rows and the rows with something unmodelled included, is
held out; ``python -m experiments.run torchtitan`` reports the halves apart.

The search is a coordinate descent on the mean |log(predicted / published)| of the fit half, each figure multiplied
by factors that shrink from ×/÷ 1.25 to ×/÷ 1.01, within (0.05, 1]. Every evaluation predicts the fit rows through
the one prediction path, on a topology whose devices of this model carry the trial figures
(``build_plan(inputs, topology)``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from sim.hw.topology import Topology

__all__ = ["DEVICE", "FIGURES", "split_rows", "with_figures", "fit_figures"]

#: The catalog device whose figures are fitted.
DEVICE = "h100-sxm-96gb-hbm2e"
#: The fitted figures, in the order of the search's coordinates.
FIGURES = ("matmul_efficiency", "fp8_matmul_efficiency", "attention_efficiency")


def split_rows(row_ids: Sequence[str], fittable: Sequence[bool], seed: int) -> list[str]:
    """``"fit"`` or ``"held-out"`` for each row: the fittable rows shuffled by ``seed``, every other one fit."""
    candidates = [row_id for row_id, ok in zip(row_ids, fittable, strict=True) if ok]
    order = sorted(candidates)
    random.Random(seed).shuffle(order)
    fit = set(order[0::2])
    return ["fit" if row_id in fit else "held-out" for row_id in row_ids]


def with_figures(topology: Topology, figures: dict[str, float]) -> Topology:
    """``topology`` with every :data:`DEVICE` carrying ``figures`` (the other devices unchanged)."""
    devices = tuple(replace(device, **figures) if device.name == DEVICE else device for device in topology.devices)
    return replace(topology, devices=devices)


def fit_figures(objective: Callable[[dict[str, float]], float], start: dict[str, float],
                progress: Callable[[dict[str, float], float], None] | None = None) -> tuple[dict[str, float], float]:
    """The figures that minimise ``objective`` (module docstring's coordinate descent from ``start``), and its value."""
    best, value = dict(start), objective(start)
    for step in (1.25, 1.1, 1.03, 1.01):
        improved = True
        while improved:
            improved = False
            for name in FIGURES:
                for factor in (step, 1 / step):
                    trial = dict(best)
                    trial[name] = min(1.0, max(0.05, best[name] * factor))
                    if trial[name] == best[name]:
                        continue
                    score = objective(trial)
                    if score < value - 1e-12:
                        best, value, improved = trial, score, True
                        if progress is not None:
                            progress(best, value)
    return best, value


def log_error(predicted: float, published: float) -> float:
    """|log(predicted / published)|: a symmetric relative error."""
    return abs(math.log(predicted / published))
