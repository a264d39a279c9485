"""Metrics of a trace: iteration time, throughput, where each device's time goes, its memory, link traffic.

The same function serves simulated and measured traces, so ``metrics.json`` means the same thing for both.

**Where a device's time goes** (:func:`time_split`). A device's window is the iteration, ``[t0, t0 + T]`` (``t0``
the trace's first start, ``T`` its makespan). Each of its spans is compute or communication by its op kind's action
in :data:`sim.ir.ops.OP_SEMANTICS` (a kind outside that table, such as the CSP executor's ``CHECKPOINT``, by its
stream, whose kinds' action it takes): compute is ``Action.COMPUTE`` (F, B, I, W, R, OPT_STEP); communication is
one of :data:`COMM_KINDS`, by action:

* ``tp``: the tensor-parallel collectives (TP_F, TP_B, TP_R), sequence parallelism's included;
* ``ep``: the expert-parallel all-to-alls (EP_F, EP_B, EP_R);
* ``pp``: the pipeline's point-to-point transfers (SEND_*, RECV_*; a span is the time the message is on the wire,
  not the time a rank waits for its peer, in the simulator as in the executor's measured trace);
* ``dp``: the data-parallel collectives (REDUCE_GRAD: the gradient all-reduce, or reduce-scatter under ZeRO;
  GATHER_PARAMS: ZeRO's all-gather of the updated parameters);
* ``host_copy``: the weight copies between host and device (PREFETCH, EVICT).

Every instant of the window is then exactly one of:

* **compute busy**: a compute span of the device runs;
* **exposed communication of kind k**: no compute span runs, and a communication span of kind k does; where spans of
  several kinds run at once it counts once, for the first of :data:`COMM_KINDS` among them (the blocking
  collectives the compute stream is waiting for first, then the transfers and collectives issued in the
  background). Communication that overlaps compute is not exposed;
* **bubble**: neither: the device computes nothing and none of its streams runs a communication op. It waits in the
  pipeline schedule (for a peer's activation or gradient, or for the last rank to finish), or is past its own last
  op.

so that ``busy_s / T + bubble_fraction + Σ exposed_comm_fraction = 1`` on every device, and over the plan (each
summed over the devices ÷ (devices × T)). ``idle_fraction`` is ``1 − busy_s / T``: the bubble and the exposed
communication together (what ``bubble_fraction`` meant before 2026-12-07). ``busy_s`` sums the compute spans'
durations, as it always has (a device's compute spans never overlap, so that is also their union's length).

Not seen as communication: what is costed inside a compute op rather than as an op of its own. ZeRO-3/FSDP's
per-layer gathers and reduce-scatters (``sim.cost.fsdp``) and context parallelism's key/value exchange
(``sim.cost.context_parallel``) lengthen the F and B they run in by the part the layers' compute does not hide, so
that part counts as compute busy here (the trace has no span that holds it). On a measured trace a collective's span
runs from the rank's call to its return, so it includes the time the rank waited for the group's last member: skew
among the group's ranks reads as exposed communication there, where the simulator, whose members start together,
has none.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.ir.ops import OP_SEMANTICS, Action
from sim.ir.plan import Plan
from sim.ir.trace import STREAMS, Span, Trace

__all__ = ["compute_metrics", "plan_header", "rank_label", "time_split", "split_text", "COMM_KINDS", "TimeSplit"]

#: The communication kinds of the time split, by the action that carries an op out (``sim.ir.ops.Action``), in the
#: order an instant where several run at once is counted: the collectives the compute stream waits for (``blocks``
#: in ``OP_SEMANTICS``) before the transfers and collectives issued in the background.
_COMM_OF_ACTION: dict[Action, str] = {
    Action.TP_COLLECTIVE: "tp", Action.EP_COLLECTIVE: "ep", Action.SEND: "pp", Action.RECV: "pp",
    Action.DP_COLLECTIVE: "dp", Action.HOST_COPY: "host_copy",
}
_UNSPLIT = [action.value for action in Action if action is not Action.COMPUTE and action not in _COMM_OF_ACTION]
if _UNSPLIT:  # an action with no kind of communication would be counted as nothing: refuse rather than miscount
    raise ImportError(f"action(s) {', '.join(_UNSPLIT)} have no communication kind in the time split")
#: The communication kinds, in counting order (module docstring).
COMM_KINDS: tuple[str, ...] = tuple(dict.fromkeys(_COMM_OF_ACTION.values()))
_BLOCKING = {_COMM_OF_ACTION[semantics.action] for semantics in OP_SEMANTICS.values() if semantics.blocks
             and semantics.action in _COMM_OF_ACTION}
if set(COMM_KINDS[:len(_BLOCKING)]) != _BLOCKING:  # the counting order's promise: what compute waits for first
    raise ImportError(f"the time split counts {COMM_KINDS} in that order, but the blocking kinds are "
                      f"{sorted(_BLOCKING)}")
_COMPUTE = -1  # a span's class: compute, or the index of its communication kind in COMM_KINDS


#: How the summary and the Gantt chart's title name each kind.
_COMM_LABEL = {"tp": "TP", "ep": "EP", "pp": "PP p2p", "dp": "DP", "host_copy": "host copies"}


def split_text(fractions: dict[str, Any]) -> str:
    """A device's or the plan's time split in one line, from its ``metrics.json`` fractions: ``compute 75.9 % ·
    bubble 6.7 % · exposed TP 15.5 %, DP 0.9 %`` (a kind with no exposed time left out)."""
    exposed = [f"{_COMM_LABEL[kind]} {share * 100:.1f} %"
               for kind, share in sorted(fractions["exposed_comm_fraction"].items(), key=lambda item: -item[1])
               if share > 0]
    return (f"compute {(1 - fractions['idle_fraction']) * 100:.1f} % · "
            f"bubble {fractions['bubble_fraction'] * 100:.1f} % · "
            f"exposed {', '.join(exposed) if exposed else 'comm 0.0 %'}")


def _class_of(action: Action) -> int:
    return _COMPUTE if action is Action.COMPUTE else COMM_KINDS.index(_COMM_OF_ACTION[action])


#: Each op kind's class, from its action; each stream's, from the action of the kinds drawn on it (one per stream,
#: checked here) for a span whose kind is not in the table.
_CLASS_OF_KIND: dict[str, int] = {kind.value: _class_of(semantics.action) for kind, semantics in OP_SEMANTICS.items()}
_CLASS_OF_STREAM: dict[str, int] = {}
for _kind, _semantics in OP_SEMANTICS.items():
    if _CLASS_OF_STREAM.setdefault(_semantics.stream, _CLASS_OF_KIND[_kind.value]) != _CLASS_OF_KIND[_kind.value]:
        raise ImportError(f"stream {_semantics.stream} holds kinds of two classes of the time split")
if set(_CLASS_OF_STREAM) != set(STREAMS):
    raise ImportError(f"streams {sorted(set(STREAMS) - set(_CLASS_OF_STREAM))} hold no op kind of OP_SEMANTICS")


def _class_of_span(span: Span) -> int:
    found = _CLASS_OF_KIND.get(span.kind)
    return _CLASS_OF_STREAM[span.stream] if found is None else found


@dataclass(frozen=True, slots=True)
class TimeSplit:
    """Where one device's time goes over the iteration (module docstring), s.

    Attributes:
        compute_s: the length of the union of its compute spans.
        exposed_s: per kind of :data:`COMM_KINDS`, the time a communication span of that kind runs and no compute span
            (nor one of an earlier kind) does.
        bubble_s: the time none of its spans runs.
    """

    compute_s: float
    exposed_s: dict[str, float]
    bubble_s: float


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` (sorted by start) as disjoint sorted intervals covering the same points."""
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _uncovered(intervals: list[tuple[float, float]],
               covered: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """The length of ``intervals`` outside ``covered`` (both disjoint and sorted), and their union (the same)."""
    outside = 0.0
    j, n = 0, len(covered)
    for start, end in intervals:
        while j < n and covered[j][1] <= start:
            j += 1
        at, k = start, j
        while k < n and covered[k][0] < end:
            if covered[k][0] > at:
                outside += covered[k][0] - at
            at = max(at, covered[k][1])
            k += 1
        if end > at:
            outside += end - at
    return outside, _merged(sorted(intervals + covered))


def time_split(trace: Trace) -> list[TimeSplit]:
    """Each trace rank's time over the iteration, split into compute busy, exposed communication by kind and bubble
    (module docstring); ``compute_s + Σ exposed_s + bubble_s`` is the makespan, up to rounding."""
    per_rank: list[list[list[tuple[float, float]]]] = [[[] for _ in range(len(COMM_KINDS) + 1)]
                                                      for _ in range(trace.num_ranks)]
    of_kind = _CLASS_OF_KIND.get
    for span in trace.spans:  # in start order, so every list below is sorted by start
        start, end = span.start, span.end
        if end > start:
            found = of_kind(span.kind)
            per_rank[span.rank][(_CLASS_OF_STREAM[span.stream] if found is None else found) + 1].append((start, end))
    window = trace.makespan
    splits = []
    for classes in per_rank:
        covered = _merged(classes[0])
        compute = sum(end - start for start, end in covered)
        exposed = {}
        for kind, intervals in zip(COMM_KINDS, classes[1:]):
            exposed[kind], covered = _uncovered(_merged(intervals), covered) if intervals else (0.0, covered)
        seen = sum(end - start for start, end in covered)
        splits.append(TimeSplit(compute, exposed, max(0.0, window - seen)))
    return splits


def _split_fractions(busy_s: float, exposed_s: dict[str, float], bubble_s: float, whole: float) -> dict[str, Any]:
    """A device's (or the plan's) ``idle_fraction``, ``bubble_fraction`` and ``exposed_comm_fraction`` of ``whole``
    seconds."""
    if whole <= 0:
        return {"idle_fraction": 0.0, "bubble_fraction": 0.0, "exposed_comm_fraction": dict.fromkeys(COMM_KINDS, 0.0)}
    return {"idle_fraction": 1.0 - busy_s / whole, "bubble_fraction": bubble_s / whole,
            "exposed_comm_fraction": {kind: exposed_s[kind] / whole for kind in COMM_KINDS}}


def rank_label(rank: int, device: str, device_rank: int | None = None) -> str:
    """How the Gantt chart and the printed summary both name a trace rank: ``r1 a100-sxm4-80gb``, or for a 3D plan,
    whose trace shows one device per pipeline rank (``device_rank``: the topology device it ran on),
    ``r1 gpu2 a100-sxm4-80gb``, so that the table and the chart name the same device the same way."""
    return f"r{rank} {device}" if device_rank is None else f"r{rank} gpu{device_rank} {device}"


def plan_header(plan: Plan, *, costs: str | None = None) -> dict[str, Any]:
    """The ``plan`` object of every ``metrics.json``, simulated or measured: what ran, where, split how.

    Args:
        plan: the plan.
        costs: where the durations come from (:func:`sim.predict.describe_cost_source`), for a prediction.
    """
    header: dict[str, Any] = {
        "schedule": plan.schedule, "model": plan.model, "topology": plan.topology,
        "layers_per_stage": list(plan.placement.layer_counts()),
        "vstage_to_rank": list(plan.placement.vstage_to_rank), "recompute": bool(plan.option("recompute")),
    }
    if plan.option("recompute") == "selective":
        header["recompute"] = "selective"
        # the option sim.cost.plan_settings.RECOMPUTE_MODULES_OPTION names, present when not the default modules
        if plan.option("recompute_modules") is not None:
            header["recompute_modules"] = plan.option("recompute_modules")
    if plan.parallel is not None:
        layout = plan.parallel
        header["parallel"] = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "order": layout.order,
                              "sequence_parallel": layout.sequence_parallel, "zero": layout.zero,
                              "devices": layout.world_size}
    if costs is not None:
        header["costs"] = costs
    return header


