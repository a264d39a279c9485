"""pipedejavu simulator: layer graphs, hardware and topologies, the schedule IR, schedules, the SimPy engine, outputs.

Typical use::

    from sim import PlanInputs, build_plan, simulate
    built = build_plan(PlanInputs("gpt:layers=48,hidden=2048", "16xV100", "1f1b", microbatches=32))
    result = simulate(built.plan, built.costs, built.topology)
    print(result.trace.makespan)

The command line is ``python -m sim.run`` (see its ``--help``) and ``python -m sim.bench``.
"""

from sim.engine import SimResult, simulate
from sim.errors import SpecError
from sim.graph import Layer, LayerGraph
from sim.ir import Op, OpKind, Placement, Plan
from sim.models import build_model
from sim.planning import BuiltPlan, PlanInputs, build_plan
from sim.topology import Topology
from sim.trace import Span, Trace

__all__ = [
    "BuiltPlan", "Layer", "LayerGraph", "Op", "OpKind", "Placement", "Plan", "PlanInputs", "SimResult", "Span",
    "SpecError", "Topology", "Trace", "build_model", "build_plan", "simulate",
]
