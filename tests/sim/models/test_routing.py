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
