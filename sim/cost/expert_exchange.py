"""What an expert-parallel op costs: every MoE layer's token dispatch and combine of a stage, by the plan's
dispatcher (:data:`sim.models.sharding.DISPATCHERS`), and under expert tensor parallelism the gathers around the
experts. :class:`sim.cost.cost_view.CostView` asks here for its EP ops (``EP_F``, ``EP_B``, ``EP_R``)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.core.errors import SpecError
from sim.cost.collectives import CollectiveCost, server_parts
from sim.cost.comm_cost import CommCost, sequential_cost
from sim.cost.oracle import CostOracle
from sim.ir.parallel import Parallelism
from sim.models.graph import Layer, MixturePart
from sim.models.routing import expected_servers

__all__ = ["expert_exchange_cost"]


def expert_exchange_cost(layers: Sequence[Layer], layout: Parallelism, pipeline_rank: int, oracle: CostOracle,
                         microbatch_size: int, dtype_bytes: int) -> CommCost:
    """An EP op of the stage holding ``layers`` on ``pipeline_rank``: every MoE layer's token dispatch and combine
    over the stage's expert-parallel groups (all of them at once), and under expert tensor parallelism the
    all-gather of the received tokens over each expert-tensor group and the reduce-scatter of the experts' outputs.

    The dispatch is, by the mixture's ``dispatcher``, an all-to-all whose traffic matrix sends each member the tokens
    routed to its experts (:attr:`sim.models.graph.MixturePart.loads`; Megatron-Core's all-to-all dispatcher), or
    the deduplicated exchange (:func:`_deduplicated`); the combine sends the same bytes back. Or it is Megatron-Core's
    all-gather dispatcher (:func:`_gathered`): every member's tokens, routing map and scores gathered to all, the
    experts' outputs reduce-scattered back; its volume does not depend on the routing, only on the group's tokens.

    The op holds no link in the engine (``held_links`` empty): an expert-parallel group spans data-parallel
    replicas, so the replicas' EP ops of one microbatch are one exchange, whose time already counts every group's
    traffic on every link; were each replica's copy to hold the links, the copies would queue behind each other as
    if they were different traffic. What the exchange does not see is other traffic on the same links at the same
    moment (pipeline sends, gradient reductions): an optimistic simplification.
    """
    ep_groups = tuple(layout.ep_group(pipeline_rank, d, t) for d in range(layout.expert_dp)
                      for t in range(layout.etp))
    etp_groups = tuple(layout.etp_group(pipeline_rank, d, e) for d in range(layout.expert_dp)
                       for e in range(layout.ep))
    parts: list[tuple[CollectiveCost, int, int]] = []
    for layer in layers:
        part = layer.transformer
        mixture = part.moe if part is not None else None
        if mixture is None:
            continue
        tokens = microbatch_size * part.seq // part.cp // (part.tp if part.sequence_parallel else 1)
        nbytes = tokens * mixture.topk * part.hidden * dtype_bytes  # each device's token copies
        if layout.ep > 1 and mixture.dispatcher == "deduplicated":
            cost = _deduplicated(oracle, ep_groups, mixture, tokens * part.hidden * dtype_bytes)
            parts.append((cost, 2, nbytes))
        elif layout.ep > 1 and mixture.dispatcher == "all-gather":
            parts.extend(_gathered(oracle, ep_groups, tokens, part.hidden, mixture.experts, dtype_bytes))
        elif layout.ep > 1:
            cost = oracle.all_to_all(ep_groups, nbytes, mixture.loads)
            parts.append((cost, 2, nbytes))  # the dispatch, and the combine back (the same bytes reversed)
        if layout.etp > 1:  # the slowest EP rank's received tokens, gathered over its expert-tensor group
            load = max(mixture.loads) * layout.ep if mixture.loads else 1.0
            gathered = round(nbytes * load) * layout.etp
            for name in ("all_gather", "reduce_scatter"):
                parts.append((oracle.collective(name, etp_groups, gathered), 1, gathered))
    return sequential_cost(parts, ())


#: Bytes of one entry of Megatron-Core's routing map (a bool tensor, tokens × experts) that the all-gather dispatcher
#: gathers beside the scores.
_ROUTING_MAP_ENTRY = 1


def _gathered(oracle: CostOracle, ep_groups: tuple[tuple[int, ...], ...], tokens: int, hidden: int, experts: int,
              dtype_bytes: int) -> list[tuple[CollectiveCost, int, int]]:
    """Megatron-Core's all-gather token dispatcher (``MoEAllGatherTokenDispatcher``, the default of Megatron-LM's
    ``--moe-token-dispatcher-type``) for one MoE layer over ``ep_groups``: the dispatch gathers every member's
    ``tokens`` hidden states, their routing map (tokens × experts bools) and their scores (tokens × experts, in the
    model's precision: ``moe_router_dtype`` unset) to every member, each of which picks the rows routed to its own
    experts; the combine reduce-scatters the experts' weighted outputs over all the group's tokens back to their
    members (Megatron-LM ``megatron/core/transformer/moe/token_dispatcher.py``, ``token_dispatch`` and
    ``token_combine``). A backward pass runs the reverse pair on the gradients (the routing map excepted, a small
    share this costs alike). The kernels around it are the all-to-all dispatcher's (:mod:`sim.cost.kernels.moe`):
    Megatron permutes the gathered tokens on the receiving side instead of each token's copies on the sending side,
    the same rows written, so the permutation is costed alike. Returned as (cost, repeats, bytes) parts of
    :func:`expert_exchange_cost`."""
    members = len(ep_groups[0])
    per_token = hidden * dtype_bytes + experts * (dtype_bytes + _ROUTING_MAP_ENTRY)
    gathered = members * tokens * per_token  # each member's output: every member's share
    combined = members * tokens * hidden * dtype_bytes  # each member's buffer: outputs for every token of the group
    return [(oracle.collective("all_gather", ep_groups, gathered), 1, gathered),
            (oracle.collective("reduce_scatter", ep_groups, combined), 1, combined)]


def _deduplicated(oracle: CostOracle, ep_groups: tuple[tuple[int, ...], ...], mixture: MixturePart,
                  token_bytes: int) -> CollectiveCost:
    """The deduplicated dispatch (or combine) of one MoE layer over ``ep_groups``
    (:func:`sim.cost.collectives.deduplicated_all_to_all_cost`): each token sent once to each of the servers its
    experts lie on, as many on average as :func:`sim.models.routing.expected_servers` says for the mixture's
    (group-limited) balanced routing, the experts placed in contiguous blocks over the group's servers.

    Raises:
        SpecError: a skewed or capped routing (modelled for balanced dropless routing only), or expert groups and
            servers that do not nest.
    """
    if mixture.loads:
        raise SpecError("{ep_dispatcher} deduplicated is modelled for balanced dropless routing; use --routing "
                        "balanced without --capacity-factor", "ep_dispatcher")
    servers = len(server_parts(oracle.topology, ep_groups[0]))
    try:
        spread = expected_servers(mixture.experts, mixture.topk, servers, groups=mixture.groups,
                                  group_topk=mixture.group_topk)
    except SpecError as error:
        raise SpecError(f"{{ep_dispatcher}} deduplicated: {error} (the expert-parallel group spans {servers} "
                        f"servers)", "ep_dispatcher") from None
    return oracle.deduplicated_all_to_all(ep_groups, token_bytes, mixture.topk, spread)
