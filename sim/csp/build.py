"""``sim.run --schedule csp``: NASPipe's CSP training of a sampled subnet sequence, simulated on a topology.

From the user's choices to a :class:`sim.csp.simulate.CspProblem`: the supernet (``--model supernet:...`` or a search
space ``--space c0..c3``), a seeded subnet sequence (``--subnets N --seed S``, :func:`sim.models.supernet_space.
sample_subnets`), a partition of the supernet's layers over one stage per device, and each subnet's own costs on each
stage — the roofline (or a measured profile) of the candidates it chose, via :func:`sim.models.supernet.
subnet_layer_costs` and :class:`sim.cost.oracle.CostOracle`, so a subnet of convolutions and one of attention cost what
they cost. Activations and gradients cross the topology's links like any pipeline message. Two subnets conflict on a
stage when they chose the same candidate of a block there (NASPipe §4: same choice, same parameters).

Context switching: with ``device_param_budget_bytes`` each device holds at most that many bytes of choice-block
parameters (key bytes = the chosen candidate's ``params`` × the graph's ``dtype_bytes``; embedding and head are not
counted), and the ``prefetch`` policy (:mod:`sim.csp.simulate`) copies the rest from host memory over the topology's
host → device path (:meth:`sim.cost.oracle.CostOracle.host_to_device_s`) and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.cost.oracle import CostOracle
from sim.csp.simulate import PREFETCH_POLICIES, CspProblem, CspResult, simulate_csp
from sim.hw.topology import Topology
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.models.supernet import Supernet, build_supernet, subnet_layer_costs
from sim.models.supernet_space import sample_subnets, space_spec
from sim.plan.partition import counts_to_ranges, parse_partition

__all__ = ["CspInputs", "CspRun", "build_csp_problem", "run_csp"]


@dataclass(frozen=True)
class CspInputs:
    """The user's CSP choices.

    Attributes:
        model: a ``supernet:...`` spec, or ``None`` when ``space`` names a preset.
        space: search-space preset (``c0``..``c3``), or ``None``.
        topology: topology spec; one stage per device.
        subnets: number of subnets N to train, in order.
        seed: subnet sampler seed.
        lookahead: most subnets in flight.
        microbatch_size: samples per subnet's minibatch.
        partition: ``uniform``, ``balanced`` or layer counts per stage.
        one_at_a_time: the ablation without CSP overlap.
        device_param_budget_bytes: most choice-block parameter bytes per device; ``None``: all resident.
        prefetch: ``predict``, ``on_demand`` or ``resident`` (:data:`sim.csp.simulate.PREFETCH_POLICIES`).
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
    prefetch: str = "predict"


@dataclass(frozen=True)
class CspRun:
    """A simulated CSP run and what it was made from."""

    supernet: Supernet
    topology: Topology
    stage_layers: tuple[tuple[int, int], ...]
    subnets: tuple[tuple[int, ...], ...]
    problem: CspProblem
    result: CspResult


def build_csp_problem(inputs: CspInputs) -> tuple[Supernet, Topology, tuple[tuple[int, int], ...],
                                                   tuple[tuple[int, ...], ...], CspProblem]:
    """Parse, sample, partition and cost; SpecError naming any bad value."""
    if inputs.prefetch not in PREFETCH_POLICIES:
        raise SpecError(f"--prefetch must be one of {', '.join(PREFETCH_POLICIES)}, got {inputs.prefetch!r}")
    if (inputs.model is None) == (inputs.space is None):
        raise SpecError("--schedule csp needs a supernet: give --model supernet:... or --space c0|c1|c2|c3")
    spec = space_spec(inputs.space) if inputs.space else inputs.model
    if not spec.startswith("supernet"):  # type: ignore[union-attr]
        raise SpecError(f"--schedule csp trains subnets of a supernet, not {spec!r}")
    for name, value in (("--subnets", inputs.subnets), ("--lookahead", inputs.lookahead),
                        ("--microbatch-size", inputs.microbatch_size)):
        if value < 1:
            raise SpecError(f"{name} must be >= 1, got {value}")
    supernet = build_supernet(spec)  # type: ignore[arg-type]
    graph = build_model(supernet.graph.spec)
    topology = Topology.parse(inputs.topology)
    p = topology.num_ranks
    if p > len(graph):
        raise SpecError(f"more stages ({p}) than layers ({len(graph)}) in {graph.spec}")
    oracle = CostOracle(graph, inputs.microbatch_size, None, topology)
    counts = parse_partition(inputs.partition, oracle, p, tuple(range(p)))
    stage_layers = tuple(counts_to_ranges(counts))
    subnets = sample_subnets(supernet.num_blocks, supernet.num_choices, inputs.subnets, inputs.seed)
    uses, fwd, bwd, upd = [], [], [], []
    for choice in subnets:
        layers = subnet_layer_costs(supernet, choice)
        sub = LayerGraph(graph.spec, layers, dtype_bytes=graph.dtype_bytes, input_bytes=graph.input_bytes)
        sub_oracle = CostOracle(sub, inputs.microbatch_size, None, topology)
        row_uses, row_f, row_b, row_u = [], [], [], []
        for k, (start, end) in enumerate(stage_layers):
            costs = sub_oracle.layer_costs(topology.devices[k])
            # Graph layer i >= 1 up to the last block is block i - 1; its key is (block, chosen candidate).
            row_uses.append(frozenset((i - 1, choice[i - 1]) for i in range(start, end)
                                      if 1 <= i <= supernet.num_blocks))
            row_f.append(sum(costs.fwd[start:end]))
            row_b.append(sum(costs.bwd[start:end]))
            row_u.append(sum(costs.opt[start:end]))
        uses.append(row_uses)
        fwd.append(row_f)
        bwd.append(row_b)
        upd.append(row_u)
    cut_bytes = [oracle.boundary_bytes(end) for _, end in stage_layers[:-1]]

    def transfer(src: int, dst: int, subnet: int, kind: str) -> float:
        return oracle.transfer_time(cut_bytes[min(src, dst)], src, dst)

    key_bytes = {(blk, k): cand.params * graph.dtype_bytes for blk, row in enumerate(supernet.candidates)
                 for k, cand in enumerate(row)}
    budget = inputs.device_param_budget_bytes
    if budget is not None:
        if budget < 0:
            raise SpecError(f"--device-param-budget must be >= 0 bytes, got {budget}")
        table = tuple(tuple(r) for r in uses)
        need, b, k = max(((sum(key_bytes[x] for x in table[b][k]), b, k) for b in range(len(table))
                          for k in range(p)), key=lambda t: (t[0], -t[1], -t[2]))
        if need > budget:
            raise SpecError(f"--device-param-budget {budget} B is smaller than subnet {b}'s layers on stage {k} "
                            f"({need:,} B); every subnet's layers of a stage must fit at once")
    problem = CspProblem(p, tuple(tuple(r) for r in uses), fwd, bwd, upd, transfer, inputs.lookahead,
                         key_bytes=key_bytes, param_budget_bytes=budget,
                         h2d_s=oracle.host_to_device_s, d2h_s=oracle.device_to_host_s)
    return supernet, topology, stage_layers, subnets, problem


def run_csp(inputs: CspInputs) -> CspRun:
    """Build and simulate; the result's trace is in the simulator's format."""
    supernet, topology, stage_layers, subnets, problem = build_csp_problem(inputs)
    result = simulate_csp(problem, one_at_a_time=inputs.one_at_a_time, prefetch=inputs.prefetch)
    return CspRun(supernet, topology, stage_layers, subnets, problem, result)
