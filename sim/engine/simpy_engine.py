"""The SimPy engine: replays an L1 plan on a topology with a cost model and returns the trace (DESIGN §6).

Semantics, shared with the dry run in ``sim.plan.validate`` and with the executor:

* One process per rank walks its program in order. Compute-stream ops (F, B, I, W, R, OPT_STEP) block the walker: an
  op starts when the previous one has finished and every op in its ``deps`` is done, then runs for its cost.
* SEND and RECV are issued without blocking the walker (the ``isend``/``irecv`` of the executor). A transfer starts
  once both sides are issued and the SEND's deps are done (a rendezvous, as point-to-point transports do), occupies
  every link on its path for ``Σ latency + bytes / min bandwidth`` — the closed form of ``Topology.transfer_time``,
  or a measured profile's fit (``CostView.message``) — and completes both ops. Links are mutexes that grant
  in FIFO order (``sim.engine.comm.Link``), so transfers that share a link wait for each other; a transfer takes its
  links in one global order, so two transfers can never hold one link each and wait on the other.
* PREFETCH and EVICT are issued without blocking the walker too. They copy a stage's weights host → device or
  device → host over the rank's PCIe path, whose directed links are the H2D and D2H copy engines, so copies
  overlap compute and contend only with other copies (and transfers) on the same links. A copy takes the cost
  oracle's time (``CostView.host_copy``: the link model, or a measured profile's copy bandwidth on its device).
* Memory per device is the memory ledger's (``sim.cost.ledger``): what each op allocates when it starts and frees
  when it ends, applied at the simulated times (the training state from the start; a microbatch's activations from
  its F to its last backward op, only the checkpoint under recomputation plus one rebuilt layer from its R; weight
  versions under stashing; a host-resident stage's weights from the start of a PREFETCH's copy to the end of the
  next EVICT's). Going over the device's capacity raises :class:`OutOfMemoryError` naming the device, the time and
  the op.

* Tensor and data parallelism (``sim.ir.parallel``). A TP op (TP_F, TP_B, TP_R) blocks the walker like compute
  and holds the links of its tensor-parallel rings while it runs. A data-parallel collective (REDUCE_GRAD,
  GATHER_PARAMS) is issued without blocking, and starts once every simulated replica has issued it and its deps are
  done; it holds the links of all its groups. Identical replicas are simulated once: the engine runs one walker per
  pipeline rank of each replica it is given a cost view for (``costs``), and a view's messages and collectives are
  costed with the replicas it stands for running at the same moment (``CostView.concurrent``). By symmetry that is
  exact; simulating every replica gives the same times when replicas share no link (a test checks it).

The plan is never mutated; ties are broken by SimPy's event ids, so the same inputs give the same trace.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from sim.core.errors import SpecError
from sim.cost.cost_view import CostView
from sim.cost.ledger import MemoryLedger
from sim.engine.comm import Communication
from sim.engine.perturbation import NONE, Perturbation
from sim.hw.topology import Topology
from sim.ir.ops import OP_SEMANTICS, Action, MemoryEffect, handled_kinds, op_id
from sim.ir.plan import Op, OpKind, Plan
from sim.ir.trace import Span, Trace
from sim.plan.lower_collectives import EP_OVERLAP_OPTION
from sim.plan.validate import PlanError

__all__ = ["simulate", "SimResult", "OutOfMemoryError", "HANDLED_KINDS"]


class OutOfMemoryError(SpecError):
    """A device needs more memory than it has; the message names device, time and op."""


@dataclass(frozen=True)
class SimResult:
    """What a simulation produced.

    Attributes:
        trace: every op's span.
        peak_memory_bytes: per simulated rank (trace rank), the highest memory in use at any time, bytes.
        link_bytes: ``((src, dst), bytes)`` carried by each directed link that was used, sorted.
        slowed_ops: ``(trace rank, op id)`` of every op a straggler slowed (``sim.engine.perturbation``), in the
            order they started.
    """

    trace: Trace
    peak_memory_bytes: tuple[int, ...]
    link_bytes: tuple[tuple[tuple[str, str], int], ...]
    slowed_ops: tuple[tuple[int, str], ...] = ()


_Proc = Generator[simpy.Event, Any, None]

#: The action of each kind (``sim.ir.ops.OP_SEMANTICS``), read once per op by the walkers.
_ACTION = {kind: semantics.action for kind, semantics in OP_SEMANTICS.items()}
#: Actions that block the walker, run inline by ``_Run._walk`` (a nested generator per op would cost ~10 % of a run).
_INLINE = frozenset({Action.COMPUTE, Action.TP_COLLECTIVE, Action.EP_COLLECTIVE})
#: Issued kinds whose memory the ledger takes when the walker issues them (a host copy's is taken by the copy).
_HOLDS_ON_ISSUE = {kind: semantics.memory is MemoryEffect.HOLD_REDUCTION_BUFFER
                   for kind, semantics in OP_SEMANTICS.items()}
#: Actions the walker issues without blocking, each by the :class:`~sim.engine.comm.Communication` method named here.
_ISSUERS = {Action.SEND: "send", Action.RECV: "recv", Action.HOST_COPY: "copy", Action.DP_COLLECTIVE: "collective"}
#: Suffix of a simulated replica's op ids in the engine's tables (replica 0's ids are the plan's own).
_NO_SUFFIX = ""
#: Each kind's span fields, read once per op by ``_Run._finish``: its spelling (``kind.value`` is an enum property
#: call) and its stream (``sim.ir.ops.stream_of``, without a function call).
_KIND_TEXT = {kind: kind.value for kind in OP_SEMANTICS}
_STREAM = {kind: semantics.stream for kind, semantics in OP_SEMANTICS.items()}


class _Run:
    """The state of one simulation. Built, run once, turned into a :class:`SimResult`.

    Memory stays proportional to what is in flight, not to the plan (``python -m sim.bench_memory``): an op's done
    event exists only from the moment something waits for it, or it finishes, until SimPy has processed it; after
    that the op's id is in ``finished``, the string its span holds anyway. Likewise a RECV's "issued" event lives
    only until its transfer has seen it, and spans are :class:`Span` objects from the start, with no intermediate
    records. SimPy schedules exactly the events an up-front event per op would (an event gets its place in the queue
    when it is triggered, not when it is created), so the order of ties, and with it every trace, is unchanged.
    """

    def __init__(self, plan: Plan, costs: tuple[CostView, ...], topology: Topology, check_memory: bool,
                 perturbation: Perturbation = NONE) -> None:
        self.plan, self.topology, self.check_memory = plan, topology, check_memory
        self.overlap_ep = bool(plan.option(EP_OVERLAP_OPTION, False))
        self.views = costs  # one cost view per simulated replica
        #: Pipeline ranks of the plan (``plan.num_ranks``, a property, read once per op).
        self.pipeline = pipeline = plan.num_ranks
        #: Simulated ranks (trace ranks): replica i's pipeline rank p is ``i * pipeline + p``.
        self.instances = len(costs) * pipeline
        self.suffix = [_NO_SUFFIX] + [f"@{i}" for i in range(1, len(costs))]
        self.env = simpy.Environment()
        self.events: dict[str, simpy.Event] = {}  # op id -> done event, while waited for or not yet processed
        self.finished: set[str] = set()  # ids of ops whose done event has been processed
        self.spans: list[Span] = []
        self.position = [0] * self.instances
        self.device_index = [view.device_index_of(p) for view in costs for p in range(pipeline)]
        self.capacity = [topology.devices[d].memory_bytes for d in self.device_index]
        # What each op allocates and frees (sim.cost.ledger): one ledger per simulated replica, as it keeps counts.
        self.ledgers = [MemoryLedger(plan, view) for view in costs]
        self.memory = [ledger.resident(r) for ledger in self.ledgers for r in range(pipeline)]
        self.peak = list(self.memory)
        # A PARTIME stream's frames arrive from a live source at ``fps`` frames per second: frame f's first forward
        # waits until f / fps.
        fps = plan.option("fps") if plan.weight_policy == "stream" else None
        self.arrivals = ({op.id: op.mb / fps for op in plan.programs[plan.placement.vstage_to_rank[0]]  # type: ignore
                          if op.kind is OpKind.F and op.vstage == 0} if fps else {})
        # Under overlapped gradient reduction, the (start, end) of each backward op a REDUCE_GRAD depends on.
        self.grad_windows: dict[str, tuple[float, float]] = {}
        self.grad_producers = ({dep + suffix for program in plan.programs for op in program
                                if op.kind is OpKind.REDUCE_GRAD for dep in op.deps for suffix in self.suffix}
                               if plan.layout.grad_overlap else set())
        self.tp_runs: dict[tuple[int, OpKind, int], int] = {}  # (view, kind, vstage) -> TP ops run
        self.comm = Communication(self.env, plan, costs, self.suffix,
                                  done_event=self._done_event, finish=self._finish, take=self._take,
                                  release=self._release, grad_windows=self.grad_windows)
        self.issuers: dict[OpKind, Callable[[int, Op], None]] = {
            kind: getattr(self.comm, _ISSUERS[action]) for kind, action in _ACTION.items() if action in _ISSUERS}
        self._perturb(perturbation)

    def _perturb(self, perturbation: Perturbation) -> None:
        """Each simulated rank's stragglers (``(factor, start, end)`` of those among its tensor-parallel group's
        devices) and jitter factors (``sim.engine.perturbation``)."""
        pipeline, layout = self.plan.num_ranks, self.plan.layout
        if perturbation.stragglers and {view.replica for view in self.views} != set(range(layout.data_ranks)):
            raise ValueError("a straggler needs every data-parallel replica simulated on its own (simulate_all)")
        self.slow: list[tuple[tuple[float, float, float], ...]] = []
        for rank in range(self.instances):
            devices = set(layout.tp_group(rank % pipeline, self.views[rank // pipeline].replica))
            self.slow.append(tuple((s.factor, s.start_s, s.end_s) for s in perturbation.stragglers
                                   if s.device in devices))
        self.noise = [perturbation.noise(rank, len(self.plan.programs[rank % pipeline]))
                      for rank in range(self.instances)]
        self.slowed: list[tuple[int, str]] = []

    # --- memory ----------------------------------------------------------------------------------------------------

    def _allocate(self, rank: int, nbytes: int, op: Op) -> None:
        self.memory[rank] += nbytes
        if self.memory[rank] > self.peak[rank]:
            self._new_peak(rank, op)

    def _new_peak(self, rank: int, op: Op) -> None:
        """Rank ``rank``'s memory has just risen above its peak during ``op``: a new peak, and out of memory when it
        exceeds the device's capacity (and memory is checked)."""
        self.peak[rank] = self.memory[rank]
        if self.check_memory and self.memory[rank] > self.capacity[rank]:
            device = self.topology.devices[self.device_index[rank]].name
            raise OutOfMemoryError(
                f"out of memory on rank {self.device_index[rank]} ({device}) at t={self.env.now * 1e3:.3f} ms "
                f"during {op.id}: "
                f"needs {self.memory[rank] / 1e9:.2f} GB > {self.capacity[rank] / 1e9:.2f} GB"
            )

    # --- done events -----------------------------------------------------------------------------------------------

    def _done_event(self, key: str) -> simpy.Event | None:
        """The event to wait on until the op ``key`` names is done, or None when it is done and processed already.

        An event that is triggered but not yet processed must still be waited on (the waiter resumes only when
        SimPy processes it, after the events queued before it); a processed one resumes a waiter at once.
        """
        event = self.events.get(key)
        if event is None and key not in self.finished:
            event = self.events[key] = self.env.event()
        return event

    def _finish(self, op: Op, rank: int, start: float, stream: str | None = None) -> None:
        """Record ``op``'s span and trigger its done event (created here when nothing waits for it yet)."""
        kind, vstage, mb, now = op.kind, op.vstage, op.mb, self.env.now
        this_id = op_id(kind, vstage, mb)
        pipeline = self.pipeline
        key = this_id if rank < pipeline else this_id + self.suffix[rank // pipeline]
        peer = op.peer
        self.spans.append(Span(this_id, _KIND_TEXT[kind], rank, stream or _STREAM[kind], start, now, vstage, mb,
                               op.pair, None if peer is None else peer + rank - rank % pipeline))
        if key in self.grad_producers:
            self.grad_windows[key] = (start, now)
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = self.env.event()
        event.callbacks.append(self._forget)  # type: ignore[union-attr]
        event.succeed(key)

    def _forget(self, event: simpy.Event) -> None:
        """Processed: later waiters go on at once, so the op's id replaces its event."""
        key = event.value
        self.finished.add(key)
        del self.events[key]

    def _wait_deps(self, op: Op, suffix: str = _NO_SUFFIX) -> _Proc:
        for dep in op.deps:
            event = self._done_event(dep + suffix if suffix else dep)
            if event is not None:
                yield event

    # --- handlers --------------------------------------------------------------------------------------------------

    def _walk(self, rank: int) -> _Proc:
        # Everything read per op is bound once here: an attribute lookup per op is a measurable share of a run.
        env, events, finished, timeout = self.env, self.events, self.finished, self.env.timeout
        issuers, position, arrivals, actions = self.issuers, self.position, self.arrivals, _ACTION
        holds_on_issue, finish = _HOLDS_ON_ISSUE, self._finish
        pipeline = self.pipeline
        replica = rank // pipeline
        suffix, view, ledger = self.suffix[replica], self.views[replica], self.ledgers[replica]
        compute_time, start_of, end_of = view.compute_time, ledger.start, ledger.end
        memory, peak, slow, noise = self.memory, self.peak, self.slow[rank], self.noise[rank]
        program = self.plan.programs[rank % pipeline]
        for pos, op in enumerate(program):
            position[rank] = pos
            kind = op.kind
            action = actions[kind]
            if action is Action.COMPUTE:
                if arrivals and kind is OpKind.F:
                    due = arrivals.get(op.id)
                    if due is not None and due > env.now:
                        yield timeout(due - env.now)
                for dep in op.deps:  # self._done_event, inlined
                    key = dep + suffix if suffix else dep
                    event = events.get(key)
                    if event is None:
                        if key in finished:
                            continue
                        event = events[key] = env.event()
                    yield event
                # The ledger's start (self._take): free what it releases, then allocate and check the peak.
                released, allocated = start_of(op)
                held = memory[rank] - released + allocated
                memory[rank] = held
                if held > peak[rank]:
                    self._new_peak(rank, op)
                start = env.now
                duration = compute_time(kind, op.vstage)
                for factor, begin, end in slow:
                    if begin <= start < end:
                        duration *= factor
                        self.slowed.append((rank, op.id))
                if noise is not None:
                    duration *= float(noise[pos])
                if duration > 0:
                    yield timeout(duration)
                freed = end_of(op)  # self._release
                if freed >= 0:
                    memory[rank] -= freed
                else:  # it leaves more than it frees (an I keeping its W's inputs): a new high may be reached
                    self._allocate(rank, -freed, op)
                finish(op, rank, start)
            elif action is Action.EP_COLLECTIVE and self.overlap_ep:
                # --ep-overlap: the all-to-alls run beside the rank's next compute op; what needs their tokens has
                # them in its deps (sim.plan.lower_collectives).
                env.process(self._model_parallel(rank, op, suffix, replica))
            elif action is Action.TP_COLLECTIVE or action is Action.EP_COLLECTIVE:
                # Tensor-parallel collectives and expert-parallel all-to-alls: the compute stream waits for them
                # (Megatron's f/g operators; its synchronous token dispatcher).
                yield from self._model_parallel(rank, op, suffix, replica)
            else:
                if holds_on_issue[kind]:  # a reduction's buffer exists from the moment it is issued
                    self._take(rank, op)
                issuers[kind](rank, op)
        position[rank] = len(program)

    def _model_parallel(self, rank: int, op: Op, suffix: str, replica: int) -> _Proc:
        """Run a TP or EP op of simulated rank ``rank``: wait for its deps, hold its groups' links for its time. The
        bytes they put on links are counted once per op kind at the end (``tp_runs``), not per op."""
        env, kind = self.env, op.kind
        if op.deps:
            yield from self._wait_deps(op, suffix)
        duration = self.views[replica].collective_op(kind, op.vstage).seconds
        keys = self.comm.tp_links[(rank, kind, op.vstage)]
        if keys:
            share = self.comm.share[replica]
            start = yield from self.comm.hold_links(keys, duration, (), share and (share, kind, op.vstage, op.mb))
        else:
            start = env.now
            if duration > 0:
                yield env.timeout(duration)
        run = (replica, kind, op.vstage)
        self.tp_runs[run] = self.tp_runs.get(run, 0) + 1
        self._finish(op, rank, start)

    def _release(self, rank: int, op: Op) -> None:
        """Free what the ledger says the op frees when it ends (its workspace; a microbatch's activations after its
        last backward op; an EVICT's weights)."""
        freed = self.ledgers[rank // self.pipeline].end(op)
        if freed >= 0:
            self.memory[rank] -= freed
        else:  # it leaves more than it frees (an I keeping its W's inputs): a new high may be reached
            self._allocate(rank, -freed, op)

    def _take(self, rank: int, op: Op) -> None:
        """Apply the ledger's start of ``op`` on simulated rank ``rank``: free what it releases, then allocate."""
        released, allocated = self.ledgers[rank // self.pipeline].start(op)
        self.memory[rank] -= released
        self._allocate(rank, allocated, op)

    # --- driver ----------------------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for rank in range(self.instances):
            self.env.process(self._walk(rank))
        try:
            self.env.run()
        finally:
            # Waiting processes and their events form reference cycles through this object; dropping them here
            # frees them now instead of at the next cyclic collection (they can be a large part of a long run).
            self.comm.close()
            self.env = self.events = None  # type: ignore[assignment]
        pipeline = self.plan.num_ranks
        stuck = [r for r in range(self.instances) if self.position[r] < len(self.plan.programs[r % pipeline])]
        num_ops = sum(len(program) for program in self.plan.programs) * len(self.views)
        if stuck or len(self.finished) != num_ops:
            lines = [f"  rank {r}: stuck at {self.plan.programs[r % pipeline][self.position[r]].id}" for r in stuck]
            raise PlanError("simulation stopped before the plan finished (deadlock)\n" + "\n".join(lines))
        self.finished = set()
        link_bytes = self.comm.carried(self.tp_runs)
        devices = [self.topology.devices[d].name for d in self.device_index]
        spans, self.spans = self.spans, []
        meta: dict[str, object] = {"source": "sim", "schedule": self.plan.schedule}
        if self.plan.parallel is not None:
            meta["parallel"] = self.plan.layout.describe()
            meta["device_of_rank"] = list(self.device_index)
            meta["replicas_simulated"] = [view.replica for view in self.views]
        if self.slowed:  # which ops the stragglers slowed, by trace rank (the summary counts them)
            slowed: dict[str, list[str]] = {}
            for rank, op in self.slowed:
                slowed.setdefault(str(rank), []).append(op)
            meta["slowed_ops"] = slowed
        trace = Trace.from_spans(spans, devices, meta)
        return SimResult(trace, tuple(self.peak), link_bytes, tuple(self.slowed))


def engine_kinds() -> frozenset[OpKind]:
    """The op kinds the engine runs: those whose action (``sim.ir.ops.OP_SEMANTICS``) it has a handler for."""
    return handled_kinds(_INLINE | _ISSUERS.keys())


#: The op kinds the engine runs when this module is loaded (:func:`engine_kinds`).
HANDLED_KINDS = engine_kinds()


def simulate(plan: Plan, costs: CostView | tuple[CostView, ...], topology: Topology, *,
             check_memory: bool = True, perturbation: Perturbation = NONE) -> SimResult:
    """Simulate one iteration of an L1 plan.

    Args:
        plan: a lowered, validated plan.
        costs: durations and sizes of its ops: one cost view, or one per data-parallel replica to simulate (each
            names its replica and the replicas it stands for; :func:`sim.cost.cost_view.replica_views`). The trace's
            rank ``i · P + p`` is pipeline rank p of the i-th view.
        topology: the devices and links; each view says which device runs each pipeline rank.
        check_memory: raise :class:`OutOfMemoryError` when a device's memory is exceeded (else only report peaks).
        perturbation: stragglers and jitter (``sim.engine.perturbation``); with a straggler, ``costs`` must hold
            one view per data-parallel replica.

    Raises:
        PlanError: the plan is not lowered, uses an op kind the engine has no handler for, or deadlocks.
        OutOfMemoryError: a device runs out of memory.
    """
    if plan.level != "L1":
        raise PlanError(f"the engine runs lowered (L1) plans, got {plan.level}")
    kinds = {op.kind for program in plan.programs for op in program}
    unhandled = sorted(kind.value for kind in kinds - engine_kinds())
    if unhandled:
        raise PlanError(f"the engine has no handler for op kind(s) {', '.join(unhandled)}")
    if plan.world_size > topology.num_ranks:
        raise PlanError(f"plan has {plan.world_size} devices' ranks but topology {topology} has {topology.num_ranks} "
                        f"devices")
    views = costs if isinstance(costs, tuple) else (costs,)
    if not views:
        raise ValueError("simulate() needs at least one cost view")
    return _Run(plan, views, topology, check_memory, perturbation).run()
