"""Whether a plan fits in its devices' memory, by how much it does not, and which changes would make it fit.

Estimating memory and predicting an out-of-memory failure before launch is what users of Megatron-LM and NeMo ask
for most; a bare "needs 111 GB > 80 GB" leaves them to guess the remedy. :func:`memory_report` reads the plan's
peak on every device from the memory ledger (``sim.cost.ledger``, replayed in program order: the engine's peak,
without simulating), and :func:`memory_remedies` rebuilds the plan with each of the usual remedies and keeps those
whose peak fits:

* full activation recomputation (every layer's input kept, one layer rebuilt at a time);
* each higher ZeRO stage than the plan's (1: Adam's states split over the data-parallel replicas, 2: the gradients
  too, 3: the parameters too, as FSDP; ZeRO §5), for schedules that update once per iteration;
* twice the tensor parallelism or twice the pipeline stages, taking the devices from data parallelism (or from the
  other of the two), with the global batch kept;
* half the microbatch size with twice the microbatches (the global batch kept);
* 1F1B instead of GPipe (p − r microbatches in flight instead of m).

Each remedy is a set of :class:`~sim.plan.inputs.PlanInputs` changes, described in the library's own terms
(``recompute="full"``, ``tp=4``). :func:`out_of_memory_message` is the one text of the refusal, its changes spelt by
the caller: ``sim.run`` writes them as flags (``--tp 4``), :mod:`sim.api` as keyword arguments (``tp=4``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sim.core.errors import SpecError
from sim.cost.ledger import program_order_peaks
from sim.plan.build import BuiltPlan, build_plan
from sim.plan.inputs import PlanInputs

__all__ = ["MemoryReport", "Remedy", "memory_report", "memory_remedies", "out_of_memory_message"]


@dataclass(frozen=True)
class MemoryReport:
    """A plan's peak memory against its devices' capacities.

    Attributes:
        peaks: per simulated rank, the highest memory in use, bytes.
        capacities: per simulated rank, its device's memory, bytes.
        worst: the simulated rank furthest over (or closest to) its capacity.
        device: that rank's device name.
        state_bytes: the training state that rank holds before any op runs, bytes.
    """

    peaks: tuple[int, ...]
    capacities: tuple[float, ...]
    worst: int
    device: str
    state_bytes: int

    @property
    def fits(self) -> bool:
        """Whether every rank's peak is within its device's memory."""
        return all(peak <= capacity for peak, capacity in zip(self.peaks, self.capacities))

    @property
    def over_bytes(self) -> float:
        """How far the worst rank's peak is over its capacity, bytes (negative: room left)."""
        return self.peaks[self.worst] - self.capacities[self.worst]


@dataclass(frozen=True)
class Remedy:
    """A change to the plan's inputs and the peak it gives.

    Attributes:
        changes: ``(field of PlanInputs, new value)`` pairs, in the order they apply.
        peak_bytes: the changed plan's highest peak over its ranks, bytes.
        capacity_bytes: that rank's device memory, bytes.
    """

    changes: tuple[tuple[str, object], ...]
    peak_bytes: int
    capacity_bytes: float


