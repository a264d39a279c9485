"""What slows a simulated iteration beyond its costs: straggling devices and per-op jitter (``sim.run --straggler``,
``--jitter``).

Slow-but-alive GPUs are common in large jobs and delay them (Falcon, arXiv 2410.12588: slow GPUs and links lasting
seconds to hours delayed jobs on a 10,000-GPU cluster by 1.34×; ../shared/reference/faults.md). Two kinds are
modelled, both on the compute stream:

* a **straggler** ``DEVICE:FACTOR[@START-END]``, DEVICE its global rank ``5`` or the name the device table gives it,
  ``gpu5``: every compute op (F, B, I, W, R, the optimizer step) of the device's simulated rank that starts in
  ``[START, END)`` seconds of the iteration (always, without a window) takes FACTOR times its cost. A simulated rank
  stands for its tensor-parallel group, whose shards wait for each other, so a slow shard slows its whole group; the
  collectives are left alone (the links set their pace);
* a **slow link** ``LINK:FACTOR``: every link of a type (``nvswitch-h100``, ``ib-ndr``: a degraded fabric) or every
  link into and out of one device (``gpu5-links``: a GPU whose NVLink or PCIe port degraded) carries FACTOR times
  slower for the whole iteration (:meth:`sim.hw.topology.Topology.with_slowed_links`); messages, collectives and host
  copies over it take longer and contend as before. A device's links are spelt apart from the device (``gpu5`` is its
  compute), and any other name starting with ``gpu`` is refused rather than guessed at;
* **jitter** ``SIGMA`` with a seed: every compute op's cost is multiplied by a lognormal factor of mean 1 and shape σ
  (``exp(σ·Z − σ²/2)``, Z standard normal), drawn per simulated rank from ``numpy.random.default_rng([seed, rank])``
  in program order, so the same inputs give the same trace.

The engine applies them (:class:`sim.engine.simpy_engine`'s compute ops); with a straggler every data-parallel
replica is simulated on its own, since one slow replica no longer stands for the others.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from sim.core.errors import SpecError
from sim.hw.topology import Topology

__all__ = ["Straggler", "SlowLink", "Perturbation", "parse_straggler", "NONE", "MAX_FACTOR", "STRAGGLER_FORMS"]

#: The largest slowdown a straggler may have (the bound ``executor.run --slowdown`` has).
MAX_FACTOR = 1000.0

#: The spellings ``--straggler`` takes, for the messages that refuse another.
STRAGGLER_FORMS = ("DEVICE:FACTOR[@START-END] for a device's compute (DEVICE its rank or name: 5:1.5, gpu5:1.5, "
                   "gpu5:2@0.1-0.4), gpuN-links:FACTOR for a device's links (gpu5-links:2) or LINK:FACTOR for a link "
                   "type (ib-ndr:2)")

_DEVICE = re.compile(r"(?:gpu)?(\d+)", re.IGNORECASE)  # 5 or gpu5: the device's compute
_DEVICE_LINKS = re.compile(r"gpu(\d+)-links", re.IGNORECASE)  # gpu5-links: every link into and out of it


@dataclass(frozen=True)
class Straggler:
    """One slow device.

    Attributes:
        device: its global rank.
        factor: how many times its compute ops' costs it takes (> 1 slows, in (0, 1) speeds up).
        start_s, end_s: the window of the iteration, in s, in which an op that starts is slowed.
    """

    device: int
    factor: float
    start_s: float = 0.0
    end_s: float = math.inf

    def describe(self) -> str:
        """``device 5 × 1.5`` (with its window when it has one)."""
        window = "" if self.start_s == 0 and math.isinf(self.end_s) else \
            f" from {self.start_s:g} s to {self.end_s:g} s"
        return f"device {self.device} × {self.factor:g}{window}"


@dataclass(frozen=True)
class SlowLink:
    """Slow links (module docstring).

    Attributes:
        selector: a link type's name, or ``gpuN`` (the topology's name of device N's node) for every link of
            device N (spelt ``gpuN-links`` on the command line).
        factor: how many times slower they carry (bandwidth divided by it).
    """

    selector: str
    factor: float

    def describe(self) -> str:
        """``links nvswitch-h100 × 2`` or ``links of gpu5 × 2``."""
        what = f"links of {self.selector}" if self.selector.startswith("gpu") else f"links {self.selector}"
        return f"{what} × {self.factor:g}"


@dataclass(frozen=True)
class Perturbation:
    """Everything that slows the iteration (module docstring).

    Attributes:
        stragglers: the slow devices.
        jitter: σ of the per-op lognormal noise (0: none).
        seed: the noise's seed.
        links: the slow links.
    """

    stragglers: tuple[Straggler, ...] = ()
    jitter: float = 0.0
    seed: int = 0
    links: tuple[SlowLink, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.jitter) or not 0 <= self.jitter <= 1:
            raise SpecError(f"--jitter must be a number from 0 to 1 (σ of a lognormal factor), got {self.jitter!r}")

    def __bool__(self) -> bool:
        return bool(self.stragglers) or self.jitter > 0 or bool(self.links)

    def topology(self, topology: Topology) -> Topology:
        """``topology`` with the slow links applied (itself without any)."""
        for link in self.links:
            topology = topology.with_slowed_links(link.selector, link.factor)
        return topology

    def noise(self, rank: int, ops: int) -> np.ndarray | None:
        """The jitter factors of simulated rank ``rank``'s ``ops`` ops, in program order (``None`` without jitter)."""
        if not self.jitter:
            return None
        normal = np.random.default_rng([self.seed, rank]).standard_normal(ops)
        return np.exp(self.jitter * normal - self.jitter ** 2 / 2)

    def describe(self) -> str:
        """One line for the summary."""
        parts = [straggler.describe() for straggler in self.stragglers] + [link.describe() for link in self.links]
        if self.jitter:
            parts.append(f"jitter σ {self.jitter:g} (seed {self.seed})")
        return "; ".join(parts)


