"""The inputs and outputs of a CSP simulation: the problem (subnets, costs, lookahead, device parameter budget) and
what :func:`sim.csp.simulate.simulate_csp` reports (decisions, stalls, copies). Split from ``sim.csp.simulate`` so that
the SimPy run there is one concept and these plain data types another; ``sim.csp.simulate`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sim.csp.rules import subnet_table
from sim.ir.trace import Trace

__all__ = ["CspProblem", "CspResult", "StageMemoryModel", "Decision", "PREFETCH_POLICIES", "StageCopies", "StageStalls",
           "SHARING", "TransferTime", "CopyTime"]

#: Context-switch policies of :func:`simulate_csp` (module docstring).
PREFETCH_POLICIES = ("predict", "on_demand", "resident")

#: How subnets share layers: from the table, every subnet with every other on every stage, or never.
SHARING = ("table", "all", "none")

TransferTime = Callable[[int, int, int, str], float]
#: ``f(stage, nbytes)`` → seconds to copy ``nbytes`` between the stage's device and host memory.
CopyTime = Callable[[int, int], float]


def _table(name: str, values: Any, rows: int, cols: int) -> tuple[tuple[float, ...], ...]:
    table = tuple(tuple(float(x) for x in row) for row in values)
    if len(table) != rows or any(len(row) != cols for row in table):
        raise ValueError(f"{name} must be {rows} subnets x {cols} stages, got {[len(row) for row in table]}")
    if any(not 0 <= x < float("inf") for row in table for x in row):
        raise ValueError(f"{name} must hold finite times >= 0 s, got {table}")
    return table


@dataclass(frozen=True)
class StageMemoryModel:
    """What occupies each stage's device during a CSP run, bytes (the engine tracks the sum and its peak).

    Attributes:
        static_bytes: per stage, what stays resident all run: the training state of the layers every subnet
            shares there, and of every candidate when no budget moves them (weights, gradients, optimizer state).
        activation_bytes: ``[subnet][stage]``: what the subnet's forward keeps until its backward ends.
        state_per_param_byte: training-state bytes per byte of parameters of a key made resident under a budget
            (its gradients and optimizer state travel with it); 0 without context switching.
    """

    static_bytes: tuple[int, ...]
    activation_bytes: tuple[tuple[int, ...], ...]
    state_per_param_byte: float = 0.0


@dataclass(frozen=True)
class CspProblem:
    """A CSP training run: a subnet sequence, per-op costs and the lookahead window.

    Attributes:
        num_stages: pipeline stages p, one per rank.
        uses: subnet table ``uses[subnet][stage]`` → layer keys (normalised by :func:`sim.csp.rules.subnet_table`).
        fwd_s: forward time of each subnet on each stage, seconds (``fwd_s[subnet][stage]``).
        bwd_s: backward time, seconds.
        update_s: weight-update (OPT_STEP) time, seconds.
        transfer_s: seconds per activation or gradient message, a constant or ``f(src, dst, subnet, kind)``.
        lookahead: most subnets in flight at once (>= 1).
        key_bytes: parameter bytes of each layer key of ``uses`` (keys are scoped as in ``uses``); ``None``: no
            context switching.
        param_budget_bytes: most layer-parameter bytes a stage may hold; ``None``: unlimited, every layer resident.
        h2d_s: ``f(stage, nbytes)``, seconds to copy ``nbytes`` host → device (``None``: free).
        d2h_s: ``f(stage, nbytes)``, seconds to copy device → host (``None``: free).
        devices: the device name of each stage, for the trace (``None``: ``"ideal"``, a problem with no hardware).
        memory: what occupies each device, for the peak memory per stage (``None``: not modelled, peaks 0).
    """

    num_stages: int
    uses: tuple[tuple[frozenset[Hashable], ...], ...]
    fwd_s: tuple[tuple[float, ...], ...]
    bwd_s: tuple[tuple[float, ...], ...]
    update_s: tuple[tuple[float, ...], ...]
    transfer_s: float | TransferTime = 0.0
    lookahead: int = 30
    key_bytes: Mapping[Hashable, int] | None = None
    param_budget_bytes: int | None = None
    h2d_s: CopyTime | None = None
    d2h_s: CopyTime | None = None
    devices: tuple[str, ...] | None = None
    memory: StageMemoryModel | None = None

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        uses = subnet_table(self.uses, self.num_stages)
        n, p = len(uses), self.num_stages
        object.__setattr__(self, "uses", uses)
        for name in ("fwd_s", "bwd_s", "update_s"):
            object.__setattr__(self, name, _table(name, getattr(self, name), n, p))
        if not callable(self.transfer_s) and not 0 <= self.transfer_s < float("inf"):
            raise ValueError(f"transfer_s must be a finite time >= 0 s or a function, got {self.transfer_s}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")
        if self.devices is not None and len(self.devices) != p:
            raise ValueError(f"devices must name one device per stage ({p}), got {self.devices}")
        if self.memory is not None:
            if len(self.memory.static_bytes) != p:
                raise ValueError(f"memory must describe {p} stages, got {len(self.memory.static_bytes)}")
            _table("memory.activation_bytes", self.memory.activation_bytes, n, p)  # shape and range
        if self.key_bytes is not None:
            object.__setattr__(self, "key_bytes", MappingProxyType(dict(self.key_bytes)))
            missing = {k for row in uses for keys in row for k in keys} - set(self.key_bytes)
            if missing:
                raise ValueError(f"key_bytes has no entry for layer keys {sorted(map(repr, missing))[:5]}")
            bad = {k: v for k, v in self.key_bytes.items() if not (isinstance(v, int) and v >= 0)}
            if bad:
                raise ValueError(f"key_bytes must be ints >= 0, got {bad}")
        if self.param_budget_bytes is not None:
            if self.key_bytes is None:
                raise ValueError("param_budget_bytes needs key_bytes (the parameter bytes of each layer key)")
            if self.param_budget_bytes < 0:
                raise ValueError(f"param_budget_bytes must be >= 0, got {self.param_budget_bytes}")
            need, b, s = self.largest_subnet_bytes()
            if need > self.param_budget_bytes:
                raise ValueError(f"param_budget_bytes {self.param_budget_bytes} B is smaller than subnet {b}'s "
                                 f"layers on stage {s}, {need} B; every subnet's layers of a stage must fit at once")

    def subnet_bytes(self, b: int, s: int) -> int:
        """Parameter bytes of subnet ``b``'s layer keys on stage ``s`` (0 without ``key_bytes``)."""
        return 0 if self.key_bytes is None else sum(self.key_bytes[k] for k in self.uses[b][s])

    def largest_subnet_bytes(self) -> tuple[int, int, int]:
        """``(bytes, subnet, stage)`` of the largest parameter set one subnet needs on one stage (first on ties)."""
        best = (0, 0, 0)
        for b in range(self.num_subnets):
            for s in range(self.num_stages):
                if self.subnet_bytes(b, s) > best[0]:
                    best = (self.subnet_bytes(b, s), b, s)
        return best

    def copy_time(self, direction: str, stage: int, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` on ``stage``'s ``"h2d"`` or ``"d2h"`` engine."""
        fn = self.h2d_s if direction == "h2d" else self.d2h_s
        seconds = 0.0 if fn is None else fn(stage, nbytes)
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"{direction}_s({stage}, {nbytes}) = {seconds}; expected a time >= 0 s")
        return float(seconds)

    @classmethod
    def uniform(cls, num_stages: int, uses: Any, fwd_s: float, bwd_s: float, update_s: float = 0.0,
                transfer_s: float | TransferTime = 0.0, lookahead: int = 30, **copies: Any) -> CspProblem:
        """A problem whose every subnet costs the same on every stage (times in seconds); ``copies``: the
        ``key_bytes``, ``param_budget_bytes``, ``h2d_s``, ``d2h_s`` fields."""
        def grid(seconds: float) -> list[list[float]]:
            return [[seconds] * num_stages for _ in uses]

        return cls(num_stages, uses, grid(fwd_s), grid(bwd_s), grid(update_s), transfer_s, lookahead, **copies)

    @property
    def num_subnets(self) -> int:
        """Number of subnets N."""
        return len(self.uses)

    def transfer_time(self, src: int, dst: int, subnet: int, kind: str) -> float:
        """Seconds to move ``subnet``'s activation (``kind="F"``) or gradient (``"B"``) from ``src`` to ``dst``."""
        seconds = self.transfer_s(src, dst, subnet, kind) if callable(self.transfer_s) else self.transfer_s
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"transfer_s({src}, {dst}, {subnet}, {kind!r}) = {seconds}; expected a time >= 0 s")
        return float(seconds)


@dataclass(frozen=True)
class Decision:
    """One CSP decision of a stage: a forward picked, or every arrived forward blocked.

    Attributes:
        time: when it was made, seconds.
        stage: the deciding stage.
        picked: the subnet whose forward started, or ``None`` when blocked.
        arrived: the stage's arrived subnets, in arrival order, as :func:`csp_pick` saw them.
        unfinished: the stage's ``wait_list``, ascending.
        edges: ``(w, b)`` pairs for ``OPT_STEP(stage, w) → F(stage, b)``. When picked: the causal dependencies of
            ``b`` (:func:`sim.csp.rules.causal_deps`, enough to replay the run). When blocked: every conflict that
            blocks an arrived ``b`` (:func:`sim.csp.rules.conflicts`).
    """

    time: float
    stage: int
    picked: int | None
    arrived: tuple[int, ...]
    unfinished: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StageStalls:
    """CSP stalls of one stage: ``blocked_s`` seconds idle with only CSP-blocked forwards, ``blocked_decisions``."""

    stage: int
    blocked_s: float
    blocked_decisions: int


@dataclass(frozen=True)
class StageCopies:
    """Context switching on one stage.

    Attributes:
        stage: the stage.
        h2d_bytes: bytes copied host → device (PREFETCH).
        d2h_bytes: bytes written back device → host (EVICT).
        copy_wait_s: seconds the compute waited for copies between picking a forward and starting it (on-demand
            copies, mispredictions, or a prefetch still holding the engine).
        admission_wait_s: seconds the stage idled with arrived forwards none of which fit the budget beside the
            pinned layers (memory admission, module docstring).
        peak_resident_bytes: most layer bytes on the device at once, copies in flight included (<= the budget).
        prefetches: PREFETCH copies issued (each of one subnet's missing keys).
        evictions: keys written back.
    """

    stage: int
    h2d_bytes: int
    d2h_bytes: int
    copy_wait_s: float
    admission_wait_s: float
    peak_resident_bytes: int
    prefetches: int
    evictions: int


@dataclass(frozen=True)
class CspResult:
    """What :func:`simulate_csp` produced: the trace, every decision, the stalls and copy statistics per stage, and
    the peak memory per stage in bytes (zeros when the problem has no memory model).

    ``copies`` is empty when no context switching was simulated (no budget, or the ``"resident"`` policy).
    """

    trace: Trace
    decisions: tuple[Decision, ...]
    stalls: tuple[StageStalls, ...]
    copies: tuple[StageCopies, ...] = ()
    peak_memory_bytes: tuple[int, ...] = ()

    @property
    def makespan(self) -> float:
        """Time from the first op's start to the last op's end, seconds."""
        return self.trace.makespan