def memory_report(built: BuiltPlan) -> MemoryReport:
    """The peak of every rank of ``built`` (replica views as the engine simulates them) against its capacity.

    Raises:
        ValueError: the plan has host copies (their memory depends on when the copies run: simulate it).
    """
    plan = built.plan
    views = built.views()
    peaks = program_order_peaks(plan, views)
    devices = [built.topology.devices[view.device_index_of(p)] for view in views for p in range(plan.num_ranks)]
    capacities = tuple(device.memory_bytes for device in devices)
    worst = max(range(len(peaks)), key=lambda r: (peaks[r] - capacities[r], -r))
    view = views[worst // plan.num_ranks]
    state = sum(view.state_bytes(v) for v in plan.placement.vstages_of(worst % plan.num_ranks))
    return MemoryReport(peaks, capacities, worst, devices[worst].name, state)


def _candidates(inputs: PlanInputs, built: BuiltPlan) -> list[tuple[tuple[str, object], ...]]:
    """The remedies that apply to ``built``, as changes of ``inputs`` (module docstring)."""
    layout, plan = built.plan.layout, built.plan
    global_batch = inputs.global_batch or plan.num_microbatches * plan.microbatch_size * layout.dp
    keep_batch: tuple[tuple[str, object], ...] = (("microbatches", None), ("global_batch", global_batch))
    found: list[tuple[tuple[str, object], ...]] = []
    if inputs.recompute_mode != "full" and plan.weight_policy != "stream":
        found.append((("recompute", "full"),))
    if layout.data_ranks > 1 and plan.weight_policy == "flush":
        # Each higher ZeRO stage splits one more part of the state across the replicas (ZeRO §5).
        found.extend((("zero", stage),) for stage in range(layout.zero + 1, 4))
    for grow in ("tp", "pp"):
        for shrink in ("dp", "pp" if grow == "tp" else "tp"):
            if getattr(layout, shrink) % 2 == 0:
                found.append(((grow, getattr(layout, grow) * 2), (shrink, getattr(layout, shrink) // 2), *keep_batch))
    if plan.microbatch_size % 2 == 0:
        found.append((("microbatch_size", plan.microbatch_size // 2), *keep_batch))
    if plan.schedule == "gpipe":
        found.append((("schedule", "1f1b"),))
    return found


def memory_remedies(inputs: PlanInputs, built: BuiltPlan) -> list[Remedy]:
    """The remedies of the module docstring that make ``built`` (built from ``inputs``) fit, best first (lowest
    peak against capacity). Single remedies are tried first; only when none fits, pairs of them that change
    different inputs. A remedy the plan's rules refuse (TP not dividing the heads, more stages than layers) is left
    out.
    """
    singles = _candidates(inputs, built)
    fitting = _fitting(inputs, built, singles)
    if not fitting:
        pairs = [a + b for i, a in enumerate(singles) for b in singles[i + 1:]
                 if not {name for name, _ in a if name not in ("microbatches", "global_batch")}
                 & {name for name, _ in b}]
        fitting = _fitting(inputs, built, [_merged(pair) for pair in pairs])
    return sorted(fitting, key=lambda remedy: remedy.peak_bytes / remedy.capacity_bytes)


def _merged(changes: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    """One change per field (the batch-keeping pair appears in both halves of a pair with the same values)."""
    merged: dict[str, object] = {}
    for name, value in changes:
        merged.setdefault(name, value)
    return tuple(merged.items())


def _fitting(inputs: PlanInputs, built: BuiltPlan, candidates: list[tuple[tuple[str, object], ...]]) -> list[Remedy]:
    """The candidates whose rebuilt plan fits, each with its peak."""
    pp_given = replace(inputs, pp=built.plan.layout.pp)  # a remedy moves devices between pp and the others
    fitting = []
    for changes in candidates:
        try:
            changed = build_plan(replace(pp_given, **dict(changes)))
            report = memory_report(changed)
        except (SpecError, ValueError):
            continue
        if report.fits:
            worst = max(range(len(report.peaks)), key=lambda r: report.peaks[r] / report.capacities[r])
            fitting.append(Remedy(changes, report.peaks[worst], report.capacities[worst]))
    return fitting


def out_of_memory_message(inputs: PlanInputs, built: BuiltPlan, spell: Callable[[str, object], str],
                          anyway: str) -> str | None:
    """Why ``built`` (built from ``inputs``) does not fit, and what would make it fit, in one line; ``None`` when it
    fits, or when it has host copies (their peak is the engine's timeline's to decide).

    Args:
        inputs: what ``built`` was built from.
        built: the plan.
        spell: writes one change of a remedy, ``(field of PlanInputs, value) -> text``: ``--tp 4`` for a command,
            ``tp=4`` for Python.
        anyway: how to simulate it regardless (``--ignore-memory``, ``check_memory=False``).
    """
    try:
        report = memory_report(built)
    except ValueError:
        return None
    if report.fits:
        return None
    gb = 1e9
    rank = report.worst
    head = (f"out of memory: rank {rank} ({report.device}) peaks at {report.peaks[rank] / gb:.2f} GB, "
            f"{report.over_bytes / gb:.2f} GB over its {report.capacities[rank] / gb:.2f} GB (its training state "
            f"alone is {report.state_bytes / gb:.2f} GB)")
    remedies = memory_remedies(inputs, built)
    if remedies:
        options = [" ".join(spell(name, value) for name, value in remedy.changes if value is not None)
                   + f" ({remedy.peak_bytes / gb:.2f} of {remedy.capacity_bytes / gb:.2f} GB)"
                   for remedy in remedies[:3]]
        advice = "these would fit: " + "; ".join(options)
    else:
        advice = ("neither recomputation, ZeRO-1, more tensor or pipeline parallelism nor smaller microbatches "
                  "would fit it: more or larger devices are needed")
    return f"{head}; {advice} ({anyway} simulates it anyway)"
