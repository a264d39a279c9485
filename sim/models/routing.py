"""How a mixture's tokens spread over its experts (``--routing``), and what that leaves each expert-parallel rank.

A router sends each token to k of E experts; over a microbatch expert e receives a share p_e of the k·T token slots
(Σ p_e = 1). Three spreads are modelled:

* ``balanced``: p_e = 1/E, what the published MoE benchmarks force (Megatron-Bridge's performance notes: "we
  force-balance the token distribution among experts");
* ``skew:S`` (``skew:S:SEED``): a Zipf-like spread, p ∝ 1/rank^S over the experts, S ≥ 0 (0 is balanced), which
  expert holds which rank drawn per layer from a seeded generator (seed 0 unless given), so every layer's hot experts
  differ and the same inputs give the same spread;
* ``trace:FILE``: measured per-expert token counts, a JSON object ``{"counts": [...]}`` with one list of E counts
  (every MoE layer) or one list per MoE layer (in order; the lists are reused cyclically when the model has more).

Expert parallelism (:mod:`sim.ir.parallel`, ``ep``) gives each of its E_p ranks a contiguous block of E/E_p experts,
as Megatron-Core numbers them; the rank whose experts receive the most slots is the one every other rank of the
all-to-all waits for, so the MoE layer's time is its time (:func:`slowest_rank`). A capacity factor c (``--capacity-
factor``; Fedus et al. 2021, arXiv 2101.03961 §2.2; 0: dropless) caps each expert at c·k·T/E slots; what lies beyond
is dropped (not computed, not sent).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.core.errors import SpecError
from sim.core.fileio import read_text

__all__ = ["ROUTINGS", "Routing", "BALANCED", "parse_routing", "expert_shares", "routable_shares", "rank_loads",
           "slowest_rank", "capped_shares", "dropped_fraction", "expected_servers", "MAX_TRACE_EXPERTS", "ROUTING_HELP",
           "CAPACITY_FACTOR_HELP"]

#: The help of ``--routing`` in every command that takes it (``sim.run``, ``sim.search``).
ROUTING_HELP = ("how tokens spread over experts: balanced (default; what published benchmarks force), skew:S[:SEED] "
                "(Zipf-like, exponent S, seeded), or trace:FILE (JSON {\"counts\": [...]} of measured tokens per "
                "expert, one list or one per MoE layer)")
#: The help of ``--capacity-factor`` in every command that takes it.
CAPACITY_FACTOR_HELP = ("each expert computes at most C times its balanced share of the tokens, the rest dropped "
                        "(default 0: dropless)")

#: The spreads ``--routing`` names.
ROUTINGS = ("balanced", "skew", "trace")
#: Most experts a trace may list per layer (a bound on what is read before anything is checked).
MAX_TRACE_EXPERTS = 65_536


@dataclass(frozen=True)
class Routing:
    """How tokens spread over experts (module docstring).

    Attributes:
        kind: one of :data:`ROUTINGS`.
        exponent: ``skew``'s Zipf exponent S ≥ 0.
        seed: ``skew``'s seed.
        counts: ``trace``'s measured tokens per expert, one tuple per MoE layer (reused cyclically).
    """

    kind: str = "balanced"
    exponent: float = 0.0
    seed: int = 0
    counts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROUTINGS:
            raise SpecError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.kind!r}")
        if not math.isfinite(self.exponent) or self.exponent < 0:
            raise SpecError(f"a skew's exponent must be a finite number >= 0, got {self.exponent!r}")
        if (self.kind == "trace") != bool(self.counts):
            raise SpecError("a trace routing needs its counts, and only a trace has them")
        for row in self.counts:
            if not row or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in row) or not sum(row):
                raise SpecError(f"a trace's counts must be integers >= 0, not all 0, got {list(row)[:8]!r}")

    def describe(self) -> str:
        """The spelling ``--routing`` takes (a trace by its shape, its counts being in the plan)."""
        if self.kind == "skew":
            return f"skew:{self.exponent:g}:{self.seed}"
        if self.kind == "trace":
            return f"trace ({len(self.counts)} layer(s) of {len(self.counts[0])} experts)"
        return "balanced"

    def spec(self) -> str:
        """The routing as ``plan.json``'s ``routing`` option records it: ``--routing``'s spelling, a trace's counts
        inline (``trace:[[...], ...]``), so that a plan needs no other file; :func:`parse_routing` reads it back."""
        if self.kind == "trace":
            return "trace:" + json.dumps([list(row) for row in self.counts], separators=(",", ":"))
        return self.describe()


#: Every expert receives the same share.
BALANCED = Routing()


def _count_rows(value: object, where: str) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, list) and value and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        value = [value]
    if (not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value)):
        raise SpecError(f"{where}: counts must be a list of per-expert token counts or a list of such lists, one per "
                        f"MoE layer")
    if any(len(row) != len(value[0]) for row in value) or len(value[0]) > MAX_TRACE_EXPERTS:
        raise SpecError(f"{where}: every layer's counts must list the same experts (at most {MAX_TRACE_EXPERTS:,})")
    return tuple(tuple(row) for row in value)


def parse_routing(text: str) -> Routing:
    """``balanced``, ``skew:S``, ``skew:S:SEED``, ``trace:FILE`` (or ``trace:[[...], ...]``, the counts inline, as
    :meth:`Routing.spec` writes them) as a :class:`Routing`.

    Raises:
        SpecError: another spelling, a malformed number, a trace file that is missing, not JSON or not a counts
            object (each message names the value and what would be valid).
    """
    kind, _, rest = text.strip().partition(":")
    if kind == "balanced" and not rest:
        return BALANCED
    if kind == "skew":
        exponent, _, seed = rest.partition(":")
        try:
            return Routing("skew", float(exponent), int(seed) if seed else 0)
        except ValueError:
            raise SpecError(f"routing skew takes skew:S or skew:S:SEED (S a number >= 0, SEED an integer), got "
                            f"{text!r}") from None
    if kind == "trace" and rest.startswith("["):  # the counts inline, as a plan records them
        try:
            return Routing("trace", counts=_count_rows(json.loads(rest), "the plan's routing trace"))
        except json.JSONDecodeError as exc:
            raise SpecError(f"the routing trace's inline counts are not valid JSON ({exc.msg})") from None
    if kind == "trace" and rest:
        path = Path(rest)
        if not path.is_file():
            raise SpecError(f"routing trace file {rest} does not exist")
        try:
            data = json.loads(read_text(path, "routing trace"))
        except json.JSONDecodeError as exc:
            raise SpecError(f"routing trace {rest} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or "counts" not in data:
            raise SpecError(f"routing trace {rest} must be a JSON object with counts (one list of per-expert token "
                            f"counts, or one per MoE layer)")
        return Routing("trace", counts=_count_rows(data["counts"], f"routing trace {rest}"))
    raise SpecError(f"routing must be balanced, skew:S[:SEED] or trace:FILE, got {text!r}")


def expert_shares(routing: Routing, layer: int, experts: int, *, topk: int) -> tuple[float, ...]:
    """Each expert's share of MoE layer ``layer``'s token slots (``layer`` counts the MoE layers from 0), routable by
    ``topk`` routing (:func:`routable_shares`).

    Raises:
        SpecError: a trace whose counts do not list ``experts`` experts.
    """
    if routing.kind == "balanced" or (routing.kind == "skew" and routing.exponent == 0):
        return (1.0 / experts,) * experts
    if routing.kind == "trace":
        row = routing.counts[layer % len(routing.counts)]
        if len(row) != experts:
            raise SpecError(f"the routing trace lists {len(row)} experts per layer; the model has {experts}")
        total = sum(row)
        return routable_shares(tuple(count / total for count in row), topk)
    weights = np.arange(1, experts + 1, dtype=np.float64) ** -routing.exponent
    order = np.random.default_rng([routing.seed, layer]).permutation(experts)  # which expert holds which rank
    shares = weights[order] / weights.sum()
    return routable_shares(tuple(float(x) for x in shares), topk)


def routable_shares(shares: tuple[float, ...], topk: int) -> tuple[float, ...]:
    """``shares`` with none above 1/``topk``: a token's k experts are distinct, so no expert can receive more than
    one slot per token, i.e. 1/k of the slots. What a steep skew (or a trace of another router) gives beyond that is
    spread over the other experts in proportion to their shares (water-filling), so the shares still sum to one and
    shares already routable come back unchanged.

    Raises:
        ValueError: ``topk`` outside 1..len(shares).
    """
    if not 1 <= topk <= len(shares):
        raise ValueError(f"topk must be in 1..{len(shares)} (the experts), got {topk}")
    cap = 1.0 / topk
    if max(shares) <= cap:
        return shares
    values = list(shares)
    capped: set[int] = set()
    while True:
        over = {e for e, share in enumerate(values) if e not in capped and share > cap}
        if not over:
            return tuple(values)
        capped |= over
        free = [e for e in range(len(values)) if e not in capped]
        left = max(0.0, 1.0 - cap * len(capped))  # what the experts below the cap share
        total = math.fsum(values[e] for e in free)
        for e in capped:
            values[e] = cap
        for e in free:  # in proportion to their shares; equally if they had none
            values[e] = left * (values[e] / total if total > 0 else 1.0 / len(free))


def rank_loads(shares: tuple[float, ...], ep: int) -> tuple[float, ...]:
    """The share of the slots each of ``ep`` expert-parallel ranks receives (its contiguous block of experts)."""
    per_rank = len(shares) // ep
    return tuple(math.fsum(shares[r * per_rank:(r + 1) * per_rank]) for r in range(ep))


def slowest_rank(shares: tuple[float, ...], ep: int) -> int:
    """The expert-parallel rank whose experts receive the most slots (the lowest such rank on ties)."""
    loads = rank_loads(shares, ep)
    return max(range(ep), key=lambda r: (loads[r], -r))


def capped_shares(shares: tuple[float, ...], capacity_factor: float) -> tuple[float, ...]:
    """The shares each expert computes under a capacity factor (each at most ``capacity_factor / E``; 0: dropless,
    nothing capped)."""
    if not capacity_factor:
        return shares
    cap = capacity_factor / len(shares)
    return tuple(min(share, cap) for share in shares)


def dropped_fraction(shares: tuple[float, ...], capacity_factor: float) -> float:
    """The fraction of the slots a capacity factor drops (0 when dropless)."""
    return max(0.0, 1.0 - math.fsum(capped_shares(shares, capacity_factor)))


def expected_servers(experts: int, topk: int, servers: int, *, groups: int = 0, group_topk: int = 0) -> float:
    """The expected number of distinct servers a token's ``topk`` experts lie on, the ``experts`` spread contiguously
    and evenly over ``servers`` servers (as expert parallelism places blocks of them, :func:`rank_loads`), under
    balanced routing: the token's experts drawn uniformly without repeats, from all experts, or under group-limited
    routing (``groups`` contiguous groups of experts, the token first choosing ``group_topk`` of them, then its experts
    among theirs: DeepSeek-V3's node-limited routing, arXiv 2412.19437 §2.1.2, its config's ``n_group`` and
    ``topk_group``). Groups must nest in servers or servers in groups.

    A server holding ``x`` of the ``n`` experts a token may choose from is missed with probability
    C(n − x, k) / C(n, k); the expectation sums the hits over servers (and over how many of a server's groups were
    chosen, hypergeometrically, when a server holds several groups).

    Raises:
        SpecError: sizes that do not divide (experts by servers or groups, groups and servers not nested), or
            ``topk`` larger than the experts it chooses from.
    """
    if servers < 1 or experts % servers:
        raise SpecError(f"{experts} experts do not spread evenly over {servers} servers")
    per_server = experts // servers
    if not groups:
        if topk > experts:
            raise SpecError(f"topk {topk} exceeds the {experts} experts")
        return servers * (1 - math.comb(experts - per_server, topk) / math.comb(experts, topk))
    if experts % groups or not 1 <= group_topk <= groups:
        raise SpecError(f"group-limited routing needs groups dividing the {experts} experts and 1 <= group_topk <= "
                        f"groups, got groups {groups}, group_topk {group_topk}")
    per_group = experts // groups
    chosen = group_topk * per_group
    if topk > chosen:
        raise SpecError(f"topk {topk} exceeds the {chosen} experts of the {group_topk} groups a token may choose")
    if groups % servers == 0:  # each server holds whole groups: count how many of its groups were chosen
        held = groups // servers
        total = math.comb(groups, group_topk)
        hit = sum(math.comb(held, j) * math.comb(groups - held, group_topk - j) / total
                  * (1 - math.comb(chosen - j * per_group, topk) / math.comb(chosen, topk))
                  for j in range(1, min(held, group_topk) + 1))
        return servers * hit
    if servers % groups == 0:  # each group spans several servers: the server's group chosen, then one of its experts
        return servers * (group_topk / groups) * (1 - math.comb(chosen - per_server, topk) / math.comb(chosen, topk))
    raise SpecError(f"{groups} expert groups and {servers} servers do not nest")
