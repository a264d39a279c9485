"""The SimPy engine's communication: messages, host copies and collectives over the links they hold.

:class:`Communication` is one object the engine's run composes (``sim.engine.simpy_engine``, whose module docstring
states the semantics). It owns the links (FIFO mutexes, :class:`Link`, taken in one global order, so two holders can
never wait on each other), the bytes each link carried, the rendezvous of SEND and RECV, and the replicas' arrivals
at a data-parallel collective. What it reads of the run (the plan, its cost views, the replicas' op-id suffixes)
and what it asks of it (wait for an op's deps, finish an op, apply the memory ledger's start and end of a host copy)
are given to its constructor, nothing else. Each process waits for its op's deps, takes every link its traffic
crosses, holds them for the op's uncontended duration from the cost view, and finishes the op.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import simpy

from sim.cost.cost_view import CostView
from sim.ir.ops import COPY_KINDS, EP_KINDS, SEND_KINDS, TP_KINDS, Op, OpKind, op_id
from sim.ir.plan import Plan

__all__ = ["Communication", "Link"]

_Proc = Generator[simpy.Event, Any, None]

#: The lane of a link that data-parallel collectives queue in (``_run_collective``).
_DP_LANE = "collective"
#: Collectives that run on a rank's compute stream, holding their group's links (``_tp_links_to_hold``).
_RANK_COLLECTIVE_KINDS = TP_KINDS | EP_KINDS
#: Ops that move bytes over links of their own: transfers (costed on the SEND) and host copies.
_MOVER_KINDS = SEND_KINDS | COPY_KINDS


class Link:
    """A link as a mutex with a FIFO of waiters: SimPy's ``Resource(capacity=1)`` grant for grant, at a fraction of
    its cost (it is taken several times per message).

    A request is granted at once when the link is free and nobody queues before it; a release frees the link now
    and grants the next waiter when its own release event is processed, as SimPy's Release does, so the order and
    the time of every grant, and the trace, are what the SimPy resource gave (a test replays random requests on
    both). A release that finds nobody waiting schedules no event (:meth:`release` says why that changes nothing).

    One exception makes simulating identical replicas one by one equal to simulating one for all: requests with the
    same ``share`` key (not ``None``) are copies of one op in replicas whose durations already count each other's
    traffic on the link, so a copy joins the holders at once instead of waiting for them.
    """

    __slots__ = ("env", "holders", "share", "waiting")

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.holders, self.share, self.waiting = env, 0, None, deque()

    def request(self, share: object = None) -> simpy.Event:
        """An event that succeeds when the link is this caller's (or shared with copies of the same op)."""
        event = self.env.event()
        if not self.holders:
            if not self.waiting:  # free, nobody queued: granted now (what _grant would do, without the queue)
                self.holders, self.share = 1, share
                event.succeed()
                return event
        elif share is not None and share == self.share:
            self.holders += 1
            event.succeed()
            return event
        self.waiting.append((event, share))
        self._grant()
        return event

    def release(self) -> None:
        """Free the link (once its last holder is done); the next waiter gets it when the release is processed.

        With nobody waiting, no release event is scheduled: it could grant nothing. A request made before it would
        be processed finds the link free and is granted at once, so for its processing to find a waiter, a holder
        granted after this release would have to release before it; but such a holder resumes only once its grant,
        scheduled after this release, is processed. Leaving the event out keeps every other event's order."""
        self.holders -= 1
        if self.holders or not self.waiting:
            return
        event = self.env.event()
        event.callbacks.append(self._grant)
        event.succeed()

    def _grant(self, _event: simpy.Event | None = None) -> None:
        if not self.holders and self.waiting:
            event, self.share = self.waiting.popleft()
            self.holders = 1
            event.succeed()
            if self.share is not None:  # its copies that queued behind other ops come along
                copies = [entry for entry in self.waiting if entry[1] == self.share]
                for entry in copies:
                    self.waiting.remove(entry)
                    self.holders += 1
                    entry[0].succeed()


