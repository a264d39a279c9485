"""pipedejavu simulator: model → layer graph → cost oracle → partition → schedule (L0) → lowering (L1) → engine →
trace (L2) → metrics, Chrome trace, Gantt chart. The architecture is drawn in ``docs/architecture.md``.

Typical use::

    from sim import PlanInputs, build_plan, predict
    built = build_plan(PlanInputs("gpt:layers=48,hidden=2048", "16xV100", "1f1b", microbatches=32))
    prediction = predict(built.plan)
    print(prediction.metrics["iteration_time_s"])

    # tensor × data × pipeline parallel: 2 × 4 × 2 on the same 16 GPUs, 64 samples per iteration
    built = build_plan(PlanInputs("gpt:layers=48,hidden=2048", "16xV100", "1f1b", microbatch_size=2,
                                  global_batch=64, tp=2, dp=4, pp=2))

The command lines are ``python -m sim.run`` (see its ``--help``) and ``python -m sim.bench``.

The names below are loaded on first use (PEP 562), so that importing one module of the IR, as the executor does,
does not load the SimPy engine or the schedule generators.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name → the module that defines it.
_EXPORTS = {
    "SpecError": "sim.core.errors",
    "Op": "sim.ir.plan", "OpKind": "sim.ir.plan", "Placement": "sim.ir.plan", "Plan": "sim.ir.plan",
    "Parallelism": "sim.ir.parallel",
    "Span": "sim.ir.trace", "Trace": "sim.ir.trace",
    "Topology": "sim.hw.topology",
    "Layer": "sim.models.graph", "LayerGraph": "sim.models.graph", "build_model": "sim.models",
    "Sharding": "sim.models.sharding", "collective_cost": "sim.cost.collectives",
    "CostOracle": "sim.cost.oracle", "CostView": "sim.cost.cost_view", "MeasuredProfile": "sim.cost.profile",
    "load_profile": "sim.cost.profile",
    "PlanInputs": "sim.plan.inputs", "BuiltPlan": "sim.plan.build", "build_plan": "sim.plan.build",
    "SimResult": "sim.engine.simpy_engine", "simulate": "sim.engine.simpy_engine",
    "Prediction": "sim.predict", "predict": "sim.predict",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