#: Nothing slowed.
NONE = Perturbation()


def parse_straggler(text: str, devices: int) -> Straggler | SlowLink:
    """``DEVICE:FACTOR`` or ``DEVICE:FACTOR@START-END`` (seconds of the iteration; DEVICE ``N`` or ``gpuN``) as a
    :class:`Straggler`; ``gpuN-links:FACTOR`` or ``LINK:FACTOR`` (a link type, whose name the topology checks) as a
    :class:`SlowLink`.

    Raises:
        SpecError: another spelling (a name starting with ``gpu`` that is neither ``gpuN`` nor ``gpuN-links`` among
            them), a device outside ``0..devices-1``, a factor outside (0, MAX_FACTOR], an empty window, or a window
            on a link (each message names the value and what would be valid).
    """
    spec, _, window = text.strip().partition("@")
    selector, colon, factor_text = (part.strip() for part in spec.partition(":"))
    device = _DEVICE.fullmatch(selector)
    if not colon or not selector or (device is None and selector.lower().startswith("gpu")
                                     and not _DEVICE_LINKS.fullmatch(selector)):
        raise SpecError(f"--straggler {text.strip()!r} is none of its forms: {STRAGGLER_FORMS}")
    if device is None:  # a link type, or a device's links
        owner = _DEVICE_LINKS.fullmatch(selector)
        try:
            factor = float(factor_text)
        except ValueError:
            raise SpecError(f"--straggler {text!r}: LINK:FACTOR needs a number, got {factor_text!r}") from None
        if window:
            raise SpecError(f"--straggler {text!r}: a slow link has no window (it is slow for the whole iteration)")
        if not math.isfinite(factor) or not 1 <= factor <= MAX_FACTOR:
            raise SpecError(f"--straggler {text!r}: a link's factor must be a number in [1, {MAX_FACTOR:g}]")
        if owner is None:
            return SlowLink(selector, factor)
        _check_device(text, int(owner.group(1)), devices)
        return SlowLink(f"gpu{int(owner.group(1))}", factor)
    try:
        factor = float(factor_text)
        start, end = (0.0, math.inf)
        if window:
            start_text, dash, end_text = window.partition("-")
            if not dash:
                raise ValueError
            start, end = float(start_text), float(end_text)
    except ValueError:
        raise SpecError(f"--straggler {text.strip()!r} is none of its forms: {STRAGGLER_FORMS}") from None
    _check_device(text, int(device.group(1)), devices)
    if not math.isfinite(factor) or not 0 < factor <= MAX_FACTOR:
        raise SpecError(f"--straggler {text!r}: the factor must be a number in (0, {MAX_FACTOR:g}], got {factor_text}")
    if not (math.isfinite(start) and start >= 0 and end > start):
        raise SpecError(f"--straggler {text!r}: the window must be START-END seconds with 0 <= START < END")
    return Straggler(int(device.group(1)), factor, start, end)


def _check_device(text: str, device: int, devices: int) -> None:
    """Refuse a device number outside the plan's devices."""
    if not 0 <= device < devices:
        raise SpecError(f"--straggler {text!r}: device {device} outside 0..{devices - 1} (the plan's devices)")
