"""The routing a plan names, forced on a mixture's tokens, and the capacity factor's drops.

A plan predicts a mixture under the spread of tokens over experts it names (``--routing``, :mod:`sim.models.routing`):
balanced by default, as the published benchmarks force it (Megatron-Bridge's performance notes: "we force-balance the
token distribution among experts"; Megatron-Core's ``--moe-router-force-load-balancing``). A run that is to be held
against that prediction must route the same way, so the executor overrides the router's choice of experts:

* each MoE layer's shares p_e (the plan's routing for that layer, :func:`sim.models.routing.expert_shares`) are
  turned into whole slot counts c_e over the microbatch's k·T slots (T tokens, top-k) by the largest-remainder
  method, each at most T (a token's k experts are distinct; the shares are routable, so none needs more);
* the experts, each repeated c_e times in expert order, are laid out in one row of k·T slots, and token t takes the
  slots t, t + T, …, t + (k−1)·T (:func:`forced_experts`). An expert's slots are one contiguous run of at most T, so no
  two of a token's slots fall in it: every token gets k distinct experts, and expert e exactly c_e tokens;
* the router still scores every expert, and a token's output is weighted by its scores for the experts it was given,
  renormalised as the learned routing's are, so the router still receives gradients.

The choice depends only on T, k, the layer and the routing, not on the data, so every data-parallel replica, every
rebuild of a recomputed layer and the single-process reference choose alike.

A capacity factor c (``--capacity-factor``; Fedus et al. 2021, arXiv 2101.03961 §2.2) lets each expert compute at
most ⌈c·k·T/E⌉ of a microbatch's slots (Megatron-Core's capacity, rounded up); the slots beyond it, in token order, are
dropped: they are neither sent nor computed, and the token keeps only its residual (and shared experts') path.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sim.models.routing import Routing, expert_shares

__all__ = ["slot_counts", "forced_experts", "ForcedRouting", "expert_capacity", "kept_slots"]


def slot_counts(shares: tuple[float, ...], tokens: int, topk: int) -> list[int]:
    """Whole slot counts per expert summing to ``tokens · topk``, proportional to ``shares`` by the largest-remainder
    method (ties to the lower expert), none above ``tokens`` (module docstring).

    Raises:
        ValueError: shares that cannot be routed (one above 1/``topk`` would need an expert twice per token).
    """
    slots = tokens * topk
    quotas = [share * slots for share in shares]
    counts = [min(tokens, math.floor(q)) for q in quotas]
    short = slots - sum(counts)
    order = sorted(range(len(shares)), key=lambda e: (-(quotas[e] - counts[e]), e))
    for e in order:
        if short == 0:
            break
        if counts[e] < tokens:
            counts[e] += 1
            short -= 1
    if short:
        raise ValueError(f"shares {shares} cannot be routed to {topk} distinct experts per token")
    return counts


def forced_experts(shares: tuple[float, ...], tokens: int, topk: int) -> Tensor:
    """(tokens, topk) int64: each token's experts, distinct, expert e chosen by exactly ``slot_counts(...)[e]`` tokens
    (module docstring)."""
    counts = slot_counts(shares, tokens, topk)
    row = torch.repeat_interleave(torch.arange(len(shares)), torch.tensor(counts))
    return row.view(topk, tokens).t().contiguous()


class ForcedRouting:
    """The experts a plan's routing gives one MoE layer's microbatches, by token count (memoised).

    Args:
        routing: the plan's routing.
        moe_index: the layer's position among the model's MoE layers (a skew's hot experts differ per layer).
        experts: E.
        topk: k.
    """

    def __init__(self, routing: Routing, moe_index: int, experts: int, topk: int) -> None:
        self.shares = expert_shares(routing, moe_index, experts, topk=topk)
        self.topk = topk
        self._chosen: dict[int, Tensor] = {}

    def __call__(self, tokens: int, device: torch.device) -> Tensor:
        """(tokens, k) int64 on ``device``: the experts of a microbatch of ``tokens`` tokens."""
        if tokens not in self._chosen:
            self._chosen[tokens] = forced_experts(self.shares, tokens, self.topk)
        return self._chosen[tokens].to(device)


def expert_capacity(tokens: int, topk: int, experts: int, capacity_factor: float) -> int | None:
    """Slots each expert computes at most, ⌈c·k·T/E⌉; ``None`` when dropless (c = 0)."""
    if not capacity_factor:
        return None
    return math.ceil(capacity_factor * tokens * topk / experts)


def kept_slots(chosen: Tensor, capacity: int) -> Tensor:
    """(T, k) bool: the slots each expert keeps under ``capacity``, its first ones in token order (then slot order)."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first = torch.searchsorted(experts, experts, right=False)  # where each expert's run starts in the sorted order
    place = torch.arange(flat.numel(), device=flat.device) - first
    kept = torch.empty_like(flat, dtype=torch.bool)
    kept[order] = place < capacity
    return kept.view_as(chosen)
