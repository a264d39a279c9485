"""Token routing over experts: shares that sum to one, a seeded skew that is reproducible and Zipf-shaped, traces
read from files, each expert-parallel rank's load against brute force, and refusals."""

import json
import math

import pytest

from sim.core.errors import SpecError
from sim.models.routing import (
    BALANCED,
    Routing,
    capped_shares,
    dropped_fraction,
    expert_shares,
    parse_routing,
    rank_loads,
    routable_shares,
    slowest_rank,
)


@pytest.mark.parametrize("routing", [BALANCED, Routing("skew", 1.0), Routing("skew", 2.5, seed=7),
                                     Routing("trace", counts=((5, 0, 3, 8),))])
def test_shares_sum_to_one(routing):
    for layer in range(3):
        shares = expert_shares(routing, layer, 4, topk=1)
        assert len(shares) == 4 and math.isclose(sum(shares), 1.0, rel_tol=1e-12) and min(shares) >= 0


def test_a_skew_is_zipf_over_experts_reproducible_and_different_per_layer_and_seed():
    shares = expert_shares(Routing("skew", 1.0, seed=1), 0, 8, topk=2)
    ranked = sorted(shares, reverse=True)
    harmonic = sum(1 / r for r in range(1, 9))
    assert ranked == pytest.approx([1 / r / harmonic for r in range(1, 9)], rel=1e-12)
    assert shares == expert_shares(Routing("skew", 1.0, seed=1), 0, 8, topk=2)  # same inputs, same spread
    assert shares != expert_shares(Routing("skew", 1.0, seed=1), 1, 8, topk=2)  # another layer, other hot experts
    assert shares != expert_shares(Routing("skew", 1.0, seed=2), 0, 8, topk=2)
    assert expert_shares(Routing("skew", 0.0), 0, 8, topk=2) == expert_shares(BALANCED, 0, 8, topk=2)


def test_no_expert_gets_more_than_one_slot_per_token():
    # A steep skew over 4 experts with top-2: the hottest expert would get 85 % of the slots, but each token's two
    # experts are distinct, so it gets at most every token once (1/2 of the slots); the rest keep their proportions.
    raw = expert_shares(Routing("skew", 3.0, seed=1), 0, 4, topk=1)
    shares = expert_shares(Routing("skew", 3.0, seed=1), 0, 4, topk=2)
    hot = max(range(4), key=raw.__getitem__)
    assert raw[hot] > 0.8 and shares[hot] == 0.5 and math.isclose(sum(shares), 1.0, rel_tol=1e-12)
    others = [e for e in range(4) if e != hot]
    assert [shares[e] / shares[others[0]] for e in others] == pytest.approx([raw[e] / raw[others[0]] for e in others])
    # Water-filling that caps a second expert once the first's excess lifts it over the cap.
    assert routable_shares((0.5, 0.3, 0.1, 0.1), 3) == pytest.approx((1 / 3, 1 / 3, 1 / 6, 1 / 6))
    assert routable_shares((0.7, 0.2, 0.05, 0.05), 2) == pytest.approx((0.5, 1 / 3, 1 / 12, 1 / 12))
    assert routable_shares((0.5, 0.5, 0.0, 0.0), 2) == (0.5, 0.5, 0.0, 0.0)  # routable: unchanged
    with pytest.raises(ValueError, match="topk must be in 1..4"):
        routable_shares((0.25,) * 4, 5)


def test_rank_loads_and_the_slowest_rank_against_brute_force():
    shares = expert_shares(Routing("skew", 1.3, seed=4), 2, 16, topk=1)
    for ep in (1, 2, 4, 8, 16):
        loads = rank_loads(shares, ep)
        brute = [sum(share for e, share in enumerate(shares) if e // (16 // ep) == r) for r in range(ep)]
        assert loads == pytest.approx(brute, rel=1e-12)
        assert loads[slowest_rank(shares, ep)] == pytest.approx(max(brute), rel=1e-12)


def test_a_capacity_factor_caps_each_expert_and_counts_what_it_drops():
    shares = (0.5, 0.25, 0.125, 0.125)
    assert capped_shares(shares, 0) == shares and dropped_fraction(shares, 0) == 0
    assert capped_shares(shares, 1.0) == (0.25, 0.25, 0.125, 0.125)
    assert dropped_fraction(shares, 1.0) == pytest.approx(0.25)


def test_traces_are_read_from_json_and_kept_in_the_plan(tmp_path):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"counts": [[4, 2, 1, 1], [1, 1, 1, 5]]}))
    routing = parse_routing(f"trace:{path}")
    assert expert_shares(routing, 1, 4, topk=1) == (0.125, 0.125, 0.125, 0.625)
    assert expert_shares(routing, 2, 4, topk=1) == expert_shares(routing, 0, 4, topk=1)  # reused cyclically
    assert parse_routing(routing.spec()) == routing  # a plan keeps the counts inline
    skew = parse_routing("skew:1.5:9")
    assert (skew.exponent, skew.seed) == (1.5, 9) and parse_routing(skew.spec()) == skew
    assert parse_routing("balanced") == BALANCED == parse_routing(BALANCED.spec())
    with pytest.raises(SpecError, match="lists 4 experts per layer; the model has 8"):
        expert_shares(routing, 0, 8, topk=1)


