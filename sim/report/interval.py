"""An interval on every prediction: split conformal, per regime, from the residuals of published runs (issue #40).

A prediction alone cannot say how far to trust it. Each published run this project predicts
(``experiments/data``: vTrain's A100 runs, torchtitan's H100/H200 runs, Megatron-Bridge's Hopper and Blackwell runs)
leaves a residual, ``log(published time / predicted time)``; ``python -m experiments.run coverage --write`` stores them
in :data:`RESIDUALS`, each with the *regime* of its plan (:class:`Regime`: device generation, model family,
precision, the parallel dimensions in use, scale). A new plan's interval comes from the residuals of the runs that
share its regime: split conformal prediction (Vovk et al. 2005; Lei et al. 2018, "Distribution-free predictive
inference for regression", §2.2), which under exchangeability of the plan with those runs covers the truth with
probability at least the level, whatever the error distribution. With n residuals sorted, the two-sided interval at
level 1 - a takes the floor((n + 1) a / 2)-th smallest and the ceil((n + 1)(1 - a / 2))-th smallest (finite from
:data:`MIN_RUNS` = 19 residuals at 90 %), and the measured time lies in
``[predicted x exp(low residual), predicted x exp(high residual)]``.

Regimes are matched on every feature first; where fewer than :data:`MIN_RUNS` published runs share them all, the
least telling features are dropped one at a time (scale, then the parallel dimensions, then precision, then the
family, then the generation), and the interval says which ones: such a plan is *outside the validated regimes* along
those dimensions, and its interval is only as good as the wider pool's. ``python -m experiments.run coverage``
measures what the intervals are worth: it calibrates on a seeded half of every data set and counts how often the
held-out half's published figures fall inside.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

from sim.core.errors import SpecError

__all__ = ["LEVEL", "MIN_RUNS", "RESIDUALS", "FEATURES", "Regime", "Residual", "Calibration",
           "conformal_bounds", "calibrate", "load_residuals", "shipped_residuals", "regime", "write_residuals",
           "CalibrationIndex", "shipped_index"]

#: The coverage every interval aims at.
LEVEL = 0.9
#: The fewest residuals a two-sided split-conformal interval at :data:`LEVEL` is finite with:
#: ceil((n + 1)(1 - (1 - LEVEL) / 2)) <= n from n = 19.
MIN_RUNS = 19
#: The residuals the tool ships, written by ``python -m experiments.run coverage --write``.
RESIDUALS = Path(__file__).resolve().parents[2] / "profiles" / "calibration" / "residuals.csv"
#: A regime's features, the most telling first: they are dropped from the last when too few runs share them all.
FEATURES = ("generation", "family", "precision", "dims", "scale")

#: Each catalog device's generation, by the prefix of its name (the catalog, ``profiles/hardware/devices.yaml``).
_GENERATIONS = (("v100", "volta"), ("p100", "pascal"), ("t4", "turing"), ("a100", "ampere"), ("a10", "ampere"),
                ("rtx3090", "ampere"), ("rtx4090", "ada"), ("l40s", "ada"), ("h100", "hopper"), ("h800", "hopper"),
                ("h200", "hopper"), ("gh200", "hopper"), ("b200", "blackwell"), ("b300", "blackwell"),
                ("gb200", "blackwell"), ("gb300", "blackwell"), ("mi300x", "cdna3"), ("tpu", "tpu"), ("cpu", "cpu"))
#: The precision classes of ``--precision`` (the model's own: 16-bit for every transformer family).
_PRECISION_CLASSES = {"fp32": "fp32", "fp16": "16-bit", "bf16": "16-bit", "fp8": "fp8", "fp8-rowwise": "fp8",
                      "mxfp8": "fp8", "nvfp4": "fp4"}
#: Upper ends of the scale classes, devices.
_SCALES = ((8, "1-8"), (64, "9-64"), (512, "65-512"))


@dataclass(frozen=True, order=True)
class Regime:
    """What kind of run a plan is, for matching it with published runs (module docstring).

    Attributes:
        generation: the devices' generation (``ampere``, ``hopper``, ``blackwell``, ...; ``mixed`` for several).
        family: the model family (``gpt``, ``llama``, ``moe``, ...).
        precision: ``16-bit``, ``fp8``, ``fp4`` or ``fp32``.
        dims: the parallel dimensions in use, ``+``-joined in a fixed order (``tp+pp+dp``, ``fsdp``), or ``none``.
        scale: the devices the plan runs on, in classes: ``1-8``, ``9-64``, ``65-512``, ``513+``.
    """

    generation: str
    family: str
    precision: str
    dims: str
    scale: str

    def describe(self, names: Sequence[str] = FEATURES) -> str:
        """``feature value`` for each feature in ``names``, comma-separated."""
        return ", ".join(f"{name} {getattr(self, name)}" for name in names)


def _generation(device: str) -> str:
    for prefix, generation in _GENERATIONS:
        if device.startswith(prefix):
            return generation
    return device


def regime(devices: Sequence[str], family: str, precision: str, degrees: Mapping[str, int], zero: int) -> Regime:
    """The regime of a plan on the catalog ``devices`` (one name per device it runs on), of a model of ``family``,
    in ``precision`` (a ``--precision`` value), with parallel ``degrees`` (``tp``, ``cp``, ``ep``, ``pp``, ``dp``;
    absent: 1) and ZeRO stage ``zero``."""
    generations = sorted({_generation(name) for name in set(devices)})  # a cluster has few distinct devices
    dims = [name for name in ("tp", "cp", "ep", "pp") if degrees.get(name, 1) > 1]
    if degrees.get("dp", 1) > 1:
        dims.append("fsdp" if zero == 3 else "dp")
    scale = next((label for top, label in _SCALES if len(devices) <= top), "513+")
    return Regime(generations[0] if len(generations) == 1 else "mixed", family,
                  _PRECISION_CLASSES.get(precision, precision), "+".join(dims) or "none", scale)


@dataclass(frozen=True)
class Residual:
    """One published run's residual: its data set, its id there, its plan's regime and
    ``log(published time / predicted time)``."""

    dataset: str
    run: str
    regime: Regime
    log_ratio: float


@dataclass(frozen=True)
class Calibration:
    """How a regime's predictions err: the conformal bounds of ``log(measured / predicted time)`` at ``level``, from
    ``runs`` published runs that share the features ``matched``; ``relaxed`` are the features they do not share
    (empty: a validated regime). ``low``/``high`` are ``None`` when no published run is there to calibrate on."""

    level: float
    runs: int
    matched: tuple[str, ...]
    relaxed: tuple[str, ...]
    low: float | None
    high: float | None

    @property
    def validated(self) -> bool:
        """Whether at least :data:`MIN_RUNS` published runs share every feature of the regime."""
        return not self.relaxed and self.low is not None

    def time_interval(self, time_s: float) -> tuple[float, float] | None:
        """The interval of the measured time for a predicted ``time_s`` (s), or ``None`` without calibration."""
        if self.low is None or self.high is None:
            return None
        return time_s * math.exp(self.low), time_s * math.exp(self.high)

    def rate_interval(self, rate: float) -> tuple[float, float] | None:
        """The interval of a measured rate (per second: tokens, samples) for a predicted ``rate``."""
        if self.low is None or self.high is None:
            return None
        return rate / math.exp(self.high), rate / math.exp(self.low)


def conformal_bounds(residuals: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The split-conformal bounds at ``level`` of ``residuals`` (module docstring): the floor((n + 1) a / 2)-th and
    the ceil((n + 1)(1 - a / 2))-th smallest, a = 1 - level; ``None`` when either is past the ends (too few).

    Raises:
        ValueError: ``level`` outside (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    ordered = sorted(residuals)
    n = len(ordered)
    alpha = 1 - level
    # 1e-9 absorbs the binary rounding of 1 - level (1 - 0.9 is 0.09999999999999998): the ranks are of exact products
    low_rank = math.floor((n + 1) * alpha / 2 + 1e-9)
    high_rank = math.ceil((n + 1) * (1 - alpha / 2) - 1e-9)
    if low_rank < 1 or high_rank > n:
        return None
    return ordered[low_rank - 1], ordered[high_rank - 1]


class CalibrationIndex:
    """Residuals grouped by every prefix of their regime's features, so that a regime is calibrated with a few
    lookups (a search calibrates thousands of candidates; each regime once, memoised)."""

    def __init__(self, residuals: Sequence[Residual]):
        pools: dict[tuple[str, ...], list[float]] = {}
        for r in residuals:
            values = tuple(getattr(r.regime, name) for name in FEATURES)
            for kept in range(len(FEATURES) + 1):
                pools.setdefault(values[:kept], []).append(r.log_ratio)
        self._pools = {key: sorted(values) for key, values in pools.items()}
        self._memo: dict[tuple[Regime, float, int], Calibration] = {}

    def calibrate(self, regime: Regime, level: float = LEVEL, min_runs: int = MIN_RUNS) -> Calibration:
        """The calibration of ``regime``: the residuals sharing all its features when at least ``min_runs`` do,
        else the fewest features dropped (from the last of :data:`FEATURES`) that leave ``min_runs``; every residual
        when none does (all features relaxed)."""
        key = (regime, level, min_runs)
        found = self._memo.get(key)
        if found is not None:
            return found
        values = tuple(getattr(regime, name) for name in FEATURES)
        for kept in range(len(FEATURES), -1, -1):
            pool = self._pools.get(values[:kept], [])
            bounds = conformal_bounds(pool, level) if len(pool) >= min_runs else None
            if bounds is not None or kept == 0:
                low, high = bounds if bounds is not None else (None, None)
                found = self._memo[key] = Calibration(level, len(pool), FEATURES[:kept], FEATURES[kept:], low, high)
                return found
        raise AssertionError("unreachable: kept == 0 returns")


def calibrate(regime: Regime, residuals: Sequence[Residual], level: float = LEVEL,
              min_runs: int = MIN_RUNS) -> Calibration:
    """The calibration of ``regime`` from ``residuals`` (:meth:`CalibrationIndex.calibrate`; for one regime: many
    regimes against the same residuals should share one index)."""
    return CalibrationIndex(residuals).calibrate(regime, level, min_runs)


_COLUMNS = ("dataset", "run", *FEATURES, "log_ratio")


def load_residuals(path: Path) -> tuple[Residual, ...]:
    """The residuals in the CSV ``path`` (columns :data:`_COLUMNS`).

    Raises:
        SpecError: the file is missing, or a row is malformed (naming the file and line).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the calibration residuals {path}: {exc.strerror or exc}") from None
    rows = []
    reader = csv.DictReader(text.splitlines())
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise SpecError(f"{path}: columns must be {', '.join(_COLUMNS)}, got {', '.join(reader.fieldnames or [])}")
    for line, entry in enumerate(reader, start=2):
        try:
            ratio = float(entry["log_ratio"])
        except ValueError:
            raise SpecError(f"{path}:{line}: log_ratio must be a number, got {entry['log_ratio']!r}") from None
        if not math.isfinite(ratio):
            raise SpecError(f"{path}:{line}: log_ratio must be finite, got {entry['log_ratio']!r}")
        regime = Regime(**{f.name: entry[f.name] for f in fields(Regime)})
        rows.append(Residual(entry["dataset"], entry["run"], regime, ratio))
    return tuple(rows)


def write_residuals(residuals: Sequence[Residual]) -> str:
    """The CSV text of ``residuals`` (what :func:`load_residuals` reads), in the given order."""
    lines = [",".join(_COLUMNS)]
    for r in residuals:
        lines.append(",".join([r.dataset, r.run, *(getattr(r.regime, n) for n in FEATURES), repr(r.log_ratio)]))
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=1)
def shipped_index() -> CalibrationIndex:
    """The shipped residuals' index (:func:`shipped_residuals`), made once per process."""
    return CalibrationIndex(shipped_residuals())


@lru_cache(maxsize=1)
def shipped_residuals() -> tuple[Residual, ...]:
    """The residuals the tool ships (:data:`RESIDUALS`), read once per process; none where the file is absent."""
    if not RESIDUALS.exists():
        return ()
    return load_residuals(RESIDUALS)
