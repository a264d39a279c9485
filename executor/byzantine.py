"""Byzantine data-parallel replicas: a replica that sends corrupted gradients (``executor.run --byzantine RANK:MODE``),
to test what an aggregation rule survives (``executor.zeno``).

The replica computes its gradient honestly, then sends in its place one of the two kinds of faulty gradient Byzantine
tolerance is usually tested with (as in the Zeno paper, Xie, Koyejo and Gupta, ICML 2019, arXiv 1805.10032):

* ``sign-flip[:S]``: −S times its gradient (S = 4 unless given [assumed]): a step along it climbs the loss;
* ``noise[:SIGMA]``: Gaussian noise of standard deviation SIGMA (1 unless given) in every element, drawn from a
  generator seeded by the rank and the iteration, so a rerun corrupts alike.

Every other replica stays honest. A corrupted replica still applies the aggregate it receives, so the replicas keep
one set of weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from executor.nn.seeds import derive_seed
from sim.core.errors import SpecError

__all__ = ["MODES", "Byzantine", "parse_byzantine", "corrupt"]

#: The attacks and their default strength.
MODES = {"sign-flip": 4.0, "noise": 1.0}


@dataclass(frozen=True)
class Byzantine:
    """One corrupted replica.

    Attributes:
        rank: its data-parallel rank (its position in the data-parallel group).
        mode: one of :data:`MODES`.
        strength: S of ``sign-flip``, SIGMA of ``noise``.
    """

    rank: int
    mode: str
    strength: float

    def describe(self) -> str:
        return f"replica {self.rank} sends {self.mode} ({self.strength:g})"


def parse_byzantine(text: str, replicas: int) -> Byzantine:
    """``RANK:MODE`` or ``RANK:MODE:STRENGTH`` as a :class:`Byzantine`.

    Raises:
        SpecError: another spelling, a replica outside ``0..replicas-1``, an unknown mode, a strength that is not a
            finite number > 0 (each message names the value and what would be valid).
    """
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        raise SpecError(f"--byzantine takes RANK:MODE or RANK:MODE:STRENGTH, modes {', '.join(MODES)}; got {text!r}")
    rank, mode = int(parts[0]), parts[1]
    if mode not in MODES:
        raise SpecError(f"--byzantine {text!r}: mode must be one of {', '.join(MODES)}")
    if not rank < replicas:
        raise SpecError(f"--byzantine {text!r}: the data-parallel replica must be 0..{replicas - 1}")
    try:
        strength = float(parts[2]) if len(parts) == 3 else MODES[mode]
    except ValueError:
        strength = math.nan
    if not math.isfinite(strength) or strength <= 0:
        raise SpecError(f"--byzantine {text!r}: the strength must be a finite number > 0")
    return Byzantine(rank, mode, strength)


def corrupt(gradient: Tensor, byzantine: Byzantine, iteration: int) -> Tensor:
    """What the Byzantine replica sends instead of ``gradient`` (a new tensor) in ``iteration``."""
    if byzantine.mode == "sign-flip":
        return gradient * -byzantine.strength
    generator = torch.Generator(device="cpu").manual_seed(derive_seed(f"byzantine-{byzantine.rank}", 0, iteration))
    noise = torch.randn(gradient.shape, generator=generator, dtype=gradient.dtype)
    return (noise * byzantine.strength).to(gradient.device)
