"""The SimPy engine: replays an L1 plan on a topology with a cost model and returns the trace (DESIGN §6).

Semantics, shared with the dry run in ``sim.plan.validate`` and with the executor:

* One process per rank walks its program in order. Compute-stream ops (F, B, I, W, R, OPT_STEP) block the walker: an
  op starts when the previous one has finished and every op in its ``deps`` is done, then runs for its cost.
* SEND and RECV are issued without blocking the walker (the ``isend``/``irecv`` of the executor). A transfer starts
  once both sides are issued and the SEND's deps are done (a rendezvous, as point-to-point transports do), occupies
  every link on its path for ``Σ latency + bytes / min bandwidth`` — the closed form of ``Topology.transfer_time``,
  or a measured profile's fit (``CostModel.transfer_time``) — and completes both ops. Links are SimPy resources
  of capacity one, so transfers that share a link wait for each other; a transfer takes its links in one global
  order, so two transfers can never hold one link each and wait on the other.
* PREFETCH and EVICT are issued without blocking the walker too. They copy a stage's weights host → device or
  device → host over the rank's PCIe path, whose directed links are the H2D and D2H copy engines, so copies
  overlap compute and contend only with other copies (and transfers) on the same links.
* Memory per device: the training state of its stages from the start, plus each in-flight microbatch's
  activations from the start of its F to the end of its B (or W when the backward is split), plus the op's
  workspace while it runs. With recomputation (an R op for the (vstage, mb)), F keeps only the stage's input, the
  checkpoint (``CostModel.checkpoint_bytes``), and R, right before the backward, allocates the rest of the
  activations again. A stage with PREFETCH ops lives in host memory: it is not resident at the start, and its
  weights occupy the device from the start of a PREFETCH to the end of the next EVICT. Going over the device's
  capacity raises :class:`OutOfMemoryError` naming the device, the time and the op. Under weight stashing each
  weight version some microbatch runs on is one more copy of the stage's weights, from the update that makes it to
  the update of the last microbatch that used it.

The plan is never mutated; ties are broken by SimPy's event ids, so the same inputs give the same trace.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from sim.core.errors import SpecError
from sim.cost.model import CostModel
from sim.hw.topology import Topology, message_time
from sim.ir.plan import Op, OpKind, Plan, stream_of
from sim.ir.trace import Span, Trace
from sim.ir.weight_versions import weight_versions
from sim.plan.lower import op_id as make_id
from sim.plan.validate import PlanError

__all__ = ["simulate", "SimResult", "OutOfMemoryError", "HANDLED_KINDS"]


class OutOfMemoryError(SpecError):
    """A device needs more memory than it has; the message names device, time and op."""


@dataclass(frozen=True)
class SimResult:
    """What a simulation produced.

    Attributes:
        trace: every op's span.
        peak_memory_bytes: per rank, the highest memory in use at any time, bytes.
        link_bytes: ``((src, dst), bytes)`` carried by each directed link that was used, sorted.
    """

    trace: Trace
    peak_memory_bytes: tuple[int, ...]
    link_bytes: tuple[tuple[tuple[str, str], int], ...]


_Proc = Generator[simpy.Event, Any, None]

#: Op kinds whose walker step runs on the compute stream and blocks the rank until the op is done.
_COMPUTE = frozenset({OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R, OpKind.OPT_STEP})


class _Run:
    """The state of one simulation. Built, run once, turned into a :class:`SimResult`.

    Memory stays proportional to what is in flight, not to the plan (``python -m sim.bench_memory``): an op's done
    event exists only from the moment something waits for it, or it finishes, until SimPy has processed it; after
    that the op's id is in ``finished``, the string its span holds anyway. Likewise a RECV's "issued" event lives
    only until its transfer has seen it, and spans are :class:`Span` objects from the start, with no intermediate
    records. SimPy schedules exactly the events an up-front event per op would (an event gets its place in the queue
    when it is triggered, not when it is created), so the order of ties, and with it every trace, is unchanged.
    """

    def __init__(self, plan: Plan, costs: CostModel, topology: Topology, check_memory: bool) -> None:
        self.plan, self.costs, self.topology, self.check_memory = plan, costs, topology, check_memory
        self.env = simpy.Environment()
        self.events: dict[str, simpy.Event] = {}  # op id -> done event, while waited for or not yet processed
        self.finished: set[str] = set()  # ids of ops whose done event has been processed
        self.issued: dict[int, simpy.Event] = {}  # pair -> "RECV issued" event (its value: the RECV), until used
        self.links: dict[tuple[str, str], simpy.Resource] = {}
        self.link_bytes: dict[tuple[str, str], int] = {}
        self.spans: list[Span] = []
        self.transfers: dict[tuple[OpKind, int, int, int], tuple] = {}  # (kind, vstage, src, dst) -> cost, path
        self.position = [0] * plan.num_ranks
        placement = plan.placement
        self.capacity = [device.memory_bytes for device in topology.devices[: plan.num_ranks]]
        offloaded = {op.vstage for program in plan.programs for op in program if op.kind is OpKind.PREFETCH}
        self.memory = [sum(costs.state_bytes(v) for v in placement.vstages_of(r) if v not in offloaded)
                       for r in range(plan.num_ranks)]
        # The op after which a microbatch's activations are freed: W when the backward is split, else B.
        self.frees = {(op.vstage, op.mb) for program in plan.programs for op in program if op.kind is OpKind.W}
        # Weight stashing (async PipeDream §3.3): version u of vstage v is a copy of its weights, kept from the update
        # that makes it (or the start, for u = 0) until the update of the last microbatch that runs on it; versions
        # no microbatch uses are never copied. Vertical sync makes later stages keep versions longer.
        self.versions = weight_versions(plan) if plan.weight_policy == "stash" else {}
        self.stash_users: dict[tuple[int, int], int] = {}
        for (v, _), u in self.versions.items():
            self.stash_users[(v, u)] = self.stash_users.get((v, u), 0) + 1
        self.updates = [0] * plan.num_vstages
        for v, u in self.stash_users:
            if u == 0:  # the starting weights, copied before the first forward
                self.memory[placement.vstage_to_rank[v]] += costs.param_bytes(v)
        self.peak = list(self.memory)
        # Microbatches whose activations are recomputed: their F keeps only the checkpoint (the stage input).
        self.recomputed = {(op.vstage, op.mb) for program in plan.programs for op in program if op.kind is OpKind.R}
        self.handlers: dict[OpKind, Callable[[int, Op], None]] = {
            OpKind.SEND_F: self._send,
            OpKind.SEND_B: self._send,
            OpKind.RECV_F: self._recv,
            OpKind.RECV_B: self._recv,
            OpKind.PREFETCH: self._copy,
            OpKind.EVICT: self._copy,
        }

    # --- memory ----------------------------------------------------------------------------------------------------

    def _allocate(self, rank: int, nbytes: int, op: Op) -> None:
        self.memory[rank] += nbytes
        if self.memory[rank] > self.peak[rank]:
            self.peak[rank] = self.memory[rank]
            if self.check_memory and self.memory[rank] > self.capacity[rank]:
                device = self.topology.devices[rank].name
                raise OutOfMemoryError(
                    f"out of memory on rank {rank} ({device}) at t={self.env.now * 1e3:.3f} ms during {op.id}: "
                    f"needs {self.memory[rank] / 1e9:.2f} GB > {self.capacity[rank] / 1e9:.2f} GB "
                    f"(fewer microbatches in flight, a smaller --microbatch-size or more stages would fit)"
                )

    # --- done events -----------------------------------------------------------------------------------------------

    def _done_event(self, op_id: str) -> simpy.Event | None:
        """The event to wait on until ``op_id`` is done, or None when it is done and processed already.

        An event that is triggered but not yet processed must still be waited on (the waiter resumes only when
        SimPy processes it, after the events queued before it); a processed one resumes a waiter at once.
        """
        event = self.events.get(op_id)
        if event is None and op_id not in self.finished:
            event = self.events[op_id] = self.env.event()
        return event

    def _finish(self, op: Op, rank: int, start: float) -> None:
        """Record ``op``'s span and trigger its done event (created here when nothing waits for it yet)."""
        kind = op.kind
        op_id = make_id(kind, op.vstage, op.mb)
        self.spans.append(Span(op_id, kind.value, rank, stream_of(kind), start, self.env.now, op.vstage, op.mb,
                               op.pair, op.peer))
        event = self.events.get(op_id)
        if event is None:
            event = self.events[op_id] = self.env.event()
        event.callbacks.append(self._forget)  # type: ignore[union-attr]
        event.succeed(op_id)

    def _forget(self, event: simpy.Event) -> None:
        """Processed: later waiters go on at once, so the op's id replaces its event."""
        op_id = event.value
        self.finished.add(op_id)
        del self.events[op_id]

    def _wait_deps(self, op: Op) -> _Proc:
        for dep in op.deps:
            event = self._done_event(dep)
            if event is not None:
                yield event

    # --- handlers --------------------------------------------------------------------------------------------------

    def _walk(self, rank: int) -> _Proc:
        handlers, position = self.handlers, self.position
        for pos, op in enumerate(self.plan.programs[rank]):
            position[rank] = pos
            if op.kind in _COMPUTE:
                # The compute step is inlined: a nested generator per op would cost ~10% of the run.
                for dep in op.deps:
                    event = self._done_event(dep)
                    if event is not None:
                        yield event
                start, duration = self._start_compute(rank, op)
                if duration > 0:
                    yield self.env.timeout(duration)
                self._end_compute(rank, op)
                self._finish(op, rank, start)
            else:
                handlers[op.kind](rank, op)
        position[rank] = len(self.plan.programs[rank])

    def _start_compute(self, rank: int, op: Op) -> tuple[float, float]:
        """Allocate what a compute op needs while it runs and keeps after; returns its start and duration (s)."""
        kind, vstage = op.kind, op.vstage
        costs = self.costs
        workspace = costs.workspace_bytes(vstage) if kind is not OpKind.OPT_STEP else 0
        kept = 0  # bytes this op leaves allocated for the backward
        if kind is OpKind.F:
            kept = costs.checkpoint_bytes(vstage) if (vstage, op.mb) in self.recomputed else costs.activation_bytes(
                vstage)
        elif kind is OpKind.R:
            kept = costs.activation_bytes(vstage) - costs.checkpoint_bytes(vstage)  # the checkpoint is R's input
        if kind is OpKind.OPT_STEP and self.versions and op.mb is not None:
            # The update first retires the version its microbatch ran on (if it was the last user; the executor
            # drops that copy before stepping), then copies the new weights if a later forward will run on them.
            key = (vstage, self.versions[(vstage, op.mb)])
            self.stash_users[key] -= 1
            if self.stash_users[key] == 0:
                self.memory[rank] -= costs.param_bytes(vstage)
            self.updates[vstage] += 1
            if (vstage, self.updates[vstage]) in self.stash_users:
                kept += costs.param_bytes(vstage)  # the version this update makes is used by a later F
        self._allocate(rank, workspace + kept, op)
        return self.env.now, costs.compute_time(kind, vstage)

    def _end_compute(self, rank: int, op: Op) -> None:
        """Free the workspace, and after the last backward op of a microbatch its activations."""
        kind, vstage = op.kind, op.vstage
        freed = self.costs.workspace_bytes(vstage) if kind is not OpKind.OPT_STEP else 0
        if kind is OpKind.W or (kind is OpKind.B and (vstage, op.mb) not in self.frees):
            freed += self.costs.activation_bytes(vstage)
        self.memory[rank] -= freed

    def _send(self, rank: int, op: Op) -> None:
        self.env.process(self._transfer(rank, op))

    def _recv(self, rank: int, op: Op) -> None:
        event = self.issued.get(op.pair)  # type: ignore[arg-type]
        if event is None:
            event = self.issued[op.pair] = self.env.event()  # type: ignore[index]
        event.succeed(op)

    def _copy(self, rank: int, op: Op) -> None:
        self.env.process(self._host_copy(rank, op))

    def _hold_path(self, keys: tuple[tuple[str, str], ...], duration: float,
                   nbytes: int) -> Generator[simpy.Event, Any, float]:
        """Occupy the links ``keys`` (sorted ``(src, dst)`` of a path) for ``duration`` s; returns when it began (s).

        Links are taken in one global order, so two messages can never each hold a link the other waits for.
        """
        held = []
        if duration > 0:
            for key in keys:
                resource = self.links.get(key)
                if resource is None:
                    resource = self.links[key] = simpy.Resource(self.env, capacity=1)
                request = resource.request()
                yield request
                held.append((resource, request))
        start = self.env.now
        if duration > 0:
            yield self.env.timeout(duration)
        for resource, request in held:
            resource.release(request)
        for key in keys:
            self.link_bytes[key] = self.link_bytes.get(key, 0) + nbytes
        return start

    def _transfer_cost(self, send: Op, src: int, dst: int) -> tuple[int, float, tuple[tuple[str, str], ...]]:
        """Bytes, uncontended time (s) and sorted link keys of a SEND; the same for every microbatch, so kept."""
        key = (send.kind, send.vstage, src, dst)
        cost = self.transfers.get(key)
        if cost is None:
            nbytes = self.costs.message_bytes(send.kind, send.vstage)
            path = self.topology.path(src, dst)
            links = tuple(sorted((link.src, link.dst) for link in path))
            cost = self.transfers[key] = (nbytes, self.costs.transfer_time(nbytes, src, dst), links)
        return cost

    def _transfer(self, src: int, send: Op) -> _Proc:
        yield from self._wait_deps(send)
        event = self.issued.get(send.pair)  # type: ignore[arg-type]
        if event is None:
            event = self.issued[send.pair] = self.env.event()  # type: ignore[index]
        recv = yield event  # a processed event resumes at once, as in a plain ``yield``
        del self.issued[send.pair]  # type: ignore[arg-type]
        dst = send.peer
        assert dst is not None
        nbytes, duration, links = self._transfer_cost(send, src, dst)
        start = yield from self._hold_path(links, duration, nbytes)
        self._finish(send, src, start)
        self._finish(recv, dst, start)

    def _host_copy(self, rank: int, op: Op) -> _Proc:
        yield from self._wait_deps(op)
        prefetch = op.kind is OpKind.PREFETCH
        path = self.topology.host_to_device_path(rank) if prefetch else self.topology.device_to_host_path(rank)
        nbytes = self.costs.param_bytes(op.vstage)
        duration = message_time(path, nbytes)
        if prefetch:
            self._allocate(rank, nbytes, op)  # the destination buffer exists from the moment the copy is issued
        links = tuple(sorted((link.src, link.dst) for link in path))
        start = yield from self._hold_path(links, duration, nbytes)
        if not prefetch:
            self.memory[rank] -= nbytes
        self._finish(op, rank, start)

    # --- driver ----------------------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for rank in range(self.plan.num_ranks):
            self.env.process(self._walk(rank))
        try:
            self.env.run()
        finally:
            # Waiting processes and their events form reference cycles through this object; dropping them here
            # frees them now instead of at the next cyclic collection (they can be a large part of a long run).
            self.env = self.events = self.issued = self.links = None  # type: ignore[assignment]
        stuck = [r for r, program in enumerate(self.plan.programs) if self.position[r] < len(program)]
        num_ops = sum(len(program) for program in self.plan.programs)
        if stuck or len(self.finished) != num_ops:
            lines = [f"  rank {r}: stuck at {self.plan.programs[r][self.position[r]].id}" for r in stuck]
            raise PlanError("simulation stopped before the plan finished (deadlock)\n" + "\n".join(lines))
        self.finished = set()
        devices = [device.name for device in self.topology.devices[: self.plan.num_ranks]]
        spans, self.spans = self.spans, []
        trace = Trace.from_spans(spans, devices, {"source": "sim", "schedule": self.plan.schedule})
        return SimResult(trace, tuple(self.peak), tuple(sorted(self.link_bytes.items())))


