"""What the cost model reads from a plan's layout and options: the shard one device holds (tensor, context and
expert parallelism, recomputation, routing, dispatcher, loss, block implementation), how ZeRO splits the training
state, and the rules a layout must meet for the expert model. A built plan (``sim.plan.build``) writes these options
and a written one (``plan.json``) is costed from them (:func:`sim.cost.plan_costs.written_plan_costs`), so both read
them here.
"""

from __future__ import annotations

from sim.core.errors import SpecError
from sim.cost.kernels.record import NARROW_FORMATS
from sim.cost.memory_sizes import StateShards
from sim.ir.parallel import Parallelism
from sim.ir.plan import Plan
from sim.models.blocks import BLOCKS, DTYPE_BYTES, TRANSFORMER_ENGINE
from sim.models.graph import LayerGraph
from sim.models.loss import LOSSES
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, parse_recompute_modules
from sim.models.routing import BALANCED, Routing, parse_routing
from sim.models.sharding import Sharding

__all__ = ["plan_sharding", "check_expert_layout", "plan_state_shards", "plan_routing", "plan_loss",
           "plan_blocks", "plan_dispatcher", "plan_recompute", "saved_input_bytes", "EP_DISPATCHER_OPTION",
           "LOSS_OPTION", "BLOCKS_OPTION", "OFFLOAD_OPTION", "plan_offload", "check_offload",
           "RECOMPUTE_MODULES_OPTION", "plan_recompute_modules", "check_recompute_modules_flag"]


def plan_sharding(layout: Parallelism, recompute: str, routing: Routing = BALANCED,
                  capacity_factor: float = 0.0, dispatcher: str = "all-to-all", *, loss: str = LOSSES[0],
                  blocks: str = BLOCKS[0], precision: str | None = None, offloaded_blocks: int = 0,
                  recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES) -> Sharding:
    """What one device holds of the model under ``layout`` with recomputation ``recompute`` (``"none"``, ``"full"``
    or ``"selective"``, the latter dropping ``recompute_modules`` in a moe-family block,
    :mod:`sim.models.recompute_modules`): its tensor-parallel shard, sequence parallel or not, its
    share of the experts under ``routing`` and ``capacity_factor`` (:mod:`sim.models.routing`), exchanged by
    ``dispatcher`` (:data:`sim.models.sharding.DISPATCHERS`), its loss computed as ``loss``
    (:data:`sim.models.loss.LOSSES`), its blocks built from ``blocks`` (:data:`sim.models.blocks.BLOCKS`), whose
    linears keep their inputs as ``precision`` stores them (:func:`saved_input_bytes`), and the activations of its
    first ``offloaded_blocks`` blocks offloaded to the host (:mod:`sim.models.offload`).

    Raises:
        SpecError: ``blocks`` unknown, a precision Transformer Engine has no recipe for, an offload that is not a
            whole number of blocks, or recompute modules without selective recomputation.
    """
    check_offload(layout, recompute, offloaded_blocks)
    check_recompute_modules_flag(recompute, recompute_modules)
    if blocks not in BLOCKS:
        raise SpecError(f"{{blocks}} must be one of {', '.join(BLOCKS)}, got {blocks!r}", "blocks")
    width = saved_input_bytes(precision) if blocks == TRANSFORMER_ENGINE else DTYPE_BYTES
    return Sharding(tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                    selective_recompute=recompute == "selective", cp=layout.cp, ep=layout.ep, etp=layout.etp,
                    routing=routing, capacity_factor=capacity_factor, dispatcher=dispatcher, loss=loss,
                    blocks=blocks, saved_input_bytes=width, offloaded_blocks=offloaded_blocks,
                    recompute_modules=recompute_modules)


#: The narrow formats Transformer Engine trains in (its recipes: ``Float8CurrentScaling``, ``MXFP8BlockScaling``,
#: ``NVFP4BlockScaling``); torchao's rowwise FP8 is not one of them.
ENGINE_FORMATS = ("fp8", "mxfp8", "nvfp4")


def saved_input_bytes(precision: str | None) -> float:
    """Bytes per element of a linear's input as a Transformer Engine layer keeps it for the weight gradient under
    ``precision`` (:mod:`sim.models.blocks`): the training dtype's 2 in bf16 or fp16, else one value of the narrow
    format with its share of the block scales (FP8 1, MXFP8 1 + 1/32, NVFP4 1/2 + 1/16).

    Raises:
        SpecError: a narrow precision Transformer Engine has no recipe for (:data:`ENGINE_FORMATS`).
    """
    narrow = NARROW_FORMATS.get(precision) if precision else None
    if narrow is None:
        return DTYPE_BYTES
    if narrow.name not in ENGINE_FORMATS:
        raise SpecError(f"{{precision}} {precision} is torchao's recipe; transformer-engine blocks train in "
                        f"{', '.join(ENGINE_FORMATS)} (or bf16)", "precision", "blocks")
    return narrow.stored_bytes(1)


