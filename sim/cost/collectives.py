"""Collective costs on the topology: all-reduce, reduce-scatter, all-gather, broadcast and all-to-all over the real
links.

:func:`collective_cost` prices one collective run at the same moment by every group of ``groups`` (the symmetric
instances of one op, e.g. the data-parallel all-reduces of all tensor-parallel shards of a stage). Each algorithm
is a sequence of **phases** of point-to-point transfers over ``topology.path``; phase j of every group runs at the
same time as phase j of the others, so their transfers share links. How a phase is timed (per-link loads, flows
sharing a link, pipelined routes) is the flow model of :mod:`sim.cost.flows`; the cost is the slowest group's time,
and ``bytes_per_link`` adds up what each link carries over all phases and steps (what the engine holds links for).

Algorithms (n members, S = ``nbytes``, one link of bandwidth B and latency α per hop in the closed forms):

* ``ring`` (the group's order is the ring): all_reduce = reduce-scatter then all-gather, 2(n-1) steps in which
  every member sends S/n to its successor: ``2(n-1)/n · S/B + 2(n-1)·α``; reduce_scatter and all_gather n-1 such
  steps: ``(n-1)/n · S/B + (n-1)·α``; broadcast: a pipelined chain from the root: ``S/B + (n-1)·α``.
* ``tree``: all_reduce on NCCL's double binary tree: two binary trees over the group's positions (leaves of one are
  the inner nodes of the other: the second is the first mirrored, or shifted by one when n is odd), each carrying
  S/2, pipelined up (reduce) then down (broadcast). Each member sends and receives about S per phase, so on one
  switch: ``2·(D·α + S/B)`` with D = ⌈log2 n⌉ the tree depth. This is NCCL's tree model (``src/graph/tuning.cc``:
  latency ``2·(... + log2(nNodes)·interLat)``, algorithm bandwidth ``busBw · 0.5``; NCCL 2.4 blog "Massively Scale
  Your Deep Learning Training with NCCL 2.4"), with the tree over the group's members rather than NCCL's chain
  inside a server and tree across servers, and without NCCL's 0.92 tree efficiency (the link bandwidths are already
  effective rates). broadcast: a pipelined binary (heap-ordered) tree from the root: ``⌊log2 n⌋·α + 2·S/B``.
  reduce_scatter and all_gather have no tree in NCCL; they are costed as ``ring`` (and reported as ``"ring"``).
* ``hierarchical`` (members grouped by server, k per server, m servers, in order of first appearance):
  all_reduce = intra-server ring reduce-scatter of S, k concurrent inter-server ring all-reduces of S/k among the
  members with the same local index, intra-server ring all-gather; reduce_scatter = the first two levels (inter
  part a reduce-scatter), all_gather = the mirror (inter-server all-gather of S/k, then intra-server all-gather);
  broadcast = a pipelined chain that visits each server's members together, root's server first. Within one server
  it equals ``ring``; a group with unequal members per server is costed as ``ring`` (reported as ``"ring"``).
* ``auto``: the fastest of the three, ties to ring, then tree, then hierarchical.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sim.cost.flows import Carried, LinkKey, Phase, Transfers, evaluate, link_bytes, route_table
from sim.hw.topology import Topology

__all__ = ["COLLECTIVE_KINDS", "ALGORITHMS", "CollectiveCost", "collective_cost", "all_to_all_cost",
           "deduplicated_all_to_all_cost", "server_parts",
           "concurrent_transfer"]

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
ALGORITHMS = ("ring", "tree", "hierarchical")  # in auto's tie-break order; "auto" is accepted as an argument

@dataclass(frozen=True)
class CollectiveCost:
    """The uncontended cost of one collective run by a set of concurrent groups.

    Attributes:
        seconds: time until the slowest group finishes, with the groups sharing links (s).
        algorithm: the algorithm costed (the chosen one under ``"auto"``; ``"ring"`` where tree or hierarchical
            fall back to it).
        link_keys: sorted ``(link.src, link.dst)`` of every link any group's transfers cross.
        bytes_per_link: ``((src, dst), bytes)`` for each of ``link_keys``, in the same order: the bytes that link
            carries over the whole collective, all groups together (rounded to whole bytes).
    """

    seconds: float
    algorithm: str
    link_keys: tuple[LinkKey, ...]
    bytes_per_link: tuple[tuple[LinkKey, int], ...]


def collective_cost(
    topology: Topology, kind: str, groups: Sequence[Sequence[int]], nbytes: int, algorithm: str = "auto"
) -> CollectiveCost:
    """Cost of collective ``kind`` run at once by every group of ``groups`` (module docstring for the model).

    Args:
        topology: the cluster; ranks index ``topology.devices``.
        kind: one of :data:`COLLECTIVE_KINDS`.
        groups: the concurrent groups, each a sequence of distinct ranks in ring order (broadcast root first); a
            rank may be in at most one group; groups of one rank cost 0.
        nbytes: S in bytes: each rank's buffer (all_reduce, reduce_scatter), each rank's output (all_gather), the
            root's message (broadcast).
        algorithm: one of :data:`ALGORITHMS` or ``"auto"``.

    Raises:
        ValueError: unknown ``kind`` or ``algorithm``, ``nbytes`` negative or not a finite number, a rank that is
            not an integer in ``range(topology.num_ranks)``, an empty group, or a rank in two places; the message
            names the value.
    """
    key = ("collective", kind, tuple(tuple(group) for group in groups), nbytes, algorithm)
    cost = topology.cost_memo.get(key)
    if cost is None:
        cost = topology.cost_memo[key] = _collective_cost(topology, kind, groups, nbytes, algorithm)
    return cost


def _collective_cost(topology: Topology, kind: str, groups: Sequence[Sequence[int]], nbytes: int,
                     algorithm: str) -> CollectiveCost:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r} (known: {', '.join(COLLECTIVE_KINDS)})")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)}, auto)")
    _check_nbytes(nbytes)
    members = [g for g in _check_groups(topology, groups) if len(g) > 1]  # a group of one rank moves nothing
    routes = route_table(topology)
    best: tuple[float, str, Carried] | None = None
    for name in ALGORITHMS if algorithm == "auto" else (algorithm,):
        if algorithm == "auto" and name == "tree" and kind in ("reduce_scatter", "all_gather"):
            continue  # the ring itself: already costed, and ties go to ring
        costed, plans = _plans(topology, kind, members, float(nbytes), name)
        seconds, carried = evaluate(routes, plans, len(members), math.inf if best is None else best[0])
        if best is None or seconds < best[0]:
            best = (seconds, costed, carried)
    assert best is not None
    seconds, costed, carried = best
    keys, carried_bytes = link_bytes(routes, carried)
    return CollectiveCost(
        seconds=float(seconds),
        algorithm=costed,
        link_keys=tuple(keys),
        bytes_per_link=tuple(zip(keys, carried_bytes, strict=True)),
    )


def concurrent_transfer(topology: Topology, pairs: Sequence[tuple[int, int]], nbytes: int
                        ) -> tuple[float, tuple[tuple[LinkKey, int], ...]]:
    """Point-to-point messages of ``nbytes`` bytes sent at once, one per ``(source rank, destination rank)`` of
    ``pairs``, sharing links by the flow model of :mod:`sim.cost.flows`.

    Returns:
        (time in s until the slowest has arrived, ``((src, dst), bytes)`` of every link crossed, sorted); a pair
        whose ranks are equal moves nothing.

    Raises:
        ValueError: ``nbytes`` negative or not a finite number, or a rank out of range; the message names it.
    """
    key = ("transfer", tuple(tuple(pair) for pair in pairs), nbytes)
    found = topology.cost_memo.get(key)
    if found is None:
        found = topology.cost_memo[key] = _concurrent_transfer(topology, pairs, nbytes)
    return found


def _concurrent_transfer(topology: Topology, pairs: Sequence[tuple[int, int]], nbytes: int
                         ) -> tuple[float, tuple[tuple[LinkKey, int], ...]]:
    _check_nbytes(nbytes)
    moving = [(src, dst) for src, dst in ((_rank(topology, a), _rank(topology, b)) for a, b in pairs) if src != dst]
    if not moving:
        return 0.0, ()
    edges = np.array([(src, dst, -1) for src, dst in moving], dtype=np.int64)
    transfers = Transfers(edges, np.arange(len(moving)), float(nbytes), 1)
    routes = route_table(topology)
    seconds, carried = evaluate(routes, [[transfers]], len(moving))
    keys, carried_bytes = link_bytes(routes, carried)
    return seconds, tuple(zip(keys, carried_bytes, strict=True))


def all_to_all_cost(topology: Topology, groups: Sequence[Sequence[int]], nbytes: int,
                    shares: Sequence[float] | None = None) -> CollectiveCost:
    """Cost of an all-to-all run at once by every group of ``groups`` (NCCL's all-to-all: each member's sends to and
    receives from every other member of its group, grouped into one launch, so they all move at once and share
    links by the flow model of :mod:`sim.cost.flows`).

    Member i of a group sends ``nbytes · shares[j]`` bytes to member j (the tokens routed to j's experts); what it
    routes to itself stays put. ``shares`` is indexed by position in the group and sums to 1 (default: ``1/n``
    each, a balanced routing). The time is the slowest group's; the reverse exchange (the combine) costs the same on
    full-duplex links.

    Raises:
        ValueError: ``nbytes`` negative or not finite, a malformed group (as :func:`collective_cost`), groups of
            unequal sizes, or ``shares`` of another length or negative.
    """
    _check_nbytes(nbytes)
    members = [g for g in _check_groups(topology, groups) if len(g) > 1]
    if not members:
        return CollectiveCost(0.0, "pairwise", (), ())
    n = len(members[0])
    if any(len(g) != n for g in members):
        raise ValueError(f"an all-to-all's concurrent groups must have equal sizes, got {[len(g) for g in members]}")
    weights = [1.0 / n] * n if shares is None else [float(x) for x in shares]
    if len(weights) != n or min(weights) < 0 or not all(math.isfinite(x) for x in weights):
        raise ValueError(f"all-to-all shares must be {n} numbers >= 0, got {list(shares or ())!r}")
    ranks = np.array(members, dtype=np.int64)
    ids = np.arange(len(members))
    phase: Phase = []
    for j in range(n):  # one transfer set per destination position: its senders all move the same bytes
        sources = [i for i in range(n) if i != j]
        edges = np.stack([ranks[:, sources].ravel(), np.repeat(ranks[:, j], len(sources)),
                          np.full(len(members) * len(sources), -1)], axis=1)
        phase.append(Transfers(edges, np.repeat(ids, len(sources)), nbytes * weights[j], 1))
    routes = route_table(topology)
    seconds, carried = evaluate(routes, [phase], len(members))
    keys, carried_bytes = link_bytes(routes, carried)
    return CollectiveCost(float(seconds), "pairwise", tuple(keys), tuple(zip(keys, carried_bytes, strict=True)))


def server_parts(topology: Topology, group: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``group``'s members split by server (:attr:`sim.hw.topology.Topology.node_of_rank`), servers in order of first
    appearance, members in ``group``'s order."""
    parts: dict[int, list[int]] = {}
    for rank in group:
        parts.setdefault(topology.node_of_rank[_rank(topology, rank)], []).append(rank)
    return tuple(tuple(members) for members in parts.values())


def deduplicated_all_to_all_cost(topology: Topology, groups: Sequence[Sequence[int]], token_bytes: float,
                                 topk: int, servers_per_token: float) -> CollectiveCost:
    """Cost of a mixture's token dispatch (or combine) that sends each token once to every server hosting one of its
    experts and fans it out inside the server, run at once by every group of ``groups`` (DeepSeek-V3, arXiv
    2412.19437 §3.2.2: "we first transmit tokens to the GPUs with the same in-node index on their target nodes via
    IB ... forwarded via NVLink to the specific GPUs that host their target experts"; DeepEP's internode kernels).

    Each member holds ``token_bytes`` of tokens (one copy of each), each token bound for ``topk`` experts on
    ``servers_per_token`` distinct servers on average (:func:`sim.models.routing.expected_servers`). Two exchanges:

    * across servers, over the *rails* (the members with the same position in their server's part of the group): each
      member sends ``token_bytes · servers_per_token`` spread evenly over the group's S servers, its own server's
      share staying put;
    * inside each server, over its part of the group: the ``token_bytes · topk`` token slots each member receives
      (as many, balanced, as it sends) forwarded to the members that hold their experts.

    DeepSeek's kernels run both at once (different warps send over IB, forward and receive over NVLink), so the time
    is the longer of the two; the links carry both. A group inside one server is the second exchange alone, as a
    plain all-to-all of the ``token_bytes · topk`` slots.

    Raises:
        ValueError: malformed groups (as :func:`all_to_all_cost`), a group whose servers hold unequal parts of it,
            or ``servers_per_token`` outside [1, S] or ``topk`` < 1.
    """
    members = [g for g in _check_groups(topology, groups) if len(g) > 1]
    if not members:
        return CollectiveCost(0.0, "pairwise", (), ())
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
    split = [server_parts(topology, g) for g in members]
    servers = len(split[0])
    if any(len(parts) != servers or len({len(p) for p in parts}) != 1 for parts in split):
        raise ValueError(f"a deduplicated dispatch needs every group spread evenly over the same number of servers, "
                         f"got {[[len(p) for p in parts] for parts in split]}")
    if not 1 <= servers_per_token <= servers:
        raise ValueError(f"servers_per_token must lie in [1, {servers}], got {servers_per_token!r}")
    inside = tuple(part for parts in split for part in parts)
    within = all_to_all_cost(topology, inside, round(token_bytes * topk))
    if servers == 1:
        return within
    per_server = len(split[0][0])
    rails = tuple(tuple(parts[s][i] for s in range(servers)) for parts in split for i in range(per_server))
    across = all_to_all_cost(topology, rails, round(token_bytes * servers_per_token))
    carried: dict[LinkKey, int] = dict(within.bytes_per_link)
    for key, nbytes in across.bytes_per_link:
        carried[key] = carried.get(key, 0) + nbytes
    keys = tuple(sorted(carried))
    return CollectiveCost(max(within.seconds, across.seconds), "deduplicated", keys,
                          tuple((key, carried[key]) for key in keys))


def _check_nbytes(nbytes: float) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


def _rank(topology: Topology, rank: int) -> int:
    try:
        index = operator.index(rank)
    except TypeError:
        raise ValueError(f"a rank must be an integer, got {rank!r}") from None
    if not 0 <= index < topology.num_ranks:
        raise ValueError(f"rank {rank!r} out of range for {topology.spec!r} ({topology.num_ranks} ranks)")
    return index


def _check_groups(topology: Topology, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    seen: set[int] = set()
    checked = []
    for group in groups:
        ranks = []
        for rank in group:
            index = _rank(topology, rank)
            if index in seen:
                raise ValueError(f"rank {index} appears twice in the collective's groups (in group {group!r})")
            seen.add(index)
            ranks.append(index)
        if not ranks:
            raise ValueError(f"empty collective group in {groups!r}")
        checked.append(ranks)
    return checked


# --- phase plans -----------------------------------------------------------------------------------------------------


def _plans(topology: Topology, kind: str, groups: list[list[int]], nbytes: float, algorithm: str
           ) -> tuple[str, list[Phase]]:
    """(the algorithm actually costed, its phases) for ``groups`` of two ranks or more. Groups of one shape are
    planned together, as the rows of one array, so the cost of a call does not grow with Python work per group."""
    if algorithm == "tree" and kind in ("reduce_scatter", "all_gather"):
        algorithm = "ring"  # NCCL has no tree for these
    shapes: dict[tuple[int, int], list[int]] = {}  # (servers, members per server) → group indices
    if algorithm == "hierarchical":
        servers = [_per_server(topology, g) for g in groups]
        if any(s is None for s in servers):
            algorithm = "ring"  # unequal members per server: no level structure to exploit
        else:
            groups = [[rank for server in s for rank in server] for s in servers if s is not None]
            for i, s in enumerate(servers):
                assert s is not None
                shapes.setdefault((len(s), len(s[0])), []).append(i)
    if algorithm != "hierarchical":
        for i, g in enumerate(groups):
            shapes.setdefault((1, len(g)), []).append(i)
    planner = {"ring": _ring_plan, "tree": _tree_plan, "hierarchical": _hierarchical_plan}[algorithm]
    parts = [planner(kind, m, k, _Rows(np.array([groups[i] for i in ids]), np.array(ids)), nbytes)
             for (m, k), ids in sorted(shapes.items())]
    return algorithm, [list(phase) for phase in zip(*parts, strict=True)]


def _per_server(topology: Topology, group: list[int]) -> list[list[int]] | None:
    """The group's members server by server (servers in order of first appearance, members in group order), or
    None when servers hold unequal numbers of them."""
    by_server: dict[int, list[int]] = {}
    for rank in group:
        by_server.setdefault(topology.node_of_rank[rank], []).append(rank)
    servers = list(by_server.values())
    return servers if len({len(s) for s in servers}) == 1 else None


@dataclass(frozen=True)
class _Rows:
    """Groups of one shape: ``ranks[r]`` is group ``ids[r]``'s members in position order."""

    ranks: np.ndarray
    ids: np.ndarray

    def part(self, template: np.ndarray, nbytes: float, steps: int, pipelined: bool = False) -> Transfers:
        """A template over positions (rows of (position, position, predecessor)) applied to every group."""
        count, size = len(self.ranks), len(template)
        before = template[:, 2] + (np.arange(count) * size)[:, None]
        edges = np.stack([self.ranks[:, template[:, 0]].ravel(), self.ranks[:, template[:, 1]].ravel(),
                          np.where(template[:, 2] >= 0, before, -1).ravel()], axis=1)
        return Transfers(edges, np.repeat(self.ids, size), nbytes, steps if size else 0, pipelined)


def _template(rows: list[list[int]]) -> np.ndarray:
    """(position, position, predecessor) rows as an array; read-only, since the templates are cached and shared."""
    template = np.array(rows, dtype=np.int64).reshape(-1, 3)
    template.flags.writeable = False
    return template


@lru_cache(maxsize=256)
def _ring(m: int, k: int, across: bool) -> np.ndarray:
    """Independent transfers over positions ``s·k + i`` (server s < m, local index i < k), each to its successor:
    within its server (``across`` False), or to the same local index on the next server (True)."""
    if across:
        return _template([[s * k + i, (s + 1) % m * k + i, -1] for s in range(m) for i in range(k)] if m > 1 else [])
    return _template([[s * k + i, s * k + (i + 1) % k, -1] for s in range(m) for i in range(k)] if k > 1 else [])


@lru_cache(maxsize=256)
def _chain(n: int) -> np.ndarray:
    """One pipelined route through positions 0 → 1 → ... → n-1."""
    return _template([[i, i + 1, i - 1] for i in range(n - 1)])


def _ring_plan(kind: str, m: int, k: int, rows: _Rows, nbytes: float) -> list[Transfers]:
    n = m * k
    if kind == "broadcast":
        return [rows.part(_chain(n), nbytes, 1, pipelined=True)]
    half = rows.part(_ring(1, n, False), nbytes / n, n - 1)
    return [half, half] if kind == "all_reduce" else [half]


def _btree_parent(p: int, n: int) -> int:
    """Parent of position ``p`` in NCCL's binary tree over positions 0..n-1 (root 0, -1 for the root).

    A non-root position with lowest set bit b hangs under the position with that bit cleared and the next one set,
    or, past the end, under the position with the bit cleared; leaves are the odd positions, depth ⌈log2 n⌉.
    """
    if p == 0:
        return -1
    bit = p & -p
    up = (p ^ bit) | (bit << 1)
    return up if up < n else p ^ bit


def _tree_template(parent: Sequence[int], position: Sequence[int], upward: bool, base: int) -> list[list[int]]:
    """Edges of a rooted tree over tree nodes 0..n-1 (``parent``; node t sits at group position ``position[t]``),
    parents before children; each edge's predecessor is the edge at its parent, so a route is a root-to-leaf path.
    ``upward`` points the transfers child → parent (reduce). ``base`` offsets the predecessor indices."""
    children: list[list[int]] = [[] for _ in parent]
    for t, q in enumerate(parent):
        if q >= 0:
            children[q].append(t)
    edges: list[list[int]] = []
    edge_at = {parent.index(-1): -1}
    frontier = [parent.index(-1)]
    while frontier:
        deeper = []
        for q in frontier:
            for t in children[q]:
                a, b = (position[t], position[q]) if upward else (position[q], position[t])
                edges.append([a, b, edge_at[q] + base if edge_at[q] >= 0 else -1])
                edge_at[t] = len(edges) - 1
                deeper.append(t)
        frontier = deeper
    return edges


@lru_cache(maxsize=256)
def _double_tree(n: int, upward: bool) -> np.ndarray:
    """Both trees of NCCL's double binary tree over positions 0..n-1, as one template."""
    parent = [_btree_parent(t, n) for t in range(n)]
    first = _tree_template(parent, range(n), upward, 0)
    # The second tree: the first mirrored (even n) or shifted by one (odd n), so that its inner nodes are the first
    # tree's leaves (mostly, for odd n) and every member sends and receives about the same bytes.
    second_position = [n - 1 - t for t in range(n)] if n % 2 == 0 else [(t + 1) % n for t in range(n)]
    return _template(first + _tree_template(parent, second_position, upward, len(first)))


@lru_cache(maxsize=256)
def _heap_tree(n: int) -> np.ndarray:
    """A binary tree from position 0, node t under (t-1)//2, transfers pointing down (broadcast)."""
    return _template(_tree_template([(t - 1) // 2 if t else -1 for t in range(n)], range(n), False, 0))


def _tree_plan(kind: str, m: int, k: int, rows: _Rows, nbytes: float) -> list[Transfers]:
    if kind == "broadcast":
        return [rows.part(_heap_tree(k), nbytes, 1, pipelined=True)]
    # each tree carries half the buffer: up to its root (reduce), then back down (broadcast)
    return [rows.part(_double_tree(k, True), nbytes / 2, 1, pipelined=True),
            rows.part(_double_tree(k, False), nbytes / 2, 1, pipelined=True)]


def _hierarchical_plan(kind: str, m: int, k: int, rows: _Rows, nbytes: float) -> list[Transfers]:
    if kind == "broadcast":
        return [rows.part(_chain(m * k), nbytes, 1, pipelined=True)]
    intra = rows.part(_ring(m, k, False), nbytes / k, k - 1)
    # the m members with local index i form inter-server ring i; each reduces (or gathers) the S/k block it holds
    inter = rows.part(_ring(m, k, True), nbytes / (k * m), m - 1)
    if kind == "all_reduce":
        return [intra, inter, inter, intra]
    return [intra, inter] if kind == "reduce_scatter" else [inter, intra]