@pytest.mark.parametrize("text, message", [
    ("zipf", "routing must be balanced, skew:S\\[:SEED\\] or trace:FILE, got 'zipf'"),
    ("skew:abc", "skew:S or skew:S:SEED"),
    ("skew:-1", "S a number >= 0"),
    ("trace:/no/such.json", "routing trace file /no/such.json does not exist"),
])
def test_bad_routings_are_refused_by_name(text, message):
    with pytest.raises(SpecError, match=message):
        parse_routing(text)


def test_bad_trace_files_are_refused(tmp_path):
    path = tmp_path / "t.json"
    for content, message in (("{", "not valid JSON"), ("[1, 2]", "must be a JSON object with counts"),
                             ('{"counts": [[1, 2], [3]]}', "the same experts"),
                             ('{"counts": [0, 0]}', "not all 0")):
        path.write_text(content)
        with pytest.raises(SpecError, match=message):
            parse_routing(f"trace:{path}")


# --- how many servers a token's experts span ------------------------------------------------------------------------


def _servers_by_enumeration(experts, topk, servers, groups=0, group_topk=0):
    """The oracle: every choice of groups, then every choice of experts among them, equally likely."""
    import itertools

    per_server = experts // servers
    if not groups:
        choices = list(itertools.combinations(range(experts), topk))
        return sum(len({e // per_server for e in c}) for c in choices) / len(choices)
    per_group = experts // groups
    total = 0.0
    group_choices = list(itertools.combinations(range(groups), group_topk))
    for chosen in group_choices:
        allowed = [e for e in range(experts) if e // per_group in chosen]
        choices = list(itertools.combinations(allowed, topk))
        total += sum(len({e // per_server for e in c}) for c in choices) / len(choices)
    return total / len(group_choices)


@pytest.mark.parametrize("experts, topk, servers, groups, group_topk", [
    (8, 2, 4, 0, 0), (12, 3, 3, 0, 0), (16, 4, 8, 8, 4), (16, 3, 4, 8, 4), (16, 4, 2, 8, 3), (16, 2, 8, 4, 2),
    (24, 4, 6, 12, 5), (8, 8, 2, 0, 0),
])
def test_expected_servers_is_the_enumerated_mean(experts, topk, servers, groups, group_topk):
    from sim.models.routing import expected_servers

    assert expected_servers(experts, topk, servers, groups=groups, group_topk=group_topk) == pytest.approx(
        _servers_by_enumeration(experts, topk, servers, groups, group_topk), rel=1e-12)


def test_deepseek_v3s_group_limit_keeps_a_token_on_fewer_servers():
    from sim.models.routing import expected_servers

    # 256 experts on 8 servers, top 8; n_group 8, topk_group 4 (its config): at most 4 servers, about 3.6 on average
    limited, free = expected_servers(256, 8, 8, groups=8, group_topk=4), expected_servers(256, 8, 8)
    assert 3.5 < limited < 4 < free < 8


@pytest.mark.parametrize("args, message", [
    ((10, 2, 4), "do not spread evenly"), ((16, 2, 4, 6, 2), "groups dividing"), ((16, 9, 2, 8, 2), "exceeds"),
    ((24, 2, 4, 6, 2), "do not nest"),
])
def test_expected_servers_refuses_what_does_not_divide(args, message):
    from sim.models.routing import expected_servers

    experts, topk, servers, *rest = args
    groups, group_topk = rest if rest else (0, 0)
    with pytest.raises(SpecError, match=message):
        expected_servers(experts, topk, servers, groups=groups, group_topk=group_topk)