HANDLED_KINDS = frozenset(
    {OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.R, OpKind.OPT_STEP, OpKind.SEND_F, OpKind.SEND_B, OpKind.RECV_F,
     OpKind.RECV_B, OpKind.PREFETCH, OpKind.EVICT}
)


def simulate(plan: Plan, costs: CostModel, topology: Topology, *, check_memory: bool = True) -> SimResult:
    """Simulate one iteration of an L1 plan.

    Args:
        plan: a lowered, validated plan.
        costs: durations and sizes of its ops.
        topology: the devices and links; rank r runs on ``topology.devices[r]``.
        check_memory: raise :class:`OutOfMemoryError` when a device's memory is exceeded (else only report peaks).

    Raises:
        PlanError: the plan is not lowered, uses an op kind the engine has no handler for, or deadlocks.
        OutOfMemoryError: a device runs out of memory.
    """
    if plan.level != "L1":
        raise PlanError(f"the engine runs lowered (L1) plans, got {plan.level}")
    if plan.num_ranks > topology.num_ranks:
        raise PlanError(f"plan has {plan.num_ranks} ranks but topology {topology} has {topology.num_ranks} devices")
    kinds = {op.kind for program in plan.programs for op in program}
    unhandled = sorted(kind.value for kind in kinds - HANDLED_KINDS)
    if unhandled:
        raise PlanError(f"the engine has no handler for op kind(s) {', '.join(unhandled)}")
    return _Run(plan, costs, topology, check_memory).run()
