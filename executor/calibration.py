"""Calibration (``executor.run --calibrate-out``): a run turned into a profile for the simulator (DESIGN §7).

The profile holds the per-stage medians of F, B and OPT_STEP measured in place, with every rank busy, which on a
shared CPU is 30–60% slower than the same op measured alone, each plus the executor's own time between two ops
(:func:`dispatch_time`), which no op's span contains and the simulator has no op for. A stage's measured time is
split over its layers in proportion to the prior per-layer estimate (the cost oracle with the profile or roofline the
plan was simulated with), so the stage sums are the measured ones exactly and the layer shares keep the prior's
shape; the point-to-point fit comes from a ping-pong sweep run inside the same process group (:data:`P2P_METHOD`). It is
written by the one profile writer, :func:`sim.cost.profile.profile_document`.

A calibration says how far it can be trusted: the profile's ``method.stability`` (:func:`stage_stability`: samples
per stage, spread, and how far the stage medians moved between the first and the second half of the run) and a
warning on stderr when the run was short or the machine's speed changed while it measured; its ``p2p`` adds the
latencies of the run's transfers split by which side posted last (:func:`posting_order_latencies`): a message
the receiver was already waiting for crosses in a few hundred µs, one the sender had posted first in milliseconds,
and the simulator's single latency is the latter's, the kind its critical path is made of.

The profile is labelled with the device the ranks were measured on (:func:`profile_device`), not the device the
plan names: a plan for V100s run on this host's CPU (no CUDA here, or ``--backend gloo``) yields a ``cpu`` profile,
which ``sim.run`` then applies to ``cpu`` ranks only, where the numbers are true. Ranks on different kinds of
device, or on a CUDA device the hardware catalog has no id for, cannot make one profile and are refused
(``executor.run`` checks this before launch where it can see the devices).
"""

from __future__ import annotations

import platform
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from executor.provenance import catalog_id_for_gpu
from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.oracle import CostOracle
from sim.cost.p2p_fit import fit_latency_bandwidth
from sim.cost.profile import profile_document
from sim.hw.catalog import get_device
from sim.ir.ops import OP_SEMANTICS, RECV_KINDS
from sim.ir.plan import OpKind, Plan
from sim.ir.trace import Span, Trace
from sim.models.graph import LayerGraph

__all__ = ["stage_medians", "stage_stability", "dispatch_time", "calibrated_profile", "device_catalog_id",
           "profile_device", "in_place_p2p", "posting_order_latencies", "P2P_METHOD", "MIN_STABLE_ITERATIONS",
           "MAX_HALF_DRIFT"]

# The kinds whose measured medians calibrate the profile's per-layer costs: F its forward, B its backward, OPT_STEP
# its optimizer step (the fields fwd, bwd and opt of ``sim.cost.oracle.LayerCosts``), the first two required of every
# stage; spans carry kinds spelt. Not the op table's to say: it is what a profile has fields for.
_REQUIRED = (OpKind.F.value, OpKind.B.value)
_CALIBRATED = frozenset((*_REQUIRED, OpKind.OPT_STEP.value))
_RECEIVES = frozenset(kind.value for kind in RECV_KINDS)

#: A calibration over fewer measured iterations warns. The optimizer step runs once per iteration, so its median is
#: over this many samples only; and a short run is more likely to fall entirely into a burst of load from another
#: process. On the 2-core development box, three 4-iteration calibrations of the README's demo predicted the same
#: GPipe run with errors from -28 % to +12 %.
MIN_STABLE_ITERATIONS = 8
#: A stage whose median F or B moved by more than this fraction between the first and the second half of the
#: calibration's iterations means the machine's speed changed while it measured (another process started or
#: stopped); the calibration warns, since a profile that moved that much cannot predict within the issue's 3 %.
MAX_HALF_DRIFT = 0.03


P2P_METHOD = (
    "bandwidth: least-squares fit of a ping-pong sweep between ranks 0 and 1 inside the run's process group, "
    "converted to the model graph's bytes (the executor sends fp32 tensors, the graph counts its own dtype); "
    "latency: mean over the run's sender-first transfers (the receiver posted after the sender: see "
    "latency_by_posting_order) of (measured wire time - bytes / bandwidth), or over all transfers when there is no "
    "sender-first one. A pipeline's critical path runs through its busiest rank, which posts each receive late, when "
    "its sender has long posted the send, so those are the messages whose time adds up along it; on a busy CPU it "
    "is mostly the wake-up of the sender's transport thread. The mean, not the median, because transfer times add up"
)


