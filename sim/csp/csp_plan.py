"""NASPipe's CSP as a plan: ``sim.run --schedule csp`` writes one, ``sim.predict`` simulates it, ``executor.run`` runs
it, and this module is where such a plan is made and checked (DESIGN §3 "NASPipe CSP in the IR").

A CSP plan has no fixed program: which subnet runs next on a stage is decided while it runs, by
:func:`sim.csp.rules.csp_pick`, in the simulator and on every rank of the executor alike. So the plan carries what
that decision and the run need, and nothing else: the supernet spec (``model``), one stage per rank with its layers
(``placement``), the subnet table (``subnets``: the chosen candidate of every block, one row per subnet in training
order; subnet id = ``mb``), and the ``options`` ``lookahead``, ``one_at_a_time``, ``seed`` (of the sampled table),
``space`` (when named) and, under context switching, ``device_param_budget_bytes`` and ``prefetch``. Its rank
programs are empty and its ``weight_policy`` is ``"csp"``: weights update per subnet, after that subnet's backward.

Costs (:func:`csp_problem`): each subnet is costed on each stage with the candidates it chose — a
:class:`~sim.cost.oracle.CostOracle` over the subnet's own layer graph (:func:`sim.models.supernet.
subnet_layer_costs`) — so a subnet of convolutions and one of attention cost what they cost. Activations and
gradients cross the topology's links like any pipeline message. Two subnets conflict on a stage when they chose the
same candidate of a block there (NASPipe §4: same choice, same parameters). With a budget, a device holds at most
that many bytes of choice-block parameters (key bytes = the candidate's ``params`` × the graph's ``dtype_bytes``;
embedding and head are not counted) and the rest is copied over the host ↔ device path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.core.errors import SpecError
from sim.cost.memory_sizes import state_bytes_per_param
from sim.cost.oracle import CostOracle
from sim.csp.problem import PREFETCH_POLICIES, CspProblem, StageMemoryModel
from sim.hw.topology import Topology
from sim.ir.plan import Placement, Plan
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.models.supernet import Supernet, build_supernet, subnet_layer_costs
from sim.models.supernet_space import sample_subnets, space_spec
from sim.plan.partition import counts_to_ranges, parse_partition

__all__ = ["CspInputs", "CspSetup", "MAX_SUBNETS", "build_csp_plan", "check_csp_plan", "csp_problem",
           "build_csp_problem", "CSP_OPTIONS"]

#: Most subnets one plan may train. The plan stores one row per subnet and the simulation keeps a few hundred bytes
#: per subnet and stage; 100,000 subnets on 8 stages is a minute of simulation, more is refused before sampling.
MAX_SUBNETS = 100_000

#: The options a CSP plan may carry, with their types (anything else in a plan file is refused by name).
CSP_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "lookahead": int, "one_at_a_time": bool, "seed": int, "space": str, "partition": str,
    "device_param_budget_bytes": int, "prefetch": str,
}


@dataclass(frozen=True)
class CspInputs:
    """The user's CSP choices (``sim.run --schedule csp``).

    Attributes:
        model: a ``supernet:...`` spec, or ``None`` when ``space`` names a preset.
        space: search-space preset (``c0``..``c3``), or ``None``.
        topology: topology spec; one stage per device.
        subnets: number of subnets N to train, in order (1 .. :data:`MAX_SUBNETS`).
        seed: subnet sampler seed.
        lookahead: most subnets in flight.
        microbatch_size: samples per subnet's minibatch.
        partition: ``uniform``, ``balanced`` or layer counts per stage.
        one_at_a_time: the ablation without CSP overlap.
        device_param_budget_bytes: most choice-block parameter bytes per device; ``None``: all resident.
        prefetch: ``predict``, ``on_demand`` or ``resident``; only with a budget (``None``: ``predict`` then).
    """

    model: str | None
    space: str | None
    topology: str
    subnets: int = 64
    seed: int = 0
    lookahead: int = 30
    microbatch_size: int = 1
    partition: str = "balanced"
    one_at_a_time: bool = False
    device_param_budget_bytes: int | None = None
    prefetch: str | None = None


@dataclass(frozen=True)
class CspSetup:
    """What running a checked CSP plan needs besides the plan.

    Attributes:
        supernet: the supernet and its candidate table.
        topology: the plan's topology, parsed.
        uses: ``uses[subnet][stage]`` → the layer keys ``(block, candidate)`` the subnet uses on that stage.
        key_bytes: parameter bytes of every layer key, bytes.
    """

    supernet: Supernet
    topology: Topology
    uses: tuple[tuple[frozenset[tuple[int, int]], ...], ...]
    key_bytes: dict[tuple[int, int], int]


def build_csp_plan(inputs: CspInputs) -> Plan:
    """Parse, sample and partition: the CSP plan of ``inputs``, checked (:func:`check_csp_plan`).

    Raises:
        SpecError: any bad value, named; a budget without room for some subnet's layers on some stage.
    """
    if (inputs.model is None) == (inputs.space is None):
        raise SpecError("{schedule} csp needs a supernet: give {model} supernet:... or {space} c0|c1|c2|c3",
                        "schedule", "model", "space")
    for name, value in (("subnets", inputs.subnets), ("lookahead", inputs.lookahead),
                        ("microbatch_size", inputs.microbatch_size)):
        if value < 1:
            raise SpecError(f"{{{name}}} must be >= 1, got {value}", name)
    if inputs.subnets > MAX_SUBNETS:
        raise SpecError(f"{{subnets}} {inputs.subnets} is more than one plan trains (at most {MAX_SUBNETS:,}); split "
                        f"the run", "subnets")
    if inputs.prefetch is not None and inputs.device_param_budget_bytes is None:
        raise SpecError(f"{{prefetch}} {inputs.prefetch} chooses how layers are copied under "
                        f"{{device_param_budget_bytes}}; without a budget every layer is resident and nothing is "
                        f"copied", "prefetch", "device_param_budget_bytes")
    spec = space_spec(inputs.space) if inputs.space else inputs.model
    if not spec.startswith("supernet"):  # type: ignore[union-attr]
        raise SpecError(f"{{schedule}} csp trains subnets of a supernet, not {spec!r}", "schedule")
    supernet = build_supernet(spec)  # type: ignore[arg-type]
    graph = build_model(supernet.graph.spec)
    topology = Topology.parse(inputs.topology)
    p = topology.num_ranks
    if p > len(graph):
        raise SpecError(f"more stages ({p}) than layers ({len(graph)}) in {graph.spec}")
    oracle = CostOracle(graph, inputs.microbatch_size, None, topology)
    counts = parse_partition(inputs.partition, oracle, p, tuple(range(p)))
    options: dict[str, Any] = {"lookahead": inputs.lookahead, "one_at_a_time": inputs.one_at_a_time,
                               "seed": inputs.seed, "partition": inputs.partition}
    if inputs.space:
        options["space"] = inputs.space
    if inputs.device_param_budget_bytes is not None:
        options["device_param_budget_bytes"] = inputs.device_param_budget_bytes
        options["prefetch"] = inputs.prefetch or "predict"
    plan = Plan(schedule="csp", level="L1", model=graph.spec, topology=str(topology),
                num_microbatches=inputs.subnets, microbatch_size=inputs.microbatch_size, weight_policy="csp",
                placement=Placement(counts_to_ranges(counts), tuple(range(p))), programs=((),) * p,
                options=tuple(sorted(options.items())),
                subnets=sample_subnets(supernet.num_blocks, supernet.num_choices, inputs.subnets, inputs.seed))
    check_csp_plan(plan, topology)
    return plan


def check_csp_plan(plan: Plan, topology: Topology | None = None) -> CspSetup:
    """Check everything a CSP plan (made here or read from a file) must satisfy before it is simulated or run.

    Args:
        plan: a plan with ``weight_policy == "csp"``.
        topology: its topology, when already parsed.

    Raises:
        SpecError: naming the first thing wrong: schedule, level or policy; programs that are not empty; a placement
            that is not one stage per rank in order; a model that is not a supernet; a subnet table of the wrong
            size or with a candidate out of range; an unknown or mistyped option; a budget below some subnet's
            layers on some stage.
    """
    where = f"csp plan ({plan.model} on {plan.topology})"
    if (plan.schedule, plan.level, plan.weight_policy) != ("csp", "L1", "csp"):
        raise SpecError(f"{where}: schedule, level and weight_policy must be csp, L1 and csp, got {plan.schedule}, "
                        f"{plan.level} and {plan.weight_policy}")
    if any(plan.programs):
        raise SpecError(f"{where}: rank programs must be empty (CSP decides online), rank "
                        f"{next(r for r, prog in enumerate(plan.programs) if prog)} has ops")
    p = plan.num_ranks
    if plan.placement.vstage_to_rank != tuple(range(p)):
        raise SpecError(f"{where}: one stage per rank in order is required, got vstage_to_rank "
                        f"{list(plan.placement.vstage_to_rank)}")
    if not plan.model.startswith("supernet:"):
        raise SpecError(f"{where}: the model must be a supernet, got {plan.model!r}")
    supernet = build_supernet(plan.model)
    if plan.placement.num_layers != len(supernet.graph):
        raise SpecError(f"{where}: the placement covers {plan.placement.num_layers} layers, the supernet has "
                        f"{len(supernet.graph)}")
    topology = topology if topology is not None else Topology.parse(plan.topology)
    if p > topology.num_ranks:
        raise SpecError(f"{where}: {p} stages need {p} devices, topology {topology} has {topology.num_ranks}")
    _check_table(plan, supernet, where)
    _check_options(plan, where)
    uses = _uses(supernet, plan.subnets, plan.placement.vstage_layers)
    key_bytes = {(block, k): candidate.params * supernet.graph.dtype_bytes
                 for block, row in enumerate(supernet.candidates) for k, candidate in enumerate(row)}
    budget = plan.option("device_param_budget_bytes")
    if budget is not None:
        need, subnet, stage = max(((sum(key_bytes[key] for key in uses[b][s]), b, s)
                                   for b in range(len(uses)) for s in range(p)), key=lambda t: (t[0], -t[1], -t[2]))
        if need > budget:
            raise SpecError(f"{{device_param_budget_bytes}} {budget} B is smaller than subnet {subnet}'s layers on "
                            f"stage {stage} ({need:,} B); every subnet's layers of a stage must fit at once",
                            "device_param_budget_bytes")
    return CspSetup(supernet, topology, uses, key_bytes)


def _check_table(plan: Plan, supernet: Supernet, where: str) -> None:
    if len(plan.subnets) != plan.num_microbatches:
        raise SpecError(f"{where}: num_microbatches is {plan.num_microbatches} but the subnet table has "
                        f"{len(plan.subnets)} rows (one per subnet)")
    if plan.num_microbatches > MAX_SUBNETS:
        raise SpecError(f"{where}: {plan.num_microbatches} subnets, at most {MAX_SUBNETS:,}")
    for b, row in enumerate(plan.subnets):
        if len(row) != supernet.num_blocks or any(not 0 <= k < supernet.num_choices for k in row):
            raise SpecError(f"{where}: subnet {b} is {list(row)[:8]}; each subnet chooses one of "
                            f"{supernet.num_choices} candidates for each of {supernet.num_blocks} blocks")


def _check_options(plan: Plan, where: str) -> None:
    options = dict(plan.options)
    unknown = sorted(set(options) - set(CSP_OPTIONS))
    if unknown:
        raise SpecError(f"{where}: unknown option(s) {', '.join(unknown)}; a csp plan has "
                        f"{', '.join(sorted(CSP_OPTIONS))}")
    for key, value in options.items():
        kind = CSP_OPTIONS[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpecError(f"{where}: option {key} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    if options.get("lookahead", 1) < 1:
        raise SpecError(f"{where}: lookahead must be >= 1, got {options['lookahead']}")
    budget, prefetch = options.get("device_param_budget_bytes"), options.get("prefetch")
    if (budget is None) != (prefetch is None):
        raise SpecError(f"{where}: device_param_budget_bytes and prefetch go together (got {budget!r}, {prefetch!r})")
    if budget is not None and budget < 0:
        raise SpecError(f"{where}: device_param_budget_bytes must be >= 0, got {budget}")
    if prefetch is not None and prefetch not in PREFETCH_POLICIES:
        raise SpecError(f"{where}: prefetch must be one of {', '.join(PREFETCH_POLICIES)}, got {prefetch!r}")


def _uses(supernet: Supernet, subnets: tuple[tuple[int, ...], ...],
          stage_layers: tuple[tuple[int, int], ...]) -> tuple[tuple[frozenset[tuple[int, int]], ...], ...]:
    # Graph layer i >= 1 up to the last block is block i - 1; its key is (block, chosen candidate).
    return tuple(tuple(frozenset((i - 1, choice[i - 1]) for i in range(start, end) if 1 <= i <= supernet.num_blocks)
                       for start, end in stage_layers) for choice in subnets)


def csp_problem(plan: Plan, setup: CspSetup) -> CspProblem:
    """The CSP problem a checked plan poses on its topology, every time and size asked of the cost oracle."""
    supernet, topology = setup.supernet, setup.topology
    graph, size, stage_layers = supernet.graph, plan.microbatch_size, plan.placement.vstage_layers
    fwd, bwd, upd, held = [], [], [], []
    for choice in plan.subnets:
        sub = LayerGraph(graph.spec, subnet_layer_costs(supernet, choice), dtype_bytes=graph.dtype_bytes,
                         input_bytes=graph.input_bytes)
        oracle = CostOracle(sub, size, None, topology)
        row_f, row_b, row_u = [], [], []
        for stage, (start, end) in enumerate(stage_layers):
            costs = oracle.layer_costs(topology.devices[stage])
            row_f.append(sum(costs.fwd[start:end]))
            row_b.append(sum(costs.bwd[start:end]))
            row_u.append(sum(costs.opt[start:end]))
        fwd.append(row_f)
        bwd.append(row_b)
        upd.append(row_u)
        held.append(tuple(oracle.memory.activation_bytes(start, end) for start, end in stage_layers))
    oracle = CostOracle(graph, size, None, topology)
    cut_bytes = [oracle.boundary_bytes(end) for _, end in stage_layers[:-1]]

    def transfer(src: int, dst: int, subnet: int, kind: str) -> float:
        return oracle.transfer_time(cut_bytes[min(src, dst)], src, dst)

    return CspProblem(plan.num_ranks, setup.uses, fwd, bwd, upd, transfer, plan.option("lookahead", 30),
                      key_bytes=setup.key_bytes, param_budget_bytes=plan.option("device_param_budget_bytes"),
                      h2d_s=oracle.host_to_device_s, d2h_s=oracle.device_to_host_s,
                      devices=tuple(device.name for device in topology.devices[: plan.num_ranks]),
                      memory=_memory_model(plan, supernet, tuple(held)))


def _memory_model(plan: Plan, supernet: Supernet, held: tuple[tuple[int, ...], ...]) -> StageMemoryModel:
    """Per stage: the state of its shared layers (embedding, head) always; of every candidate of its blocks unless
    a budget moves them (then each resident key brings its gradients and optimizer state); and in-flight
    activations (``held``)."""
    graph = supernet.graph
    per_param = state_bytes_per_param(graph.dtype_bytes)
    switching = plan.option("device_param_budget_bytes") is not None and plan.option("prefetch") != "resident"
    static = []
    for start, end in plan.placement.vstage_layers:
        blocks = [i - 1 for i in range(start, end) if 1 <= i <= supernet.num_blocks]
        shared = sum(graph.param_count(i) for i in range(start, end) if not 1 <= i <= supernet.num_blocks)
        candidates = 0 if switching else sum(c.params for b in blocks for c in supernet.candidates[b])
        static.append((shared + candidates) * per_param)
    return StageMemoryModel(tuple(static), held, per_param / graph.dtype_bytes if switching else 0.0)


def build_csp_problem(inputs: CspInputs) -> tuple[Plan, CspSetup, CspProblem]:
    """The plan of ``inputs``, what running it needs, and the problem it poses (for baselines and experiments)."""
    plan = build_csp_plan(inputs)
    setup = check_csp_plan(plan)
    return plan, setup, csp_problem(plan, setup)
