"""A fast evaluator: a plan's iteration time as the longest path through its ops, for many cost vectors at once, far
faster than a simulation (``python -m sim.bench --search`` measures both rates).

When no two ops want one link at the same moment, the SimPy engine (``sim.engine.simpy_engine``, whose semantics
this module follows op kind by op kind) computes nothing but a longest path: every op ends at the latest of the times
it waits for, plus its duration. So a lowered plan compiles once into a DAG of max-plus nodes, and evaluating it for a
candidate's costs is a few numpy operations per level of the DAG, for a whole batch of cost vectors at a time:

* a compute op (F, B, I, W, R, OPT_STEP) or a TP op waits for the op before it on its rank's walker (the walker's
  cursor: the end of the last op that blocked it) and for its deps;
* a SEND and its RECV are issued at their walkers' cursors without blocking them; the transfer starts once both are
  issued and the SEND's deps are done, and ends both;
* a data-parallel collective (REDUCE_GRAD, GATHER_PARAMS) is issued at its walker's cursor without blocking it and
  starts once every simulated replica has issued it and its deps are done.

It is exact when nothing contends; :meth:`CompiledPlan.contended` tells, from the evaluated times and the links each
op holds, whether some link would have been wanted by two ops at once (then the engine queues one of them and takes
longer). The search uses it to screen candidates; the ones it ranks at the top are simulated again by
:func:`sim.predict.predict`, the one prediction path, before anyone sees a number. Plans with weight stashing,
host-memory copies (PREFETCH/EVICT) or gradient reduction overlapped with the backward are not compiled
(:class:`NotCompilable`): the engine costs them.

Peak memory per rank needs no times at all: memory changes only when the rank's own ops start and end, in program
order, so it is the memory ledger replayed over the program (:meth:`CompiledPlan.peak_memory`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from sim.cost.cost_view import CostView
from sim.cost.ledger import program_order_peaks
from sim.ir.ops import OP_SEMANTICS, Action, OpKind, op_id
from sim.ir.plan import Plan

__all__ = ["CompiledPlan", "NotCompilable", "compile_plan"]

#: The action of each kind (``sim.ir.ops.OP_SEMANTICS``); :func:`compile_plan` has a node rule for each action it
#: models and refuses the others (HOST_COPY, and any action added later) as :class:`NotCompilable`.
_ACTION = {kind: semantics.action for kind, semantics in OP_SEMANTICS.items()}
#: The blocking collectives of model parallelism: a rank's tensor-parallel collectives and expert all-to-alls.
_MODEL_PARALLEL = frozenset({Action.TP_COLLECTIVE, Action.EP_COLLECTIVE})


class NotCompilable(ValueError):
    """The plan uses something the longest-path evaluator does not model; simulate it with the engine."""


@dataclass(frozen=True)
class _Slot:
    """Where a node's duration comes from: ``view``'s ``compute`` / ``collective`` / ``message`` of (kind, vstage)
    (and, for a message, the pipeline ranks it goes between)."""

    view: int
    what: str
    kind: OpKind
    vstage: int
    src: int = -1
    dst: int = -1


class CompiledPlan:
    """A lowered plan as a DAG of max-plus nodes (see the module docstring); build with :func:`compile_plan`.

    Node 0 is the origin (time 0); node ``n`` ends at ``max(ends of its predecessors) + duration``. Nodes are
    grouped by depth so that a level is one vectorised step.
    """

    def __init__(self, plan: Plan, num_views: int, preds: list[list[int]], slot_of: list[int], slots: list[_Slot],
                 op_nodes: list[tuple[int, int, str]]) -> None:
        self.plan, self.num_views = plan, num_views
        self.slots = tuple(slots)
        self.slot_of = np.asarray(slot_of, dtype=np.int64)  # -1: no duration (origin, RECV)
        self.op_nodes = tuple(op_nodes)  # (node, trace rank, op id) of every op, for spans and tests
        self.op_index = np.fromiter((node for node, _, _ in op_nodes), dtype=np.int64, count=len(op_nodes))
        depth = np.zeros(len(preds), dtype=np.int64)
        for node in _topological_order(preds):
            if node:
                depth[node] = 1 + max(depth[p] for p in preds[node])
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []
        for level in range(1, int(depth.max(initial=0)) + 1):
            nodes = np.flatnonzero(depth == level)
            width = max(len(preds[n]) for n in nodes)
            matrix = np.zeros((len(nodes), width), dtype=np.int64)  # padded with the origin, whose time is 0
            for row, node in enumerate(nodes):
                matrix[row, : len(preds[node])] = preds[node]
            self.levels.append((nodes, matrix))
        self.num_nodes = len(preds)

    def slot_values(self, views: tuple[CostView, ...]) -> np.ndarray:
        """The duration of every slot under ``views`` (one cost view per simulated replica), s."""
        values = np.empty(len(self.slots))
        for index, slot in enumerate(self.slots):
            view = views[slot.view]
            if slot.what == "compute":
                values[index] = view.compute_time(slot.kind, slot.vstage)
            elif slot.what == "message":
                values[index] = view.message(slot.kind, slot.vstage, slot.src, slot.dst).seconds
            else:
                values[index] = view.collective_op(slot.kind, slot.vstage).seconds
        return values

    def times(self, slot_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of every node, s, for ``slot_values`` of shape (slots,) or (slots, K): K cost vectors
        evaluated at once (then each result has shape (nodes, K))."""
        values = np.asarray(slot_values, dtype=float)
        batch = values.shape[1:]
        durations = np.zeros((self.num_nodes, *batch))
        timed = self.slot_of >= 0
        durations[timed] = values[self.slot_of[timed]]
        starts = np.zeros((self.num_nodes, *batch))
        ends = np.zeros((self.num_nodes, *batch))
        for nodes, matrix in self.levels:
            ready = ends[matrix].max(axis=1)
            starts[nodes] = ready
            ends[nodes] = ready + durations[nodes]
        return starts, ends

    def span(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | float:
        """The iteration time, s (the engine's trace makespan), from :meth:`times`: one per cost vector."""
        ops = self.op_index
        span = ends[ops].max(axis=0) - starts[ops].min(axis=0)
        return float(span) if np.ndim(span) == 0 else span

    def makespan(self, slot_values: np.ndarray) -> np.ndarray | float:
        """The iteration time, s, for ``slot_values`` (see :meth:`times`): one per cost vector."""
        return self.span(*self.times(slot_values))

    def contended(self, views: tuple[CostView, ...], starts: np.ndarray, ends: np.ndarray) -> bool:
        """Whether two ops would hold one link at overlapping times, given the :meth:`times` of one cost vector
        under ``views``: then the engine queues one of them and the longest path is a lower bound, not the
        engine's time."""
        held: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for node, slot_index in enumerate(self.slot_of):
            if slot_index < 0 or not ends[node] > starts[node]:
                continue
            slot = self.slots[slot_index]
            view = views[slot.view]
            if slot.what == "message":
                keys = view.message(slot.kind, slot.vstage, slot.src, slot.dst).held_links
            elif slot.what == "collective" and _ACTION[slot.kind] in _MODEL_PARALLEL:
                keys = view.collective_op(slot.kind, slot.vstage).held_links
            elif slot.what == "collective":  # data-parallel collectives queue in a lane of their own
                keys = tuple(("collective", key) for key in views[0].collective_op(slot.kind, slot.vstage).held_links)
            else:
                continue
            for key in keys:
                held[key].append((float(starts[node]), float(ends[node])))
        for intervals in held.values():
            intervals.sort()
            if any(b_start < a_end for (_, a_end), (b_start, _) in zip(intervals, intervals[1:])):
                return True
        return False

    def peak_memory(self, views: tuple[CostView, ...]) -> tuple[int, ...]:
        """Highest memory in use on each simulated rank, bytes: the memory ledger replayed in program order
        (:func:`sim.cost.ledger.program_order_peaks`), which is the engine's peak for every plan this module
        compiles."""
        return program_order_peaks(self.plan, views)


def compile_plan(plan: Plan, num_views: int = 1) -> CompiledPlan:
    """Compile a lowered plan simulated with ``num_views`` cost views (replicas; see
    ``sim.cost.cost_view.replica_views``).

    Raises:
        NotCompilable: weight stashing, PREFETCH/EVICT, overlapped gradient reduction, or an op kind this module does
            not know.
    """
    if plan.weight_policy != "flush":
        raise NotCompilable(f"weight policy {plan.weight_policy} (stashed versions) is simulated by the engine")
    if plan.parallel is not None and plan.layout.grad_overlap:
        raise NotCompilable("gradient reduction overlapped with the backward is simulated by the engine")
    pipeline = plan.num_ranks
    preds: list[list[int]] = [[]]
    slot_of: list[int] = [-1]
    slots: list[_Slot] = []
    slot_index: dict[_Slot, int] = {}
    op_nodes: list[tuple[int, int, str]] = []
    node_of: dict[tuple[int, str], int] = {}  # (view, op id) -> node
    sends: dict[tuple[int, int], int] = {}  # (view, pair) -> the SEND's node
    receives: dict[tuple[int, int], tuple[int, int]] = {}  # (view, pair) -> (the RECV's node, its walker's cursor)
    collectives: dict[str, int] = {}  # op id -> node (one node for every replica's copy)
    deferred: list[tuple[int, int, tuple[str, ...]]] = []  # (node, view, deps) resolved once every node exists

    def new_node(slot: _Slot | None) -> int:
        preds.append([])
        if slot is None:
            slot_of.append(-1)
        else:
            slot_of.append(slot_index.setdefault(slot, len(slot_index)))
            if slot_of[-1] == len(slots):
                slots.append(slot)
        return len(preds) - 1

    for view in range(num_views):
        for rank, program in enumerate(plan.programs):
            cursor = 0
            for op in program:
                kind, op_key = op.kind, op_id(op.kind, op.vstage, op.mb)
                trace_rank = view * pipeline + rank
                action = _ACTION[kind]
                if action is Action.COMPUTE or action in _MODEL_PARALLEL:
                    what = "compute" if action is Action.COMPUTE else "collective"
                    node = new_node(_Slot(view, what, kind, op.vstage))
                    preds[node].append(cursor)
                    deferred.append((node, view, op.deps))
                    cursor = node
                elif action is Action.SEND:
                    node = new_node(_Slot(view, "message", kind, op.vstage, rank, op.peer))
                    preds[node].append(cursor)
                    deferred.append((node, view, op.deps))
                    sends[(view, op.pair)] = node
                elif action is Action.RECV:
                    node = new_node(None)
                    receives[(view, op.pair)] = (node, cursor)
                elif action is Action.DP_COLLECTIVE:
                    node = collectives.get(op_key)
                    if node is None:
                        node = collectives[op_key] = new_node(_Slot(0, "collective", kind, op.vstage))
                    preds[node].append(cursor)
                    deferred.append((node, view, op.deps))
                else:
                    raise NotCompilable(f"op kind {kind.value} ({action.value}) is simulated by the engine")
                node_of[(view, op_key)] = node
                op_nodes.append((node, trace_rank, op_key))
    for (view, pair), send in sends.items():
        if (view, pair) not in receives:
            raise NotCompilable(f"SEND of pair {pair} has no RECV")
        receive, issued = receives[(view, pair)]
        preds[send].append(issued)  # the transfer starts once the RECV is issued too (a rendezvous)
        preds[receive].append(send)  # and the RECV ends when the transfer does
    if receives.keys() - sends.keys():
        raise NotCompilable(f"RECV of pair {min(receives.keys() - sends.keys())[1]} has no SEND")
    for node, view, deps in deferred:
        preds[node].extend(node_of[(view, dep)] for dep in deps)
    for node in range(1, len(preds)):
        preds[node] = sorted(set(preds[node]))
    return CompiledPlan(plan, num_views, preds, slot_of, slots, op_nodes)


def _topological_order(preds: list[list[int]]) -> list[int]:
    """The nodes in an order where each comes after its predecessors (Kahn's algorithm). Nodes are numbered in
    program order, rank by rank, so a wait on another rank's op may point to a larger number.

    Raises:
        NotCompilable: the waits form a cycle (the plan deadlocks).
    """
    indegree = [len(p) for p in preds]
    users: list[list[int]] = [[] for _ in preds]
    for node, node_preds in enumerate(preds):
        for p in node_preds:
            users[p].append(node)
    ready = [node for node, count in enumerate(indegree) if count == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for user in users[node]:
            indegree[user] -= 1
            if indegree[user] == 0:
                ready.append(user)
    if len(order) != len(preds):
        raise NotCompilable("the plan's waits form a cycle (it deadlocks)")
    return order