def in_place_p2p(plan, costs: CostView, measured, sweep) -> tuple[float, float] | None:
    """``(latency s, bandwidth in graph bytes/s)`` for the calibrated profile (see :data:`P2P_METHOD`)."""
    from executor.nn.stages import boundary_specs

    try:
        _, bandwidth = fit_latency_bandwidth(sweep[0], sweep[1])
    except SpecError as exc:  # a sweep too noisy to fit (timer-tick wake-ups on a busy VM): keep the link model
        print(f"warning: no point-to-point fit in the calibrated profile ({exc})", file=sys.stderr)
        return None
    starts = [start for start, _ in plan.placement.vstage_layers]
    real = boundary_specs(plan.model, starts, plan.microbatch_size)
    ratios = []
    for trace in measured:
        for span in trace.spans:
            if span.kind in _RECEIVES:
                # RECV_F of v carries v's input; RECV_B of v carries the gradient of v's output (v + 1's input).
                vstage = span.vstage if span.kind == OpKind.RECV_F.value else span.vstage + 1
                ratios.append(costs.message_bytes(OpKind(span.kind), span.vstage) / real[starts[vstage]].nbytes)
    if not ratios:
        return None
    graph_bandwidth = bandwidth * statistics.median(ratios)
    split = posting_order_latencies(costs, measured, graph_bandwidth)
    chosen = split["sender_first"] if split["sender_first"]["count"] else split["all"]
    return max(0.0, chosen["latency_s"]), graph_bandwidth


def posting_order_latencies(costs: CostView, measured: Sequence[Trace], bandwidth: float) -> dict[str, Any]:
    """The run's message latencies split by which side posted last.

    A transfer's measured span starts when both sides had posted (``executor.measured``). If the receiver posted
    first it is already waiting, and gloo writes the data from the sender's ``isend`` call (receiver first); if the
    sender posted first, the data leaves only when the sender's transport thread is woken by the receiver's
    request while its main thread computes (sender first), which on a busy 2-core host takes milliseconds. Which
    happens depends on the schedule and the stages' balance, which the simulator's one latency cannot see: it takes
    the sender-first latency (:data:`P2P_METHOD`), and the split is written to the profile to show how far apart
    the two are.

    Args:
        costs: the plan's cost view (message sizes in graph bytes).
        measured: the measured iterations.
        bandwidth: the fitted bandwidth in graph bytes/s.

    Returns:
        ``{"receiver_first": {"count", "latency_s"}, "sender_first": {...}, "all": {...}}``: per class the number of
        transfers and their mean (duration - bytes / bandwidth) in s (``None`` with none); ``all`` also counts
        transfers whose producing op is not in the trace. The sender counts as first when the data's producing op
        ended before the receiver's previous compute op did.
    """
    samples: dict[str, list[float]] = {"receiver_first": [], "sender_first": [], "all": []}
    for trace in measured:
        ends = {(span.kind, span.vstage, span.mb): span.end for span in trace.spans}
        compute = defaultdict(list)
        for span in trace.spans:
            if span.stream == "compute":
                compute[span.rank].append(span.end)
        for span in trace.spans:
            if span.kind not in _RECEIVES:
                continue
            # What the message carries was made by the sender's F (the previous vstage's), or its B or I (the next
            # vstage's input gradient; I under zero-bubble schedules): the first of those the trace has.
            sender = span.vstage - 1 if span.kind == OpKind.RECV_F.value else span.vstage + 1
            produced = next((ends[key] for key in ((source.value, sender, span.mb)
                                                   for source in OP_SEMANTICS[OpKind(span.kind)].follows)
                             if key in ends), None)
            latency = span.duration - costs.message_bytes(OpKind(span.kind), span.vstage) / bandwidth
            samples["all"].append(latency)
            if produced is None:
                continue
            receiver_free = max((end for end in compute[span.rank] if end <= span.start), default=0.0)
            samples["sender_first" if produced < receiver_free else "receiver_first"].append(latency)
    return {order: {"count": len(values), "latency_s": statistics.fmean(values) if values else None}
            for order, values in samples.items()}


def dispatch_time(measured: Sequence[Trace]) -> float:
    """The executor's own time per op, s: the median gap from one compute op's end to the next one's start on the
    same rank, over the pairs where no receive of that rank completed in between (the rank had its inputs and
    went straight on). It is what the interpreter does between the spans it times (posting sends and receives,
    bookkeeping in Python), which no span contains: 0.15-0.5 ms per op on the 2-core development box, about 1 % of
    an iteration there. 0 with no such pair."""
    gaps = []
    for trace in measured:
        compute: dict[int, list[Span]] = defaultdict(list)
        received: dict[int, list[float]] = defaultdict(list)
        for span in trace.spans:
            if span.stream == "compute":
                compute[span.rank].append(span)
            elif span.kind in _RECEIVES:
                received[span.rank].append(span.end)
        for rank, spans in compute.items():
            spans.sort(key=lambda span: span.start)
            for before, after in zip(spans, spans[1:]):
                if not any(before.end < end <= after.start for end in received[rank]):
                    gaps.append(max(0.0, after.start - before.end))
    return statistics.median(gaps) if gaps else 0.0


