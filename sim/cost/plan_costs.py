"""A plan's costs assembled in one place: the model shard one device holds, its cost oracle, and the cost views of
the replicas the engine simulates.

Every path that costs a plan asks here: ``sim.plan.build`` for what a user asks (through its ``inputs_costs``),
:func:`written_plan_costs` for a ``plan.json`` (``sim.predict``), and the search's strategies and the bench for every
candidate they cost. So the shard is always built from everything that shapes it (tensor, sequence, context and
expert parallelism, recomputation, the mixture's routing and capacity factor), and the oracle from everything that
shapes its numbers (microbatch size, profile, topology, state sharding, precision, CUDA graphs, kernel model,
compilation): no caller can leave one out.

Both are kept. A shard is a pure function of the model spec and its :class:`~sim.models.sharding.Sharding` (kept
for the process, :func:`sharded_graph`); an oracle is kept in its topology's ``cost_memo``, keyed by what it is built
from, so the candidates of a search that share a shard, a microbatch size, a state sharding and a precision share one
oracle with its per-device layer costs and prefix sums, whatever else of their layouts differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from sim.core.errors import SpecError
from sim.cost.compiled import check_compile
from sim.cost.cost_view import CostView, replica_views
from sim.cost.gpu_time import KernelModel
from sim.cost.oracle import CostOracle
from sim.cost.plan_settings import (
    check_expert_layout,
    plan_blocks,
    plan_dispatcher,
    plan_loss,
    plan_offload,
    plan_recompute,
    plan_recompute_modules,
    plan_routing,
    plan_sharding,
    plan_state_shards,
)
from sim.cost.precision import check_precision, narrow_format
from sim.cost.profile import MeasuredProfile
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism
from sim.ir.plan import Placement, Plan
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES
from sim.models.routing import BALANCED, Routing
from sim.models.sharding import Sharding

__all__ = ["PlanCosts", "sharded_graph", "plan_oracle", "check_graph", "plan_costs", "written_plan_costs"]

#: Distinct model shards kept per process (a search meets one per tensor, sequence, context and expert degree,
#: recomputation and routing it lists: tens, each a few hundred layer records).
_GRAPHS_KEPT = 256


@dataclass(frozen=True)
class PlanCosts:
    """What costs a plan of one layout: its model shard, the oracle, and the layout the views are built on.

    Attributes:
        graph: the model as one device of ``layout`` holds it.
        oracle: the cost oracle of ``graph`` on the plan's topology, microbatch size and profile.
        layout: the plan's tensor × context × data × pipeline layout.
    """

    graph: LayerGraph
    oracle: CostOracle
    layout: Parallelism

    def views(self, placement: Placement, *, simulate_all: bool = False) -> tuple[CostView, ...]:
        """The cost views the engine simulates for ``placement``: one when the replicas are identical, else one per
        replica (:func:`sim.cost.cost_view.replica_views`; ``simulate_all``: one per replica in any case).

        Raises:
            SpecError: a tensor-parallel group mixes device models.
        """
        oracle = self.oracle
        return replica_views(self.graph, oracle.topology, placement, oracle.microbatch_size, oracle.profile,
                             oracle=oracle, layout=self.layout, simulate_all=simulate_all)

    def first_view(self, placement: Placement) -> CostView:
        """The view of the first replica, costed with every replica running at once (what a built plan keeps,
        ``sim.plan.build.BuiltPlan.costs``; the engine's view when the replicas are identical)."""
        oracle = self.oracle
        return CostView(self.graph, oracle.topology, placement, oracle.microbatch_size, oracle.profile,
                         oracle=oracle, layout=self.layout, concurrent=tuple(range(self.layout.data_ranks)))


def plan_oracle(graph: LayerGraph, microbatch_size: int, profile: MeasuredProfile | None, topology: Topology,
                layout: Parallelism, *, cuda_graphs: bool = False, kernel_model: KernelModel | None = None,
                precision: str | None = None, compiled: bool = False) -> CostOracle:
    """The cost oracle of a plan: ``graph`` (what one device holds, :func:`sim.cost.plan_costs.sharded_graph`) at
    ``microbatch_size`` samples per microbatch, with ``profile``, on ``topology``, with the training state split
    across the data-parallel replicas as ``layout.zero``'s stage splits it, a stream's CUDA graphs, and ``kernel_model``
    (default: the built-in constants; a written plan records none), in ``precision`` (``None``: the model's own;
    ``"fp8"``, ``"mxfp8"``, ``"nvfp4"``: low-precision linears, :mod:`sim.cost.precision`), with its blocks under
    ``torch.compile`` where ``compiled`` (:mod:`sim.cost.compiled`). Asked by :func:`sim.cost.plan_costs.plan_costs`
    alone, for a built plan and a written one alike."""
    return CostOracle(graph, microbatch_size, profile, topology, cuda_graphs=cuda_graphs,
                      shards=plan_state_shards(layout), kernel_model=kernel_model,
                      narrow=narrow_format(precision), compiled=compiled,
                      cp_groups=tuple(layout.cp_group(0, 0, t) for t in range(layout.tp)) if layout.cp > 1 else (),
                      cp_comm=layout.cp_comm)


def sharded_graph(model: str, layout: Parallelism, recompute: str = "none", routing: Routing = BALANCED,
                  capacity_factor: float = 0.0, dispatcher: str = "all-to-all", *, loss: str = "fused",
                  blocks: str = "eager", precision: str | None = None, offloaded_blocks: int = 0,
                  recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES) -> LayerGraph:
    """The model ``model`` as one device of ``layout`` holds it, with recomputation ``recompute`` (``"none"``,
    ``"full"``, ``"selective"``, the latter dropping ``recompute_modules`` in a moe-family block), a mixture's
    ``routing``, ``capacity_factor`` (0: dropless) and token ``dispatcher``, the loss computed as ``loss``
    (:data:`sim.models.loss.LOSSES`) and blocks built from ``blocks`` (:data:`sim.models.blocks.BLOCKS`) in
    ``precision``, the activations of the first ``offloaded_blocks`` blocks offloaded to the host; kept per shard.

    Raises:
        SpecError: the model spec is invalid, or the layout does not divide it.
    """
    return _graph(model, plan_sharding(layout, recompute, routing, capacity_factor, dispatcher, loss=loss,
                                       blocks=blocks, precision=precision, offloaded_blocks=offloaded_blocks,
                                       recompute_modules=recompute_modules))


@lru_cache(maxsize=_GRAPHS_KEPT)
def _graph(model: str, sharding: Sharding) -> LayerGraph:
    return build_model(model, sharding)


def check_graph(graph: LayerGraph, layout: Parallelism, topology: Topology, *, precision: str | None,
                compiled: bool) -> None:
    """The rules a plan's model shard must meet on its devices before it is costed: the precision and compilation
    the devices and model take (:func:`sim.cost.precision.check_precision`, :func:`sim.cost.compiled.check_compile`),
    and a layout the expert model covers (:func:`sim.cost.plan_settings.check_expert_layout`).

    Raises:
        SpecError: naming the flag and what would be valid.
    """
    devices = [topology.devices[d] for d in layout.device_ranks]
    check_precision(precision, graph, devices)
    check_compile(compiled, graph, devices)
    check_expert_layout(graph, layout)
    if layout.async_tp and (any(layer.transformer is not None and layer.transformer.part == "block"
                                and layer.transformer.family != "llama" for layer in graph.layers)
                            or not all(device.is_gpu for device in devices)):
        raise SpecError(f"{{async_tp}} is modelled for the llama family's blocks on GPUs, not {graph.spec} on "
                        f"{', '.join(sorted({d.name for d in devices}))}", "async_tp")


def plan_costs(graph: LayerGraph, topology: Topology, layout: Parallelism, microbatch_size: int,
               profile: MeasuredProfile | None = None, *, precision: str | None = None, cuda_graphs: bool = False,
               kernel_model: KernelModel | None = None, compiled: bool = False) -> PlanCosts:
    """The costs of a plan of ``layout`` whose devices hold ``graph`` (:func:`sharded_graph`), at ``microbatch_size``
    samples per microbatch on ``topology``, with ``profile``'s measured costs where they apply, in ``precision``
    (``None``: the model's own), under a stream's CUDA graphs, the GPU ``kernel_model`` (``None``: the built-in
    constants) and ``torch.compile`` where ``compiled`` (:func:`plan_oracle`).

    The oracle is kept in ``topology.cost_memo``, shared by every layout with the same state sharding (and, under
    context parallelism, the same context-parallel groups).
    """
    key = ("plan oracle", id(graph), microbatch_size, id(profile), plan_state_shards(layout),
           layout if layout.cp > 1 else None, cuda_graphs, kernel_model, precision, compiled)
    oracle = topology.cost_memo.get(key)
    if oracle is None:
        # The oracle keeps the graph and the profile alive, so their ids in the key name no other object meanwhile.
        oracle = topology.cost_memo[key] = plan_oracle(graph, microbatch_size, profile, topology, layout,
                                                       cuda_graphs=cuda_graphs, kernel_model=kernel_model,
                                                       precision=precision, compiled=compiled)
    return PlanCosts(graph, oracle, layout)


def written_plan_costs(plan: Plan, topology: Topology, profile: MeasuredProfile | None = None) -> PlanCosts:
    """The costs of a written plan (``plan.json``): its model shard from its layout and options (recomputation,
    routing, capacity factor), checked on its devices, and its oracle from its options (precision, CUDA graphs,
    compilation; a written plan records no kernel model), on ``topology`` with ``profile``.

    Raises:
        SpecError: the plan's model spec is invalid, or its shard breaks a rule of :func:`check_graph`.
    """
    layout, precision, compiled = plan.layout, plan.option("precision"), plan.option("compile", False) is True
    graph = sharded_graph(plan.model, layout, plan_recompute(plan), *plan_routing(plan), plan_dispatcher(plan),
                          loss=plan_loss(plan), blocks=plan_blocks(plan), precision=precision,
                          offloaded_blocks=plan_offload(plan), recompute_modules=plan_recompute_modules(plan))
    check_graph(graph, layout, topology, precision=precision, compiled=compiled)
    return plan_costs(graph, topology, layout, plan.microbatch_size, profile, precision=precision,
                      cuda_graphs=bool(plan.option("cuda_graphs", False)), compiled=compiled)
