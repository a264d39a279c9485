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
from sim.hw.topology import Link, Topology, message_time
from sim.ir.plan import RECV_KINDS, Op, OpKind, Plan, stream_of
from sim.ir.trace import Span, Trace
from sim.ir.weight_versions import weight_versions
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


class _Run:
    """The state of one simulation. Built, run once, turned into a :class:`SimResult`."""

    def __init__(self, plan: Plan, costs: CostModel, topology: Topology, check_memory: bool) -> None:
        self.plan, self.costs, self.topology, self.check_memory = plan, costs, topology, check_memory
        self.env = simpy.Environment()
        self.done: dict[str, simpy.Event] = {op.id: self.env.event() for program in plan.programs for op in program}
        self.recv_of_pair: dict[int, Op] = {
            op.pair: op for program in plan.programs for op in program if op.kind in RECV_KINDS  # type: ignore[misc]
        }
        self.recv_issued: dict[int, simpy.Event] = {pair: self.env.event() for pair in self.recv_of_pair}
        self.links: dict[tuple[str, str], simpy.Resource] = {}
        self.link_bytes: dict[tuple[str, str], int] = {}
        self.spans: list[tuple] = []
        self.position = [0] * plan.num_ranks
        placement = plan.placement
        self.capacity = [device.memory_bytes for device in topology.devices[: plan.num_ranks]]
        offloaded = {op.vstage for program in plan.programs for op in program if op.kind is OpKind.PREFETCH}
        self.memory = [sum(costs.state_bytes(v) for v in placement.vstages_of(r) if v not in offloaded)
                       for r in range(plan.num_ranks)]
        self.peak = list(self.memory)
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
        self.handlers: dict[OpKind, Callable[[int, Op], _Proc | None]] = {
            OpKind.F: self._compute,
            OpKind.B: self._compute,
            OpKind.I: self._compute,
            OpKind.W: self._compute,
            OpKind.R: self._compute,
            OpKind.OPT_STEP: self._compute,
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

    # --- handlers --------------------------------------------------------------------------------------------------

    def _walk(self, rank: int) -> _Proc:
        for pos, op in enumerate(self.plan.programs[rank]):
            self.position[rank] = pos
            step = self.handlers[op.kind](rank, op)
            if step is not None:
                yield from step
        self.position[rank] = len(self.plan.programs[rank])

    def _compute(self, rank: int, op: Op) -> _Proc:
        for dep in op.deps:  # _wait_deps inlined: this is the hot path, a nested generator per op costs ~10%
            event = self.done[dep]
            if not event.processed:
                yield event
        start = self.env.now
        kind, vstage = op.kind, op.vstage
        activation = self.costs.activation_bytes(vstage)
        workspace = self.costs.workspace_bytes(vstage) if kind is not OpKind.OPT_STEP else 0
        kept = 0  # bytes this op leaves allocated for the backward
        if kind is OpKind.F:
            kept = self.costs.checkpoint_bytes(vstage) if (vstage, op.mb) in self.recomputed else activation
        elif kind is OpKind.R:
            kept = activation - self.costs.checkpoint_bytes(vstage)  # the checkpoint is the recomputation's input
        if kind is OpKind.OPT_STEP and self.versions and op.mb is not None:
            # The update first retires the version its microbatch ran on (if it was the last user; the executor
            # drops that copy before stepping), then copies the new weights if a later forward will run on them.
            key = (vstage, self.versions[(vstage, op.mb)])
            self.stash_users[key] -= 1
            if self.stash_users[key] == 0:
                self.memory[rank] -= self.costs.param_bytes(vstage)
            self.updates[vstage] += 1
            if (vstage, self.updates[vstage]) in self.stash_users:
                kept += self.costs.param_bytes(vstage)  # the version this update makes is used by a later F
        self._allocate(rank, workspace + kept, op)
        duration = self.costs.compute_time(kind, vstage)
        if duration > 0:
            yield self.env.timeout(duration)
        freed = workspace
        if kind is OpKind.W or (kind is OpKind.B and (vstage, op.mb) not in self.frees):
            freed += activation
        self.memory[rank] -= freed
        self.spans.append((op, rank, start, self.env.now))
        self.done[op.id].succeed()

    def _send(self, rank: int, op: Op) -> None:
        self.env.process(self._transfer(rank, op))

    def _recv(self, rank: int, op: Op) -> None:
        self.recv_issued[op.pair].succeed()  # type: ignore[index]

    def _copy(self, rank: int, op: Op) -> None:
        self.env.process(self._host_copy(rank, op))

    def _wait_deps(self, op: Op) -> _Proc:
        for dep in op.deps:
            event = self.done[dep]
            if not event.processed:
                yield event

    def _hold_path(self, path: tuple[Link, ...], duration: float, nbytes: int) -> Generator[simpy.Event, Any, float]:
        """Occupy every link of ``path`` for ``duration`` s and return when the occupation began (s).

        Links are taken in one global order, so two messages can never each hold a link the other waits for.
        """
        held = []
        if duration > 0:
            for key in sorted((link.src, link.dst) for link in path):
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
        for link in path:
            key = (link.src, link.dst)
            self.link_bytes[key] = self.link_bytes.get(key, 0) + nbytes
        return start

    def _transfer(self, src: int, send: Op) -> _Proc:
        yield from self._wait_deps(send)
        recv = self.recv_of_pair[send.pair]  # type: ignore[index]
        yield self.recv_issued[send.pair]  # type: ignore[index]
        dst = send.peer
        assert dst is not None
        nbytes = self.costs.message_bytes(send.kind, send.vstage)
        path = self.topology.path(src, dst)
        duration = self.costs.transfer_time(nbytes, src, dst)
        start = yield from self._hold_path(path, duration, nbytes)
        self.spans.append((send, src, start, self.env.now))
        self.spans.append((recv, dst, start, self.env.now))
        self.done[send.id].succeed()
        self.done[recv.id].succeed()

    def _host_copy(self, rank: int, op: Op) -> _Proc:
        yield from self._wait_deps(op)
        prefetch = op.kind is OpKind.PREFETCH
        path = self.topology.host_to_device_path(rank) if prefetch else self.topology.device_to_host_path(rank)
        nbytes = self.costs.param_bytes(op.vstage)
        duration = message_time(path, nbytes)
        if prefetch:
            self._allocate(rank, nbytes, op)  # the destination buffer exists from the moment the copy is issued
        start = yield from self._hold_path(path, duration, nbytes)
        if not prefetch:
            self.memory[rank] -= nbytes
        self.spans.append((op, rank, start, self.env.now))
        self.done[op.id].succeed()

    # --- driver ----------------------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for rank in range(self.plan.num_ranks):
            self.env.process(self._walk(rank))
        self.env.run()
        stuck = [r for r, program in enumerate(self.plan.programs) if self.position[r] < len(program)]
        if stuck or not all(event.triggered for event in self.done.values()):
            lines = [f"  rank {r}: stuck at {self.plan.programs[r][self.position[r]].id}" for r in stuck]
            raise PlanError("simulation stopped before the plan finished (deadlock)\n" + "\n".join(lines))
        spans = [
            Span(op.id, op.kind.value, rank, stream_of(op.kind), start, end, op.vstage, op.mb, op.pair, op.peer)
            for op, rank, start, end in self.spans
        ]
        devices = [device.name for device in self.topology.devices[: self.plan.num_ranks]]
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
