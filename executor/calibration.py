"""Calibration (``executor.run --calibrate-out``): a run turned into a profile for the simulator (DESIGN §7).

The profile holds the per-stage medians of F, B and OPT_STEP measured in place, with every rank busy, which on a
shared CPU is 30–60% slower than the same op measured alone. A stage's measured time is split over its layers in
proportion to the prior per-layer estimate (the cost oracle with the profile or roofline the plan was simulated
with), so the stage sums are the measured ones exactly and the layer shares keep the prior's shape; the
point-to-point fit comes from a ping-pong sweep run inside the same process group (:data:`P2P_METHOD`). It is
written by the one profile writer, :func:`sim.cost.profile.profile_document`.

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
from sim.cost.model import CostModel
from sim.cost.oracle import CostOracle
from sim.cost.p2p_fit import fit_latency_bandwidth
from sim.cost.profile import profile_document
from sim.hw.catalog import get_device
from sim.ir.plan import OpKind, Plan
from sim.ir.trace import Trace
from sim.models.graph import LayerGraph

__all__ = ["stage_medians", "calibrated_profile", "device_catalog_id", "profile_device", "in_place_p2p",
           "P2P_METHOD"]


P2P_METHOD = (
    "bandwidth: least-squares fit of a ping-pong sweep between ranks 0 and 1 inside the run's process group, "
    "converted to the model graph's bytes (the executor sends fp32 tensors, the graph counts its own dtype); "
    "latency: mean over the run's transfers of (measured wire time - real bytes / bandwidth), i.e. what a message "
    "costs while the ranks compute, which on a busy CPU is mostly the wake-up of the threads that move it; the mean, "
    "not the median, because transfer times add up along the critical path"
)


def in_place_p2p(plan, costs: CostModel, measured, sweep) -> tuple[float, float] | None:
    """``(latency s, bandwidth in graph bytes/s)`` for the calibrated profile (see :data:`P2P_METHOD`)."""
    from executor.nn.stages import boundary_specs

    try:
        _, bandwidth = fit_latency_bandwidth(sweep[0], sweep[1])
    except SpecError as exc:  # a sweep too noisy to fit (timer-tick wake-ups on a busy VM): keep the link model
        print(f"warning: no point-to-point fit in the calibrated profile ({exc})", file=sys.stderr)
        return None
    starts = [start for start, _ in plan.placement.vstage_layers]
    real = boundary_specs(plan.model, starts, plan.microbatch_size)
    samples, ratios = [], []
    for trace in measured:
        for span in trace.spans:
            if span.kind not in ("RECV_F", "RECV_B"):
                continue
            # RECV_F of v carries v's input; RECV_B of v carries the gradient of v's output (v + 1's input).
            vstage = span.vstage if span.kind == "RECV_F" else span.vstage + 1
            real_bytes = real[starts[vstage]].nbytes
            samples.append(span.duration - real_bytes / bandwidth)
            ratios.append(costs.message_bytes(OpKind(span.kind), span.vstage) / real_bytes)
    if not samples:
        return None
    return max(0.0, statistics.fmean(samples)), bandwidth * statistics.median(ratios)


def stage_medians(measured: Sequence[Trace]) -> dict[tuple[int, str], float]:
    """Median duration of each (vstage, kind) over all microbatches and iterations, for F, B and OPT_STEP, s."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    wanted = {OpKind.F.value, OpKind.B.value, OpKind.OPT_STEP.value}
    for trace in measured:
        for span in trace.spans:
            if span.kind in wanted:
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
        raise SpecError(f"--calibrate-out: the ranks run on {', '.join(map(repr, unknown))}, which the hardware "
                        f"catalog (profiles/hardware/devices.yaml) has no id for; a profile must name a catalog device")
    kinds = sorted(set(ids.values()))
    if len(kinds) != 1:
        raise SpecError(f"--calibrate-out needs every rank on one device kind (a profile names one), but the ranks "
                        f"run on {', '.join(kinds) or 'no device'}")
    return kinds[0]


def calibrated_profile(plan: Plan, graph: LayerGraph, prior: CostModel, medians: dict[tuple[int, str], float], *,
                       device: str, p2p: tuple[float, float] | None, machine: dict[str, Any],
                       software: dict[str, Any], iterations: int) -> dict[str, Any]:
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

    Raises:
        SpecError: ``device`` is not in the catalog, or a stage has no measured F or B.
    """
    device_spec = get_device(device)
    base = CostOracle(graph, plan.microbatch_size, prior.profile).layer_costs(device_spec)
    layers: list[dict[str, Any]] = []
    for v, (start, end) in enumerate(plan.placement.vstage_layers):
        for kind in ("F", "B"):
            if (v, kind) not in medians:
                raise SpecError(f"cannot calibrate: no measured {kind} for stage {v}")
        fwd = _split(medians[(v, "F")], base.fwd[start:end])
        bwd = _split(medians[(v, "B")], base.bwd[start:end])
        opt = _split(medians.get((v, "OPT_STEP"), 0.0), base.opt[start:end])
        for i in range(start, end):
            layers.append({"name": graph.layers[i].name, "fwd_s": fwd[i - start], "bwd_s": bwd[i - start],
                           "opt_s": opt[i - start]})
    method = {
        "kind": "calibrated in place (executor.run --calibrate-out)",
        "plan": {"schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
                 "layers_per_stage": list(plan.placement.layer_counts()), "num_ranks": plan.num_ranks},
        "iterations": iterations,
        "statistic": "median over all microbatches and iterations after warm-up, per stage; split over the "
                     "stage's layers in proportion to the prior estimate",
        "prior": f"profile {prior.profile.source}" if prior.profile is not None else "roofline",
    }
    return profile_document(model=graph.spec, device=device_spec.name, microbatch_size=plan.microbatch_size,
                            layers=layers, method=method, machine={"hostname": platform.node(), **machine},
                            software=software,
                            p2p=None if p2p is None else {"latency_s": p2p[0], "bandwidth_bytes_per_s": p2p[1]})