def stage_stability(measured: Sequence[Trace]) -> dict[str, Any]:
    """How far the stage medians of :func:`stage_medians` can be trusted: samples and drift over the run.

    Returns:
        ``iterations``; ``samples``: per op kind (F, B, OPT_STEP) the fewest samples any stage's median is over;
        ``max_relative_iqr``: the largest interquartile range of a stage's F or B durations over its median;
        ``max_half_drift``: the largest |median of the second half of the iterations - median of the first half|
        over the median of all, for a stage's F or B (0 with fewer than 2 iterations, where there are no halves).
    """
    def by_stage(traces: Sequence[Trace]) -> dict[tuple[int, str], list[float]]:
        samples: dict[tuple[int, str], list[float]] = defaultdict(list)
        for trace in traces:
            for span in trace.spans:
                if span.kind in _CALIBRATED:
                    samples[(span.vstage, span.kind)].append(span.duration)
        return samples

    every = by_stage(measured)
    counts: dict[str, int] = {}
    for (_, kind), values in every.items():
        counts[kind] = min(counts.get(kind, len(values)), len(values))
    half = len(measured) // 2
    first, second = by_stage(measured[:half]), by_stage(measured[half:])
    iqr, drift = 0.0, 0.0
    for key, values in every.items():
        if key[1] == OpKind.OPT_STEP.value:
            continue
        median = statistics.median(values)
        if median <= 0:
            continue
        if len(values) >= 2:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
            iqr = max(iqr, (q3 - q1) / median)
        if first.get(key) and second.get(key):
            drift = max(drift, abs(statistics.median(second[key]) - statistics.median(first[key])) / median)
    return {"iterations": len(measured), "samples": dict(sorted(counts.items())), "max_relative_iqr": iqr,
            "max_half_drift": drift}


