"""The routing a plan names, forced on a mixture: slot counts by the largest-remainder method, k distinct experts per
token with each expert's count exact, the capacity factor's drops against brute force, and a forced mixture that
still trains its router."""

import itertools
import math

import pytest
import torch

from executor.nn.forced_routing import ForcedRouting, expert_capacity, forced_experts, kept_slots, slot_counts
from executor.nn.moe import Mixture
from sim.models.routing import BALANCED, Routing, expert_shares


@pytest.mark.parametrize("shares, tokens, topk", [
    ((0.25,) * 4, 8, 2), ((0.5, 0.25, 0.125, 0.125), 7, 2), ((0.4, 0.3, 0.2, 0.1), 5, 1),
    ((1 / 3, 1 / 3, 1 / 6, 1 / 6), 10, 3), ((0.5, 0.5, 0.0, 0.0), 3, 2),
])
def test_slot_counts_are_the_largest_remainder_apportionment(shares, tokens, topk):
    counts = slot_counts(shares, tokens, topk)
    slots = tokens * topk
    assert sum(counts) == slots and max(counts) <= tokens
    # Brute force over every way to round each quota down or up: the chosen one is the closest in the largest
    # remainder sense (each count within one of its quota, the ups going to the largest fractional parts).
    quotas = [share * slots for share in shares]
    assert all(math.floor(q) <= c <= math.ceil(q) for q, c in zip(quotas, counts, strict=True))
    ups = [e for e in range(len(shares)) if counts[e] > math.floor(quotas[e])]
    downs = [e for e in range(len(shares)) if counts[e] == math.floor(quotas[e]) and quotas[e] % 1]
    assert all(quotas[u] % 1 >= quotas[d] % 1 for u, d in itertools.product(ups, downs))


@pytest.mark.parametrize("routing, experts, topk, tokens", [
    (BALANCED, 4, 2, 8), (Routing("skew", 1.2, seed=3), 8, 2, 16), (Routing("skew", 3.0), 4, 2, 6),
    (Routing("trace", counts=((9, 1, 0, 6),)), 4, 1, 5),
])
def test_every_token_gets_k_distinct_experts_and_every_expert_its_count(routing, experts, topk, tokens):
    shares = expert_shares(routing, 0, experts, topk=topk)
    chosen = forced_experts(shares, tokens, topk)
    assert chosen.shape == (tokens, topk) and chosen.dtype == torch.int64
    assert all(len(set(row.tolist())) == topk for row in chosen)
    assert torch.bincount(chosen.reshape(-1), minlength=experts).tolist() == slot_counts(shares, tokens, topk)


def test_a_skew_routes_each_layer_differently_and_the_same_every_time():
    skew = Routing("skew", 1.5, seed=2)
    first, again, other = ForcedRouting(skew, 0, 8, 2), ForcedRouting(skew, 0, 8, 2), ForcedRouting(skew, 1, 8, 2)
    cpu = torch.device("cpu")
    assert torch.equal(first(16, cpu), again(16, cpu))
    assert not torch.equal(first(16, cpu), other(16, cpu))


def test_the_capacity_keeps_each_experts_first_slots_in_token_order():
    chosen = forced_experts(expert_shares(Routing("skew", 2.0, seed=1), 0, 4, topk=2), 12, 2)
    capacity = expert_capacity(12, 2, 4, 1.0)
    assert capacity == 6 and expert_capacity(12, 2, 4, 0.0) is None
    kept = kept_slots(chosen, capacity)
    seen: dict[int, int] = {}  # brute force: walk the slots token by token, slot by slot
    for t, j in itertools.product(range(12), range(2)):
        e = int(chosen[t, j])
        seen[e] = seen.get(e, 0) + 1
        assert bool(kept[t, j]) == (seen[e] <= capacity), (t, j)
    assert not kept.all()  # the skew's hot expert overflows: something is dropped


def test_a_forced_mixture_weights_the_given_experts_by_their_scores_and_trains_its_router():
    torch.manual_seed(0)
    mixture = Mixture(16, 4, 2, 8, 0, router_bias=False, expert_bias=False, sigmoid=False, swiglu_clamp=0)
    mixture.init_parameters(torch.Generator().manual_seed(1), 0.02)
    mixture.force_routing(BALANCED)
    x = torch.randn(1, 8, 16)
    chosen, weights = mixture.route(x.reshape(-1, 16))
    assert torch.equal(chosen, forced_experts((0.25,) * 4, 8, 2))
    scores = torch.softmax(mixture.router(x.reshape(-1, 16)), dim=-1).gather(1, chosen)
    torch.testing.assert_close(weights, scores / scores.sum(dim=-1, keepdim=True))
    mixture(x).sum().backward()
    assert mixture.router.weight.grad is not None and mixture.router.weight.grad.abs().sum() > 0
