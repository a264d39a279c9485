"""The baselines NASPipe is compared with, on the same supernet and subnet sequence as a CSP run (NASPipe §6).

NASPipe (ASPLOS'22 §6, Figure 5) measures CSP against pipelines that train one subnet per minibatch without knowing
about layer sharing. Here each baseline gets exactly the subnets, partition, topology and per-stage costs that
:func:`sim.csp.csp_plan.build_csp_problem` gives CSP, so the only difference is the schedule:

* ``gpipe`` / ``1f1b`` with a flush between subnets (reproducible, slow): subnet b is one iteration of the static
  schedule, its minibatch split into ``m`` microbatches, followed by the optimizer step; the next subnet starts when
  that iteration has ended on every stage, so every update lands before any later forward and the result equals
  sequential training. Each iteration is simulated by :mod:`sim.engine.simpy_engine` on the subnet's own layer graph
  (its chosen candidates' FLOPs and bytes), and the run takes the sum. Their devices hold the whole supernet share of
  their stage (GPipe keeps the supernet on the GPUs, which is why it cannot run NASPipe's largest space).
* ``pipedream`` (fast, not reproducible): PipeDream's asynchronous 1F1B with weight stashing, one minibatch per
  subnet, an update after each backward, no flush and no causal dependencies: a subnet's forward may read a layer
  that an earlier subnet has not updated yet. It is the CSP simulation with no sharing (``sharing="none"``) and at
  most ``p`` subnets in flight, PipeDream's steady-state bound (``p - r`` minibatches on stage r, §3.2), and keeps
  ``p - r - 1`` stashed versions of the in-flight subnets' layers on stage r.

The CSP ablations (one at a time, copy on demand, every layer resident) are options of
:func:`sim.csp.simulate.simulate_csp` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.csp.csp_plan import CspInputs, build_csp_problem
from sim.csp.problem import CspProblem
from sim.csp.simulate import simulate_csp
from sim.engine.simpy_engine import simulate
from sim.ir.plan import Placement
from sim.models.graph import LayerGraph
from sim.models.supernet import Supernet, subnet_layer_costs
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs

__all__ = ["BASELINES", "BaselineRun", "run_baseline", "flush_baseline", "pipedream_baseline",
           "stage_supernet_bytes", "stage_subnet_bytes"]

#: Baseline schedules on a subnet sequence, and whether each is reproducible (equals sequential training).
BASELINES = {"gpipe": True, "1f1b": True, "pipedream": False}


@dataclass(frozen=True)
class BaselineRun:
    """One baseline over a subnet sequence.

    Attributes:
        schedule: ``gpipe``, ``1f1b`` or ``pipedream``.
        makespan_s: time to train every subnet, s.
        subnets_per_s: subnets trained per second.
        microbatches: microbatches per subnet (1 for pipedream: one minibatch per subnet).
        reproducible: whether the result equals training the subnets one by one.
        device_param_bytes: per stage, the parameter bytes the device holds at most (stashed versions included).
    """

    schedule: str
    makespan_s: float
    subnets_per_s: float
    microbatches: int
    reproducible: bool
    device_param_bytes: tuple[int, ...]


def stage_supernet_bytes(supernet: Supernet, stage_layers: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Per stage, the parameter bytes of every layer of the supernet it holds (every candidate of its blocks), bytes."""
    graph = supernet.graph
    return tuple(sum(graph.layers[i].param_bytes for i in range(start, end)) for start, end in stage_layers)


def stage_subnet_bytes(supernet: Supernet, stage_layers: tuple[tuple[int, int], ...],
                       subnets: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Per stage, the largest parameter bytes one subnet uses there (its candidates plus shared layers), bytes."""
    largest = [0] * len(stage_layers)
    for choice in subnets:
        layers = subnet_layer_costs(supernet, choice)
        for k, (start, end) in enumerate(stage_layers):
            largest[k] = max(largest[k], sum(layer.param_bytes for layer in layers[start:end]))
    return tuple(largest)


def flush_baseline(inputs: CspInputs, schedule: str, microbatches: int) -> BaselineRun:
    """``gpipe`` or ``1f1b`` with a flush between subnets: the sum of one simulated iteration per subnet.

    Args:
        inputs: the CSP run's choices; ``inputs.microbatch_size`` samples per subnet are split into ``microbatches``
            microbatches.
        schedule: ``gpipe`` or ``1f1b``.
        microbatches: microbatches per subnet; must divide ``inputs.microbatch_size``.

    Raises:
        SpecError: a bad schedule or a minibatch that does not split evenly.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise SpecError(f"a flush baseline is gpipe or 1f1b, got {schedule!r}")
    if microbatches < 1 or inputs.microbatch_size % microbatches:
        raise SpecError(f"--baseline-microbatches {microbatches} must divide the subnet minibatch of "
                        f"{inputs.microbatch_size} samples")
    plan, setup, _ = build_csp_problem(inputs)
    supernet, topology = setup.supernet, setup.topology
    stage_layers, subnets = plan.placement.vstage_layers, plan.subnets
    graph = supernet.graph
    counts = ",".join(str(end - start) for start, end in stage_layers)
    size = inputs.microbatch_size // microbatches
    built = build_plan(PlanInputs(graph.spec, inputs.topology, schedule, microbatches, size, counts))
    placement = Placement(stage_layers, tuple(range(len(stage_layers))))
    total = 0.0
    cache: dict[tuple[int, ...], float] = {}
    for choice in subnets:
        if choice not in cache:
            sub = LayerGraph(graph.spec, subnet_layer_costs(supernet, choice), dtype_bytes=graph.dtype_bytes,
                             input_bytes=graph.input_bytes)
            result = simulate(built.plan, CostView(sub, topology, placement, size), topology, check_memory=False)
            cache[choice] = result.trace.makespan
        total += cache[choice]
    resident = stage_supernet_bytes(supernet, stage_layers)
    return BaselineRun(schedule, total, len(subnets) / total, microbatches, True, resident)


def pipedream_baseline(inputs: CspInputs) -> BaselineRun:
    """Asynchronous PipeDream on the subnet sequence: CSP's simulation with no sharing and ``p`` subnets in flight."""
    plan, setup, problem = build_csp_problem(inputs)
    supernet, stage_layers, subnets = setup.supernet, plan.placement.vstage_layers, plan.subnets
    p = problem.num_stages
    free = CspProblem(p, problem.uses, problem.fwd_s, problem.bwd_s, problem.update_s, problem.transfer_s, p)
    makespan = simulate_csp(free, sharing="none", prefetch="resident").makespan
    largest = stage_subnet_bytes(supernet, stage_layers, subnets)
    resident = stage_supernet_bytes(supernet, stage_layers)
    stashed = tuple(resident[r] + (p - r - 1) * largest[r] for r in range(p))
    return BaselineRun("pipedream", makespan, len(subnets) / makespan, 1, False, stashed)


def run_baseline(inputs: CspInputs, schedule: str, microbatches: int = 8) -> BaselineRun:
    """Any of :data:`BASELINES` on ``inputs``' subnet sequence; ``microbatches`` applies to gpipe and 1f1b."""
    if schedule not in BASELINES:
        raise SpecError(f"baseline must be one of {', '.join(BASELINES)}, got {schedule!r}")
    if schedule == "pipedream":
        return pipedream_baseline(inputs)
    return flush_baseline(inputs, schedule, microbatches)