def stage_medians(measured: Sequence[Trace]) -> dict[tuple[int, str], float]:
    """Median duration of each (vstage, kind) over all microbatches and iterations, for F, B and OPT_STEP, s."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for trace in measured:
        for span in trace.spans:
            if span.kind in _CALIBRATED:
                samples[(span.vstage, span.kind)].append(span.duration)
    return {key: statistics.median(values) for key, values in sorted(samples.items())}


def _split(total: float, prior: Sequence[float]) -> list[float]:
    """``total`` split in proportion to ``prior`` (evenly when the prior is all zero)."""
    weight = sum(prior)
    if weight <= 0:
        return [total / len(prior)] * len(prior)
    return [total * p / weight for p in prior]


def device_catalog_id(name: str) -> str | None:
    """The hardware-catalog id of a device a rank reported: ``"cpu"``, or a CUDA device name looked up as
    ``profiles.measure`` does (:func:`executor.provenance.catalog_id_for_gpu`: ``"NVIDIA H100 80GB HBM3"`` →
    ``"h100-sxm5-80gb"``); ``None`` if it has none."""
    return "cpu" if name == "cpu" else catalog_id_for_gpu(name)


def profile_device(measured_names: Sequence[str]) -> str:
    """The catalog id a calibrated profile is labelled with: the one device every rank was measured on.

    Args:
        measured_names: per rank, the device it runs on, as :class:`executor.measured.RankReport` names it
            (``"cpu"`` or ``torch.cuda.get_device_name``).

    Raises:
        SpecError: the ranks ran on different kinds of device, or on a CUDA device with no catalog id.
    """
    ids = {name: device_catalog_id(name) for name in measured_names}
    unknown = sorted(name for name, found in ids.items() if found is None)
    if unknown:
        raise SpecError(f"{{calibrate_out}}: the ranks run on {', '.join(map(repr, unknown))}, which the hardware "
                        f"catalog (profiles/hardware/devices.yaml) has no id for; a profile must name a catalog device",
                        "calibrate_out")
    kinds = sorted(set(ids.values()))
    if len(kinds) != 1:
        raise SpecError(f"{{calibrate_out}} needs every rank on one device kind (a profile names one), but the "
                        f"ranks run on {', '.join(kinds) or 'no device'}", "calibrate_out")
    return kinds[0]


def calibrated_profile(plan: Plan, graph: LayerGraph, prior: CostView, medians: dict[tuple[int, str], float], *,
                       device: str, p2p: tuple[float, float] | None, machine: dict[str, Any],
                       software: dict[str, Any], iterations: int,
                       measured: Sequence[Trace] | None = None) -> dict[str, Any]:
    """A measured-profile JSON object (``profiles/README.md``) from in-place stage medians.

    Args:
        plan: the plan that ran.
        graph: its model.
        prior: the cost model the plan was simulated with; its profile (if any) with the roofline of ``device`` sets
            each layer's share of its stage's time.
        medians: :func:`stage_medians` of the measured iterations, s.
        device: catalog id of the device every rank ran on (:func:`profile_device`); the profile's ``device``.
        p2p: ``(latency s, bandwidth bytes/s)`` fitted in place, or ``None``.
        machine, software: provenance.
        iterations: how many iterations the medians are over.
        measured: the measured iterations themselves; when given, every op's median gets their
            :func:`dispatch_time` added (``method.dispatch_s``), the profile's method records their
            :func:`stage_stability` (and warns on stderr when the run was too short or the machine's speed moved
            during it, :data:`MIN_STABLE_ITERATIONS`, :data:`MAX_HALF_DRIFT`), and its ``p2p`` the
            :func:`posting_order_latencies`.

    Raises:
        SpecError: ``device`` is not in the catalog, or a stage has no measured F or B.
    """
    device_spec = get_device(device)
    base = CostOracle(graph, plan.microbatch_size, prior.profile).layer_costs(device_spec)
    # Each op is charged the executor's time before it, which the simulator has no op for (dispatch_time).
    dispatch = dispatch_time(measured) if measured is not None else 0.0
    medians = {key: value + dispatch if value > 0 else value for key, value in medians.items()}
    layers: list[dict[str, Any]] = []
    for v, (start, end) in enumerate(plan.placement.vstage_layers):
        for kind in _REQUIRED:
            if (v, kind) not in medians:
                raise SpecError(f"cannot calibrate: no measured {kind} for stage {v}")
        fwd = _split(medians[(v, OpKind.F.value)], base.fwd[start:end])
        bwd = _split(medians[(v, OpKind.B.value)], base.bwd[start:end])
        opt = _split(medians.get((v, OpKind.OPT_STEP.value), 0.0), base.opt[start:end])
        for i in range(start, end):
            layers.append({"name": graph.layers[i].name, "fwd_s": fwd[i - start], "bwd_s": bwd[i - start],
                           "opt_s": opt[i - start]})
    method = {
        "kind": "calibrated in place (executor.run --calibrate-out)",
        "plan": {"schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
                 "layers_per_stage": list(plan.placement.layer_counts()), "num_ranks": plan.num_ranks},
        "iterations": iterations,
        "statistic": "median over all microbatches and iterations after warm-up, per stage, plus dispatch_s; "
                     "split over the stage's layers in proportion to the prior estimate",
        "dispatch_s": dispatch,
        "prior": f"profile {prior.profile.source}" if prior.profile is not None else "roofline",
    }
    p2p_fields = None if p2p is None else {"latency_s": p2p[0], "bandwidth_bytes_per_s": p2p[1]}
    if measured is not None:
        method["stability"] = stability = stage_stability(measured)
        _warn_if_unstable(stability)
        if p2p_fields is not None:
            p2p_fields["latency_by_posting_order"] = posting_order_latencies(prior, measured, p2p[1])  # type: ignore[index]
    return profile_document(model=graph.spec, device=device_spec.name, microbatch_size=plan.microbatch_size,
                            layers=layers, method=method, machine={"hostname": platform.node(), **machine},
                            software=software, p2p=p2p_fields)


def _warn_if_unstable(stability: dict[str, Any]) -> None:
    """One stderr line per reason not to trust a calibration (the profile is written all the same)."""
    if stability["iterations"] < MIN_STABLE_ITERATIONS:
        print(f"warning: calibrated over {stability['iterations']} iteration(s); use --iterations "
              f">= {MIN_STABLE_ITERATIONS} for a profile that repeats from run to run", file=sys.stderr)
    if stability["max_half_drift"] > MAX_HALF_DRIFT:
        print(f"warning: a stage's median moved by {stability['max_half_drift'] * 100:.1f}% between the first and "
              f"the second half of the calibration (more than {MAX_HALF_DRIFT * 100:.0f}%): the machine's speed "
              f"changed while it measured; calibrate again when it is idle", file=sys.stderr)
