"""The one prediction path: a plan and a cost source in, the simulated iteration and its metrics out.

``sim.run`` (what a user simulates), ``executor.run`` (the ``predicted`` side of ``compare.json``) and the
experiments all call :func:`predict`, so a prediction is made one way only: the model rebuilt from the plan's spec, the
plan's topology, one :class:`~sim.cost.oracle.CostOracle` for the plan's microbatch size and profile, and the engine
the plan's weight policy needs: the SimPy engine for a fixed program, NASPipe's CSP run (``sim.csp.simulate``) for a
``csp`` plan, whose programs are decided online.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sim.core.errors import SpecError
from sim.cost.allocator import reserved_bytes
from sim.cost.cost_view import CostView
from sim.cost.model_flops import training_rates
from sim.cost.oracle import CostOracle
from sim.cost.plan_costs import PlanCosts, written_plan_costs
from sim.cost.plan_settings import plan_state_shards
from sim.cost.precision import narrow_format
from sim.cost.profile import MeasuredProfile
from sim.csp.csp_metrics import csp_metrics
from sim.csp.csp_plan import check_csp_plan, csp_problem
from sim.csp.problem import CspResult
from sim.csp.simulate import simulate_csp
from sim.engine.perturbation import NONE, Perturbation
from sim.engine.simpy_engine import simulate
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.ir.trace import Trace
from sim.models.graph import LayerGraph
from sim.plan.build import BuiltPlan
from sim.report.interval import FEATURES, Regime, regime, shipped_index
from sim.report.metrics import compute_metrics, plan_header
from sim.report.partime import partime_metrics, real_time

__all__ = ["Prediction", "predict", "predict_built", "describe_cost_source"]


@dataclass(frozen=True)
class Prediction:
    """A simulated iteration of a plan (for a ``csp`` plan: its whole subnet sequence).

    Attributes:
        plan: the plan that was simulated.
        topology: its topology, parsed.
        trace: every op's span.
        peak_memory_bytes: per rank, the highest memory in use, bytes.
        link_bytes: ``((src, dst), bytes)`` carried by each directed link that was used (empty for csp).
        cost_source: one line saying where the durations come from (roofline, or which profile on which ranks).
        metrics: the ``metrics.json`` object: :func:`sim.report.metrics.compute_metrics`, the plan header and, for
            csp, :func:`sim.csp.csp_metrics.csp_metrics`.
        costs: the plan's cost view (``None`` for csp, whose costs differ per subnet).
        csp: the CSP run's decisions, stalls and copies (``None`` for fixed programs).
    """

    plan: Plan
    topology: Topology
    trace: Trace
    peak_memory_bytes: tuple[int, ...]
    link_bytes: tuple[tuple[tuple[str, str], int], ...]
    cost_source: str
    metrics: dict[str, Any]
    costs: CostView | None = None
    csp: CspResult | None = None


def predict(plan: Plan, profile: MeasuredProfile | None = None, *, topology: Topology | None = None,
            oracle: CostOracle | None = None, check_memory: bool = True, simulate_all: bool = False,
            perturbation: Perturbation = NONE) -> Prediction:
    """Simulate one iteration of ``plan`` with roofline costs, or ``profile``'s where it applies.

    Args:
        plan: a lowered, validated plan (``plan.json``).
        profile: a measured profile, or ``None`` for the hardware catalog's costs (the GPU kernel model for a GPT on
            GPUs, else the roofline).
        topology: the plan's topology when the caller has parsed it already (else parsed from ``plan.topology``).
        oracle: the cost oracle the plan was built with (``sim.plan.build.BuiltPlan.costs.oracle``; a built plan is
            predicted by :func:`predict_built`), so that its model and per-device layer costs are not computed
            again; it must be for the plan's model, microbatch size, topology and ``profile``.
        check_memory: fail when a device runs out of memory (``sim.engine.simpy_engine.OutOfMemoryError``); else
            only report the peaks.
        simulate_all: simulate every data-parallel replica even when they are identical (by symmetry one stands
            for all; this checks it).
        perturbation: stragglers and jitter (``sim.engine.perturbation``); with a straggler every replica is
            simulated. ``metrics.json`` then says what slowed the iteration and how many ops.

    Raises:
        SpecError: the plan's model or topology spec is invalid, the profile does not fit the model, or a profile
            is given for a csp plan (its subnets' layers are not what a profile measures).
        PlanError: the plan cannot be simulated (not lowered, deadlock).
    """
    topology = topology if topology is not None else Topology.parse(plan.topology)
    if perturbation.links:  # slow links: a topology of their own, so the costs are built again on it
        topology, oracle = perturbation.topology(topology), None
    if plan.weight_policy == "csp":
        if profile is not None:
            raise SpecError(f"a measured profile ({profile.source}) cannot cost a csp plan: a profile times the "
                            f"layers of one model, a csp plan trains subnets whose layers differ; csp uses the "
                            f"roofline")
        return _predict_csp(plan, topology)
    layout = plan.layout
    precision, compiled = plan.option("precision"), plan.option("compile", False) is True
    if oracle is None:
        costs = written_plan_costs(plan, topology, profile)
        oracle = costs.oracle
    elif (oracle.graph.spec, oracle.microbatch_size, oracle.profile, oracle.topology, oracle.shards,
          oracle.cuda_graphs, oracle.narrow, oracle.compiled) != (
            plan.model, plan.microbatch_size, profile, topology, plan_state_shards(layout),
            bool(plan.option("cuda_graphs", False)), narrow_format(precision), compiled):
        raise ValueError(f"the cost oracle is for {oracle.graph.spec} at {oracle.microbatch_size} sample(s) per "
                         f"microbatch, not this plan's {plan.model} at {plan.microbatch_size}, or for another "
                         f"profile, topology or ZeRO sharding")
    else:
        costs = PlanCosts(oracle.graph, oracle, layout)
    if perturbation and plan.weight_policy in ("csp", "stream"):
        raise SpecError(f"--straggler and --jitter slow a fixed schedule's iteration; a {plan.weight_policy} plan is "
                        f"not modelled with them")
    views = costs.views(plan.placement, simulate_all=simulate_all or bool(perturbation.stragglers))
    result = simulate(plan, views, topology, check_memory=check_memory, perturbation=perturbation)
    cost_source = describe_cost_source(oracle, plan.num_ranks)
    devices = [view.device_index_of(p) for view in views for p in range(plan.num_ranks)]
    metrics = compute_metrics(
        result.trace,
        num_microbatches=plan.num_microbatches,
        microbatch_size=plan.microbatch_size,
        peak_memory_bytes=result.peak_memory_bytes,
        memory_capacity_bytes=[topology.devices[d].memory_bytes for d in devices],
        reserved_memory_bytes=[reserved_bytes(peak, topology.devices[d])
                               for peak, d in zip(result.peak_memory_bytes, devices, strict=True)],
        link_bytes=result.link_bytes,
        replicas=layout.dp,
        device_of_rank=devices if plan.parallel is not None else None,
    )
    metrics["plan"] = plan_header(plan, costs=cost_source)
    if perturbation:
        metrics["perturbation"] = {
            "stragglers": [{"device": s.device, "factor": s.factor, "start_s": s.start_s,
                            "end_s": s.end_s if s.end_s != float("inf") else None} for s in perturbation.stragglers],
            "links": [{"links": link.selector, "factor": link.factor} for link in perturbation.links],
            "jitter": perturbation.jitter, "seed": perturbation.seed, "slowed_ops": len(result.slowed_ops)}
    metrics.update(training_rates(plan, topology, metrics["iteration_time_s"]))
    metrics.update(prediction_intervals(metrics, regime_of(plan, topology, costs.graph)))
    if plan.weight_policy == "stream":
        metrics["stream"] = _stream(plan, result.trace, views, topology, check_memory)
    return Prediction(plan, topology, result.trace, result.peak_memory_bytes, result.link_bytes, cost_source,
                      metrics, costs=views[0])


def regime_of(plan: Plan, topology: Topology, graph: LayerGraph) -> Regime:
    """The regime of ``plan`` on ``topology``, its devices holding ``graph`` (its model shard;
    :func:`sim.report.interval.regime`)."""
    layout = plan.parallel
    ranks = layout.device_ranks if layout is not None else tuple(range(plan.num_ranks))
    precision = plan.option("precision") or ("fp32" if graph.dtype_bytes == 4 else "bf16")
    degrees = ({"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "pp": layout.pp, "dp": layout.dp}
               if layout is not None else {"pp": plan.num_ranks})
    return regime([topology.devices[d].hardware.name for d in ranks], graph.spec.partition(":")[0], str(precision),
                  degrees, layout.zero if layout is not None else 0)


def prediction_intervals(metrics: dict[str, Any], regime: Regime) -> dict[str, Any]:
    """The ``metrics.json`` entries of a prediction's intervals (:mod:`sim.report.interval`): its ``regime``, and
    ``iteration_time_s_interval`` and (for a model with tokens) ``tokens_per_s_per_device_interval``, each with
    ``low``/``high`` (``null`` where nothing calibrates it), its ``level``, the published ``runs`` it is calibrated
    on, the regime's features they share (``matched``) and those they do not (``relaxed``: empty inside a validated
    regime), from the shipped residuals."""
    calibration = shipped_index().calibrate(regime)
    common = {"level": calibration.level, "runs": calibration.runs, "matched": list(calibration.matched),
              "relaxed": list(calibration.relaxed)}
    time_s = metrics["iteration_time_s"]
    time = calibration.time_interval(time_s) if time_s else None
    entries: dict[str, Any] = {
        "regime": {name: getattr(regime, name) for name in FEATURES},
        "iteration_time_s_interval": {"low": time[0] if time else None, "high": time[1] if time else None, **common},
    }
    rate = metrics.get("tokens_per_s_per_device")
    if rate is not None:
        tokens = calibration.rate_interval(rate)
        entries["tokens_per_s_per_device_interval"] = {"low": tokens[0] if tokens else None,
                                                       "high": tokens[1] if tokens else None, **common}
    return entries


def predict_built(built: BuiltPlan, *, check_memory: bool = True, simulate_all: bool = False,
                  perturbation: Perturbation = NONE) -> Prediction:
    """:func:`predict` of a plan just built by :func:`sim.plan.build.build_plan`, with the topology, profile and cost
    oracle it was built with (its model and per-device layer costs are not computed again).

    Args:
        built: the built plan.
        check_memory: fail when a device runs out of memory; else only report the peaks.
        simulate_all: simulate every data-parallel replica even when they are identical.
        perturbation: stragglers and jitter (:func:`predict`).
    """
    return predict(built.plan, built.profile, topology=built.topology, oracle=built.costs.oracle,
                   check_memory=check_memory, simulate_all=simulate_all, perturbation=perturbation)


def _stream(plan: Plan, trace: Trace, views: tuple, topology: Topology, check_memory: bool) -> dict[str, Any]:
    """The stream metrics of a PARTIME plan (``sim.report.partime``); with a live source (option ``fps``) also the
    same plan simulated unpaced, whose step time is the sustainable rate that real time is judged against."""
    fps = plan.option("fps")
    found = partime_metrics(trace, num_stages=plan.num_vstages, num_frames=plan.num_microbatches, fps=fps)
    if fps:
        unpaced_plan = replace(plan, options=tuple(item for item in plan.options if item[0] != "fps"))
        unpaced = simulate(unpaced_plan, views, topology, check_memory=check_memory).trace
        found["real_time"] = real_time(found, partime_metrics(unpaced, num_stages=plan.num_vstages,
                                                              num_frames=plan.num_microbatches, fps=None))
    return found


def _predict_csp(plan: Plan, topology: Topology) -> Prediction:
    setup = check_csp_plan(plan, topology)
    result = simulate_csp(csp_problem(plan, setup), one_at_a_time=plan.option("one_at_a_time", False),
                          prefetch=plan.option("prefetch", "resident"))
    cost_source = "roofline (hardware catalog), per subnet's own candidates"
    peaks = result.peak_memory_bytes
    metrics = compute_metrics(result.trace, num_microbatches=plan.num_microbatches,
                              microbatch_size=plan.microbatch_size, peak_memory_bytes=peaks,
                              memory_capacity_bytes=[d.memory_bytes for d in topology.devices[: plan.num_ranks]])
    metrics["plan"] = plan_header(plan, costs=cost_source)
    metrics["csp"] = csp_metrics(plan, result)
    return Prediction(plan, topology, result.trace, peaks, (), cost_source, metrics, csp=result)


def describe_cost_source(oracle: CostOracle, num_ranks: int) -> str:
    """Where the simulated durations of the first ``num_ranks`` ranks come from, in one line: the GPU kernel model or
    the roofline, or which profile, on which ranks (as the oracle applies it), and whether transfers take its
    measured p2p fit."""
    profile = oracle.profile
    ranks = oracle.profiled_ranks(num_ranks) if profile is not None else ()
    others = tuple(rank for rank in range(min(num_ranks, oracle.topology.num_ranks)) if rank not in ranks)
    modelled = _modelled_costs(oracle, others)
    if profile is None:
        return f"{modelled} (hardware catalog)" if modelled == "roofline" else modelled
    where = f"ranks {_rank_ranges(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}" if ranks else "no rank"
    p2p = "measured p2p" if oracle.uses_measured_p2p(num_ranks) else "link model for p2p"
    return (f"measured profile {profile.source} ({profile.device}, {profile.microbatch_size} sample(s) per "
            f"microbatch) on {where}, {modelled} elsewhere; {p2p}")


def _modelled_costs(oracle: CostOracle, ranks: tuple[int, ...]) -> str:
    """How ``ranks`` (no profile applies to them) are costed: the GPU kernel model where the model is a GPT and the
    rank a GPU (``sim.cost.gpu_time``), else the roofline."""
    gpus = tuple(rank for rank in ranks if oracle.kernel_model_applies(oracle.device_spec(rank)))
    if not gpus:
        return "roofline"
    if len(gpus) == len(ranks):
        return "GPU kernel model (profiles/hardware/kernel_model.yaml)"
    return f"GPU kernel model on rank{'s' * (len(gpus) > 1)} {_rank_ranges(gpus)}, roofline on the others"


def _rank_ranges(ranks: tuple[int, ...]) -> str:
    """Sorted ranks in run-length form: ``(0, 1, 4, 5, 7)`` → ``"0-1, 4-5, 7"``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