class Communication:
    """Transfers, host copies and collectives of one simulation, over the links they hold.

    Args:
        env: the run's SimPy environment.
        plan: the plan being simulated.
        views: one cost view per simulated replica (simulated rank ``i · P + p`` is view i's pipeline rank p).
        suffix: the suffix of each simulated replica's op ids in the run's tables (replica 0's is empty).
        done_event: the run's ``done_event(key)``: the event to wait on until the op whose id (with its replica's
            suffix) is ``key`` is done, or ``None`` when it is done already.
        finish: the run's ``finish(op, rank, start)``: records the op's span from ``start`` (s) to now, marks it done.
        take: the run's ``take(rank, op)``: applies the memory ledger's start of ``op`` (what a PREFETCH's buffer
            allocates from the moment its copy can start).
        release: the run's ``release(rank, op)``: applies the ledger's end of ``op`` (an EVICT's weights leave).
        grad_windows: the run's ``(start, end)`` in s of each backward op a REDUCE_GRAD depends on, by op id (with
            its replica's suffix), filled as they finish; read by an overlapped gradient reduction.

    Attributes:
        share: per view, the replicas whose copies of one op share links (``None``: this view's ops hold theirs
            alone); see :class:`Link`.
        counts_bytes: per view, whether its ops count the bytes they put on links (only the first of several
            identical replicas does, since each is costed with all of them).
        tp_links: the links each TP op of each simulated rank holds while it runs (:meth:`_tp_links_to_hold`).
    """

    def __init__(self, env: simpy.Environment, plan: Plan, views: tuple[CostView, ...], suffix: list[str], *,
                 done_event: Callable[[str], simpy.Event | None],
                 finish: Callable[[Op, int, float], None], take: Callable[[int, Op], None],
                 release: Callable[[int, Op], None], grad_windows: dict[str, tuple[float, float]]) -> None:
        self.env, self.plan, self.views, self.suffix = env, plan, views, suffix
        self._done_event, self._finish, self._take, self._release = done_event, finish, take, release
        self.grad_windows = grad_windows
        self.pipeline = plan.num_ranks  # a property of the plan, read once per op
        self.instances = len(views) * self.pipeline
        self.links: dict[tuple[str, str], Link] = {}
        self.link_bytes: dict[tuple[str, str], int] = {}
        self.issued: dict[int, simpy.Event] = {}  # pair -> "RECV issued" event (its value: the RECV), until used
        self.arrived: dict[str, list] = {}  # collective op id -> the replicas' ranks that have issued it
        # Identical replicas simulated one by one (``simulate_all``) are costed with each other's traffic: copies of
        # one op in them share links (``Link``), and only the first of them counts the bytes all of them move.
        self.share = [view.concurrent if len(view.concurrent) > 1 and len(views) > 1 else None for view in views]
        self.counts_bytes = [view.replica == view.concurrent[0] for view in views]
        self.tp_links = self._tp_links_to_hold()

    # --- what the engine's walkers issue --------------------------------------------------------------------------

    def send(self, rank: int, op: Op) -> None:
        """Issue a SEND: its transfer starts once the matching RECV is issued and the SEND's deps are done."""
        self.env.process(self._transfer(rank, op))

    def recv(self, rank: int, op: Op) -> None:
        """Issue a RECV: tell the matching SEND's transfer it may go (the RECV is finished with it)."""
        key = self._pair_key(rank, op.pair)  # type: ignore[arg-type]
        event = self.issued.get(key)
        if event is None:
            event = self.issued[key] = self.env.event()
        event.succeed((rank, op))

    def copy(self, rank: int, op: Op) -> None:
        """Issue a PREFETCH or EVICT: a host copy over the rank's PCIe path."""
        self.env.process(self._host_copy(rank, op))

    def collective(self, rank: int, op: Op) -> None:
        """Issue a data-parallel collective (REDUCE_GRAD, GATHER_PARAMS)."""
        self.env.process(self._run_collective(rank, op))

    def close(self) -> None:
        """Drop the environment and everything that holds its events (links, the rendezvous, the arrivals): waiting
        processes and their events form reference cycles through this object, and a run that has ended frees them
        now instead of at the next cyclic collection. What the links carried stays (:meth:`carried`)."""
        self.env = self.links = self.issued = self.arrived = None  # type: ignore[assignment]

    def carried(self, tp_runs: dict[tuple[int, OpKind, int], int]) -> tuple[tuple[tuple[str, str], int], ...]:
        """``((src, dst), bytes)`` every used link carried, sorted: what the ops counted as they ran, plus the TP
        collectives', counted once per (view, kind, vstage) from how many ran (``tp_runs``) rather than per op."""
        link_bytes = dict(self.link_bytes)
        for (view, kind, vstage), runs in sorted(tp_runs.items()):
            if not self.counts_bytes[view]:
                continue
            for key, nbytes in self.views[view].collective_op(kind, vstage).bytes_per_link:
                link_bytes[key] = link_bytes.get(key, 0) + nbytes * runs
        return tuple(sorted(link_bytes.items()))

    def _tp_links_to_hold(self) -> dict[tuple[int, OpKind, int], tuple[tuple[str, str], ...]]:
        """The links each TP op must hold: those some other rank's op or any transfer or copy also holds
        (data-parallel collectives queue in a lane of their own, ``sim.engine.comm``). A link only one rank's TP ops
        hold is never contended (they run one at a time on that rank's compute stream), so its resource would change
        nothing and cost a SimPy request per op."""
        plan, views, pipeline = self.plan, self.views, self.pipeline
        tp_keys: dict[tuple[int, OpKind, int], tuple[tuple[str, str], ...]] = {}
        holders: dict[tuple[str, str], set[int]] = {}
        movers: list[tuple[int, Op]] = []  # transfers and copies: their links matter only where a TP op holds links
        for rank in range(self.instances):
            view, program = views[rank // pipeline], plan.programs[rank % pipeline]
            for op in program:
                kind = op.kind
                if kind in _RANK_COLLECTIVE_KINDS:
                    keys = tp_keys[(rank, kind, op.vstage)] = view.collective_op(kind, op.vstage).held_links
                    for key in keys:
                        holders.setdefault(key, set()).add(rank)
                elif kind in _MOVER_KINDS:
                    movers.append((rank, op))
        if not tp_keys:
            return {}
        other: set[tuple[str, str]] = set()
        for rank, op in movers:
            view = views[rank // pipeline]
            if op.kind in SEND_KINDS:
                other.update(view.message(op.kind, op.vstage, rank % pipeline, op.peer).held_links)  # type: ignore[arg-type]
            else:
                other.update(view.host_copy(op.kind, op.vstage, rank % pipeline).held_links)
        shared = {key for key, ranks in holders.items() if len(ranks) > 1} | other
        return {op: tuple(key for key in keys if key in shared) for op, keys in tp_keys.items()}

    def _wait_deps(self, op: Op, suffix: str) -> _Proc:
        """Wait until every dep of ``op`` (in the replica whose op ids end in ``suffix``) is done."""
        for dep in op.deps:
            event = self._done_event(dep + suffix if suffix else dep)
            if event is not None:
                yield event

    def _pair_key(self, rank: int, pair: int) -> int:
        """The engine's key of a SEND/RECV pair of simulated rank ``rank``: pair ids repeat in every replica."""
        return pair * len(self.views) + rank // self.pipeline

    def _take_links(self, keys: tuple, share: object = None) -> Generator[simpy.Event, Any, list[Link]]:
        """Request the links ``keys`` one after another, in their (global) order; returns them once all are granted."""
        held = []
        for key in keys:
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = Link(self.env)
            yield link.request(share)
            held.append(link)
        return held

    def _give_back(self, held: list[Link], link_bytes: tuple[tuple[tuple[str, str], int], ...]) -> None:
        """Release ``held`` and count the bytes ``link_bytes`` says the op put on each link."""
        for link in held:
            link.release()
        for key, nbytes in link_bytes:
            self.link_bytes[key] = self.link_bytes.get(key, 0) + nbytes

    def hold_links(self, keys: tuple[tuple[str, str], ...], duration: float,
                    link_bytes: tuple[tuple[tuple[str, str], int], ...],
                    share: object = None) -> Generator[simpy.Event, Any, float]:
        """Occupy the links ``keys`` (sorted ``(src, dst)``) for ``duration`` s, then count the bytes ``link_bytes``
        (``((src, dst), bytes)``) says the op's traffic put on each link; returns when the hold began (s).

        Links are taken in one global order, so two messages can never each hold a link the other waits for. The
        engine holds the simulated instance's own links only; the symmetric instances it stands for share links
        through the op's duration (``sim.cost.cost_view``).
        """
        held = (yield from self._take_links(keys, share)) if duration > 0 else []
        start = self.env.now
        if duration > 0:
            yield self.env.timeout(duration)
        self._give_back(held, link_bytes)
        return start

    def _transfer(self, src: int, send: Op) -> _Proc:
        # The message's whole life in one generator (its deps, the rendezvous, its links, its hold): a nested generator
        # per step (``_wait_deps``, ``hold_links``, ``_take_links``) costs a measurable share of a run, and every
        # SimPy event is the one those steps yield, in the same order.
        env, pipeline, done_event = self.env, self.pipeline, self._done_event
        view = src // pipeline
        suffix = self.suffix[view]
        for dep in send.deps:
            event = done_event(dep + suffix if suffix else dep)
            if event is not None:
                yield event
        key = self._pair_key(src, send.pair)  # type: ignore[arg-type]
        issued = self.issued
        event = issued.get(key)
        if event is None:
            event = issued[key] = env.event()
        dst, recv = yield event  # a processed event resumes at once, as in a plain ``yield``
        del issued[key]
        cost = self.views[view].message(send.kind, send.vstage, src % pipeline, dst % pipeline)
        seconds, held = cost.seconds, []
        if seconds > 0:  # self.hold_links, inlined
            share = self.share[view]
            share = share and (share, send.kind, send.vstage, send.mb)
            links = self.links
            for link_key in cost.held_links:
                link = links.get(link_key)
                if link is None:
                    link = links[link_key] = Link(env)
                yield link.request(share)
                held.append(link)
        start = env.now
        if seconds > 0:
            yield env.timeout(seconds)
        self._give_back(held, cost.bytes_per_link if self.counts_bytes[view] else ())
        self._finish(send, src, start)
        self._finish(recv, dst, start)

    def _run_collective(self, rank: int, op: Op) -> _Proc:
        """A data-parallel collective: it starts when every simulated replica has issued it and its deps are done."""
        pipeline = self.pipeline
        yield from self._wait_deps(op, self.suffix[rank // pipeline])
        collective_id = op_id(op.kind, op.vstage, op.mb)
        members = self.arrived.setdefault(collective_id, [])
        members.append(rank)
        if len(members) < len(self.views):
            return  # the last replica to arrive runs it for all
        del self.arrived[collective_id]
        cost = self.views[0].collective_op(op.kind, op.vstage)
        # Data-parallel reductions queue for their links against each other only (their own lane of each link):
        # they are one op for every replica, while messages are per replica, and a reduction that held a message's
        # link would make simulating the replicas one by one differ from one standing for all, by the order of ties.
        lane = tuple((_DP_LANE, key) for key in cost.held_links)
        if op.kind is OpKind.REDUCE_GRAD and self.plan.layout.grad_overlap:
            start = yield from self._overlapped_reduction(op, members, lane, cost.bytes_per_link)
        else:
            start = yield from self.hold_links(lane, cost.seconds, cost.bytes_per_link)
        for member in sorted(members):
            self._finish(op, member, start)
            self._release(member, op)  # what the ledger frees at its end (a reduce-scatter's flat input copy)

    def _overlapped_reduction(self, op: Op, members: list[int], lane: tuple,
                              link_bytes: tuple) -> Generator[simpy.Event, Any, float]:
        """A bucketed gradient reduction streaming behind the backward op it depends on; returns its first bucket's
        start (s) and ends when its last bucket is reduced.

        The backward makes its gradients at an even rate, so bucket k of K is ready at ``start + k/K`` of it (the
        latest over the replicas); buckets are reduced one after another, T_b each, so the last ends at
        ``max_k (ready_k + (K - k + 1)·T_b)``: the closed form of a two-stage pipeline. The links are held from the
        moment the backward ends, and the last bucket needs T_b after they are granted.
        """
        buckets, bucket_s = self.views[0].gradient_buckets(op.vstage)
        pipeline = self.pipeline
        windows = [self.grad_windows[op.deps[0] + self.suffix[member // pipeline]] for member in members]
        ready = [max(begin + k * (end - begin) / buckets for begin, end in windows) for k in range(1, buckets + 1)]
        finish = max(at + (buckets - k) * bucket_s for k, at in enumerate(ready))
        held = yield from self._take_links(lane)
        end = max(finish, self.env.now + bucket_s)
        if end > self.env.now:
            yield self.env.timeout(end - self.env.now)
        self._give_back(held, link_bytes)
        return ready[0]

    def _host_copy(self, rank: int, op: Op) -> _Proc:
        """A PREFETCH or EVICT: the copy holds the rank's PCIe path in its direction for the oracle's copy time."""
        pipeline = self.pipeline
        yield from self._wait_deps(op, self.suffix[rank // pipeline])
        cost = self.views[rank // pipeline].host_copy(op.kind, op.vstage, rank % pipeline)
        self._take(rank, op)  # a PREFETCH's destination buffer exists from the moment the copy can start
        start = yield from self.hold_links(cost.held_links, cost.seconds, cost.bytes_per_link)
        self._release(rank, op)  # an EVICT's weights leave the device
        self._finish(op, rank, start)
