"""Random small plans for the tests that hold a fast evaluator or a bound to the engine (``test_critical_path``,
``test_bound``): the same draws, one place."""

import random
from dataclasses import replace

from sim.cost.cost_view import replica_views
from sim.plan.inputs import PlanInputs

MODEL = "gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000"
TOPOLOGIES = ("8xA100", "2x4xA100", "4xV100+4xA100", "8xideal", "8xV100")


def engine_views(built):
    """The cost views the engine simulates ``built`` with."""
    return replica_views(built.graph, built.topology, built.plan.placement, built.plan.microbatch_size,
                         built.profile, oracle=built.costs.oracle, layout=built.plan.layout)


def random_plan_inputs(rng: random.Random, schedules: tuple[str, ...] = ("gpipe", "1f1b", "zb1p"), *,
                       grad_overlap: bool = False) -> PlanInputs:
    """A random 8-device plan of :data:`MODEL`: TP × DP × PP, one of ``schedules`` (interleaved too where PP > 1),
    microbatches, recomputation, sequence parallelism, ZeRO (none under pipedream), partition rule and rank order;
    with ``grad_overlap``, an overlapped reduction now and then where it applies. May break a rule (TP across device
    models, more stages than layers): the caller draws again."""
    topology = rng.choice(TOPOLOGIES)
    tp, dp = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4)])
    pp = 8 // (tp * dp)
    schedule = rng.choice(list(schedules) + (["interleaved"] if pp > 1 else []))
    m = rng.choice([1, 2, 3, 4, 6, 8]) * (pp if schedule == "interleaved" else 1)
    inputs = PlanInputs(
        model=MODEL, topology=topology, schedule=schedule, microbatches=m, microbatch_size=rng.choice([1, 2]),
        tp=tp, dp=dp, pp=pp, chunks=2 if schedule == "interleaved" else 1,
        recompute=rng.choice(["none", "full", "selective"]), sequence_parallel=tp > 1 and rng.random() < 0.5,
        zero=rng.choice([0, 1, 2, 3]) if dp > 1 and schedule != "pipedream" else 0,
        partition=rng.choice(["balanced", "uniform"]), rank_order=rng.choice(["tp-dp-pp", "pp-dp-tp", "dp-tp-pp"]))
    if grad_overlap and dp > 1 and inputs.zero < 2 and schedule != "pipedream" and rng.random() < 0.3:
        inputs = replace(inputs, grad_overlap=True)
    return inputs