def check_expert_layout(graph: LayerGraph, layout: Parallelism) -> None:
    """Refuse a layout the expert model does not cover: ZeRO-3 (FSDP) over a model with routed experts (their
    parameters would be gathered over the expert-data-parallel group, which is not modelled), and expert parallelism
    for a model without experts.

    Raises:
        SpecError: naming the flags and what would be valid.
    """
    experts = any(layer.expert_param_bytes for layer in graph.layers)
    if layout.zero == 3 and experts:
        raise SpecError("{zero} 3 (FSDP) is not modelled for a mixture of experts (its experts would be gathered over "
                        "their expert-data-parallel group); use --zero 1 or 2", "zero")
    if layout.ep * layout.etp > 1 and not experts:
        family = graph.spec.partition(":")[0]
        raise SpecError(f"{{ep}} {layout.ep} × {{etp}} {layout.etp} splits a mixture's experts; {family} has none",
                        "ep", "etp")


def plan_state_shards(layout: Parallelism) -> StateShards:
    """Over how many devices ``layout``'s ZeRO stage splits each part of the training state: the data-parallel
    shard group's, the routed experts' over their expert-data-parallel group."""
    return StateShards.of_zero(layout.zero, layout.dp_shard, layout.expert_dp)


def plan_routing(plan: Plan) -> tuple[Routing, float]:
    """The plan's routing and capacity factor (options ``routing`` and ``capacity_factor``; balanced and dropless
    when absent)."""
    return parse_routing(str(plan.option("routing", "balanced"))), float(plan.option("capacity_factor", 0.0))


#: The plan option of ``--ep-dispatcher`` (recorded when not the default ``all-to-all``).
EP_DISPATCHER_OPTION = "ep_dispatcher"


#: The plan option of ``--loss`` (recorded when not the default ``fused``).
LOSS_OPTION = "loss"


#: The plan option of ``--blocks`` (recorded when not the default ``eager``).
BLOCKS_OPTION = "blocks"


def plan_blocks(plan: Plan) -> str:
    """The plan's block implementation (option ``blocks``; ``eager`` when absent)."""
    return str(plan.option(BLOCKS_OPTION, BLOCKS[0]))


#: The plan option of ``--offload-activations`` (recorded when above 0).
OFFLOAD_OPTION = "offload_activations"


def plan_offload(plan: Plan) -> int:
    """The blocks whose activations the plan offloads to the host (option ``offload_activations``; 0 when absent)."""
    return int(plan.option(OFFLOAD_OPTION, 0))


def check_offload(layout: Parallelism, recompute: str, count: int) -> None:
    """Refuse an activation offload Megatron-Core refuses (:mod:`sim.models.offload`): beside pipeline parallelism or
    activation recomputation; and a count that is not an integer >= 0.

    Raises:
        SpecError: naming the flags and what would be valid.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise SpecError(f"{{offload_activations}} must be an integer >= 0 (blocks), got {count!r}",
                        "offload_activations")
    if not count:
        return
    if layout.pp > 1:
        raise SpecError(f"{{offload_activations}} is not modelled beside pipeline parallelism (Megatron-Core refuses "
                        f"it: \"no support for Pipeline parallelism with CPU offloading\"); got {{pp}} {layout.pp}",
                        "offload_activations", "pp")
    if recompute != "none":
        raise SpecError(f"{{offload_activations}} does not combine with {{recompute}} {recompute} (Megatron-Core: "
                        f"\"CPU offloading does not work when activation recomputation is enabled\")",
                        "offload_activations", "recompute")


#: The plan option of ``--recompute-modules`` (recorded under selective recomputation when not the default set).
RECOMPUTE_MODULES_OPTION = "recompute_modules"


def plan_recompute_modules(plan: Plan) -> tuple[str, ...]:
    """The modules the plan's selective recomputation drops in a moe-family block (option ``recompute_modules``, a
    comma-separated list; :data:`sim.models.recompute_modules.DEFAULT_RECOMPUTE_MODULES` when absent)."""
    value = plan.option(RECOMPUTE_MODULES_OPTION)
    return DEFAULT_RECOMPUTE_MODULES if value is None else parse_recompute_modules(str(value))


def check_recompute_modules_flag(recompute: str, modules: tuple[str, ...]) -> None:
    """Refuse recompute modules other than the default without selective recomputation (they name what it drops).

    Raises:
        SpecError: naming the flags.
    """
    if modules != DEFAULT_RECOMPUTE_MODULES and recompute != "selective":
        raise SpecError(f"{{recompute_modules}} {','.join(modules)} names what selective recomputation drops; it "
                        f"needs {{recompute}} selective, got {recompute}", "recompute_modules", "recompute")


def plan_loss(plan: Plan) -> str:
    """The plan's loss implementation (option ``loss``; ``fused`` when absent)."""
    return str(plan.option(LOSS_OPTION, LOSSES[0]))


def plan_dispatcher(plan: Plan) -> str:
    """The plan's expert token dispatcher (option ``ep_dispatcher``; ``all-to-all`` when absent)."""
    return str(plan.option(EP_DISPATCHER_OPTION, "all-to-all"))


def plan_recompute(plan: Plan) -> str:
    """The plan's recomputation: ``"full"`` (option ``recompute: true``), ``"selective"`` or ``"none"``."""
    value = plan.option("recompute", False)
    return "selective" if value == "selective" else "full" if value else "none"