def compute_metrics(
    trace: Trace,
    *,
    num_microbatches: int,
    microbatch_size: int,
    peak_memory_bytes: Sequence[int] | None = None,
    memory_capacity_bytes: Sequence[float] | None = None,
    reserved_memory_bytes: Sequence[int | None] | None = None,
    link_bytes: Sequence[tuple[tuple[str, str], int]] = (),
    replicas: int = 1,
    device_of_rank: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The ``metrics.json`` object of one iteration.

    Args:
        trace: the iteration's spans.
        num_microbatches: microbatches in the iteration.
        microbatch_size: samples per microbatch.
        peak_memory_bytes: per-rank peak memory, bytes (omitted from the output when unknown).
        memory_capacity_bytes: per-rank device memory, bytes.
        reserved_memory_bytes: per-rank peak the GPU's caching allocator reserves (:mod:`sim.cost.allocator`),
            bytes; ``None`` for a rank without one (a CPU), omitted from its entry.
        link_bytes: ``((src, dst), bytes)`` carried by each directed link.
        replicas: data-parallel replicas, each running ``num_microbatches`` microbatches (throughput counts all).
        device_of_rank: the topology device each trace rank ran on, when it is not the trace rank itself (a 3D
            plan's trace shows one device per pipeline rank); written as each device's ``device_rank``.

    Returns:
        ``iteration_time_s`` (s), ``throughput_samples_per_s``, the plan's ``idle_fraction`` (1 − Σ compute busy ÷
        (devices × iteration time)), ``bubble_fraction`` and ``exposed_comm_fraction`` (per kind of
        :data:`COMM_KINDS`; module docstring), per-device ``rank``, ``device``, ``busy_s`` and the same three
        fractions of its own time, ``peak_memory_bytes`` (allocated), ``reserved_memory_bytes`` (on a GPU), per-kind
        op counts and mean durations, and bytes per link.
    """
    iteration = trace.makespan
    busy = [0.0] * trace.num_ranks
    # Durations as C doubles (8 bytes each, not a 24-byte float object and an 8-byte slot): the mean is still
    # sum() over them in trace order, the same figure as over a list.
    per_kind: dict[str, array[float]] = defaultdict(lambda: array("d"))
    for span in trace.spans:
        duration = span.end - span.start
        if span.stream == "compute":
            busy[span.rank] += duration
        per_kind[span.kind].append(duration)
    splits = time_split(trace)
    devices = []
    for rank, device in enumerate(trace.devices):
        split = splits[rank]
        entry: dict[str, Any] = {
            "rank": rank,
            **({"device_rank": int(device_of_rank[rank])} if device_of_rank is not None else {}),
            "device": device,
            "busy_s": busy[rank],
            **_split_fractions(busy[rank], split.exposed_s, split.bubble_s, iteration),
        }
        if peak_memory_bytes is not None:
            entry["peak_memory_bytes"] = int(peak_memory_bytes[rank])
        if reserved_memory_bytes is not None and reserved_memory_bytes[rank] is not None:
            entry["reserved_memory_bytes"] = int(reserved_memory_bytes[rank])
        if memory_capacity_bytes is not None:
            capacity = memory_capacity_bytes[rank]
            entry["memory_capacity_bytes"] = int(capacity) if capacity != float("inf") else None
        devices.append(entry)
    samples = num_microbatches * microbatch_size * replicas
    return {
        "iteration_time_s": iteration,
        "throughput_samples_per_s": samples / iteration if iteration > 0 else None,
        **_split_fractions(sum(busy), {kind: sum(split.exposed_s[kind] for split in splits) for kind in COMM_KINDS},
                           sum(split.bubble_s for split in splits), trace.num_ranks * iteration),
        "num_microbatches": num_microbatches,
        "microbatch_size": microbatch_size,
        **({"replicas": replicas} if replicas != 1 else {}),
        "devices": devices,
        "ops": {kind: {"count": len(d), "mean_duration_s": sum(d) / len(d)} for kind, d in sorted(per_kind.items())},
        "links": [{"src": src, "dst": dst, "bytes": nbytes} for (src, dst), nbytes in link_bytes],
    }
