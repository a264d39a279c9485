"""What fails, how often and at what extra cost: a table of failure causes (``--failure-mix FILE``), and the job's
mean time between failures from a per-device one.

A mix is a YAML (or JSON) file::

    source: where the counts come from
    devices: 16384        # optional: the job the counts were observed on,
    hours: 1296           #   for the per-device MTBF they imply
    causes:
      - {name: Faulty GPU, category: GPU, count: 148, repair_minutes: 0}
      - ...

Each cause's share of the failures is its count over the total; ``repair_minutes`` (default 0) is what a failure of
that cause adds to the run's restart (``sim.faults.long_run``). The built-in mix (:data:`BUILTIN_MIX`) is Llama 3
405B's 419 unexpected interruptions on 16,384 H100s over 54 days (arXiv 2407.21783, §3.3.4, Table 5), whose devices
and hours give a per-device MTBF of 16,384 × 1,296 h / 419 = 50,676 h.

Failures of the devices are independent, so the job's failures are a Poisson process whose rate is the sum of the
devices' (:func:`job_mtbf_s`): a job of N devices each with MTBF m fails every m/N on average.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from sim.core.errors import SpecError
from sim.core.fileio import read_text
from sim.hw.catalog import load_yaml

__all__ = ["FailureCause", "FailureMix", "BUILTIN_MIX", "load_failure_mix", "builtin_mix", "job_mtbf_s",
           "MAX_CAUSES"]

#: The mix used when none is named.
BUILTIN_MIX = "llama3-405b"
#: Most causes a mix may list (a bound on what is read before anything is checked).
MAX_CAUSES = 1000


@dataclass(frozen=True)
class FailureCause:
    """One cause of failures.

    Attributes:
        name: as the source names it.
        category: its group (GPU, Network, Host, ...).
        count: failures observed (its weight in the mix).
        repair_s: what a failure of this cause adds to the restart (s).
    """

    name: str
    category: str
    count: int
    repair_s: float = 0.0


@dataclass(frozen=True)
class FailureMix:
    """A table of failure causes (module docstring).

    Attributes:
        source: where the counts come from.
        causes: the causes, in the file's order.
        observed_device_hours: devices × hours the counts were observed over (0 when the file does not say).
    """

    source: str
    causes: tuple[FailureCause, ...]
    observed_device_hours: float = 0.0

    @property
    def total(self) -> int:
        """Failures in the table."""
        return sum(cause.count for cause in self.causes)

    def shares(self) -> tuple[float, ...]:
        """Each cause's share of the failures, in order."""
        return tuple(cause.count / self.total for cause in self.causes)

    def device_mtbf_s(self) -> float | None:
        """The per-device mean time between failures the table implies (s), or ``None`` when it gives no exposure."""
        return self.observed_device_hours * 3600.0 / self.total if self.observed_device_hours else None


def _field(entry: dict[str, Any], key: str, where: str, kind: type, *, minimum: float | None = None,
           default: Any = None) -> Any:
    value = entry.get(key, default)
    if value is None:
        raise SpecError(f"{where}: {key} is required")
    if kind is str:
        if not isinstance(value, str) or not value.strip():
            raise SpecError(f"{where}: {key} must be a non-empty string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise SpecError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise SpecError(f"{where}: {key} must be a finite number >= {minimum:g}, got {value!r}")
    return value


def parse_failure_mix(data: Any, where: str) -> FailureMix:
    """A :class:`FailureMix` from a parsed document.

    Raises:
        SpecError: naming the file, the entry and the field that is wrong, and what would be valid.
    """
    if not isinstance(data, dict) or not isinstance(data.get("causes"), list) or not data["causes"]:
        raise SpecError(f"{where}: a failure mix is a mapping with a non-empty list 'causes' of "
                        f"{{name, category, count[, repair_minutes]}}")
    unknown = sorted(set(data) - {"source", "devices", "hours", "causes"})
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: source, devices, hours, causes")
    if len(data["causes"]) > MAX_CAUSES:
        raise SpecError(f"{where}: {len(data['causes'])} causes; at most {MAX_CAUSES}")
    causes = []
    for index, entry in enumerate(data["causes"]):
        at = f"{where}: cause {index + 1}"
        if not isinstance(entry, dict):
            raise SpecError(f"{at}: must be a mapping with name, category, count, got {entry!r}")
        extra = sorted(set(entry) - {"name", "category", "count", "repair_minutes"})
        if extra:
            raise SpecError(f"{at}: unknown key(s) {', '.join(extra)}; valid: name, category, count, repair_minutes")
        causes.append(FailureCause(_field(entry, "name", at, str), _field(entry, "category", at, str),
                                   _field(entry, "count", at, int, minimum=0),
                                   60.0 * _field(entry, "repair_minutes", at, float, minimum=0, default=0)))
    if not sum(cause.count for cause in causes):
        raise SpecError(f"{where}: every count is 0; a mix needs at least one failure")
    devices, hours = data.get("devices"), data.get("hours")
    if (devices is None) != (hours is None):
        raise SpecError(f"{where}: give both devices and hours (the exposure the counts were observed over), or "
                        f"neither")
    exposure = 0.0
    if devices is not None:
        exposure = _field(data, "devices", where, int, minimum=1) * _field(data, "hours", where, float, minimum=0)
    source = _field(data, "source", where, str, default="(no source given)")
    return FailureMix(source, tuple(causes), float(exposure))


def load_failure_mix(path: str | Path) -> FailureMix:
    """Read a mix file (YAML or JSON; module docstring).

    Raises:
        SpecError: a missing, malformed or invalid file (the message names it and what is wrong).
    """
    if not Path(path).is_file():
        raise SpecError(f"failure mix {path} does not exist (a YAML or JSON table of causes; the built-in one is "
                        f"profiles/faults/{BUILTIN_MIX}.yaml)")
    text = read_text(path, "failure mix")
    try:
        data = json.loads(text) if str(path).endswith(".json") else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError(f"failure mix {path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'} "
                        f"({str(exc).splitlines()[0]})") from None
    return parse_failure_mix(data, f"failure mix {path}")


def builtin_mix() -> FailureMix:
    """The built-in mix (:data:`BUILTIN_MIX`)."""
    path = files("profiles") / "faults" / f"{BUILTIN_MIX}.yaml"
    return parse_failure_mix(load_yaml(path.read_text(encoding="utf-8")), f"profiles/faults/{BUILTIN_MIX}.yaml")


def job_mtbf_s(device_mtbf_s: float, devices: int) -> float:
    """The mean time between failures of a job of ``devices`` devices that fail independently (s)."""
    if not math.isfinite(device_mtbf_s) or device_mtbf_s <= 0 or devices < 1:
        raise ValueError(f"need a device MTBF > 0 and at least one device, got {device_mtbf_s!r} and {devices!r}")
    return device_mtbf_s / devices
