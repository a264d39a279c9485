"""A SimPy simulation of NASPipe's CSP pipeline training (NASPipe §4; DESIGN §3 "NASPipe CSP in the IR").

CSP has no fixed program, so this is a separate, dynamic engine rather than a plan for ``sim.engine``: each stage
decides at run time, with :func:`sim.csp.csp_pick`, which subnet's forward to run next. Semantics (the training loop
of NASPipe's ``main_with_runtime.py``, ``shared/reference/schedules.md`` §7):

* Subnets ``0..N-1`` enter stage 0 in order, while fewer than ``lookahead`` subnets are in flight (entered and not
  finished everywhere). NASPipe bounds each stage's receive buffer to 30 instead; a bound on subnets in flight bounds
  every buffer too, and ``lookahead = 1`` is exactly one-at-a-time training (the "without CSP" ablation).
* A stage is one compute resource, running one op at a time, never preempted. Whenever it is free it decides, after
  every other event of the same instant (so an arrival at the same instant is seen, whichever process sent it):
  first a backward whose gradient has arrived (first come, first served), else the forward :func:`csp_pick` chooses
  on ``(arrived, wait_list)``, else it idles until something arrives. Backward goes first because finishing a subnet
  is what unblocks CSP (it leaves the stage's ``unfinished`` list) and the lookahead window, and it frees the
  subnet's activations — the 1F1B argument (PipeDream §3.2). NASPipe's loop alternates one forward attempt with one
  backward; the two agree except when both are ready at one decision.
* F of subnet ``b`` on stage ``s`` takes ``fwd_s[b][s]``; the last stage's F includes the loss, so its B is ready at
  once. B takes ``bwd_s[b][s]`` and is followed on the same stage by the subnet's weight update, OPT_STEP, taking
  ``update_s[b][s]`` (NASPipe calls ``optimizer.step()`` right after ``run_backward()``); only then is ``b``
  finished there. The input gradient is sent to stage ``s - 1`` as soon as B ends, overlapping the update.
* Activations go ``s → s + 1`` and gradients ``s → s - 1``, each taking ``transfer_s(src, dst, subnet, kind)``
  seconds (``kind`` is ``"F"`` or ``"B"``). Transfers do not contend with each other or with compute.

Stall statistics: a stage is *blocked* while it idles with forward inputs on hand that CSP forbids; a blocked
decision is one where :func:`csp_pick` returned ``None`` with a non-empty ``arrived`` and no backward ready.

Closed forms (uniform t_f, t_b > 0 per op, update t_u, transfer t_c; the oracles of ``tests/sim/test_csp_sim.py``):

* Disjoint subnets, t_u = t_c = 0, ``lookahead >= N``: makespan ``(N + p - 1)(t_f + t_b)``, the GPipe/1F1B value.
  It bounds any schedule from below (the last stage starts at ``(p - 1) t_f``, works ``N (t_f + t_b)``, and its
  last gradient still crosses ``p - 1`` stages); here forwards are pushed eagerly, so the last stage has its next
  input whenever a backward ends, and meets it (checked exactly for p <= 6, N <= 10 and several t_b / t_f). A window
  of p is not always enough (p = 3, N = 4, t_f = 2, t_b = 1 gives 19 s, not 18 s): CSP bounds the subnets in flight,
  1F1B the microbatches in flight per stage.
* Identical subnets (all share every layer), any lookahead: ``N (p (t_f + t_b) + t_u + 2 (p - 1) t_c)``, the
  one-at-a-time value: subnet b + 1 starts when b's update on stage 0 ends. With ``lookahead >= 2`` and p > 1,
  stage 0 is blocked ``(N - 1)(p - 1)(t_f + t_b + 2 t_c)`` seconds in ``N - 1`` decisions; other stages never.
* One at a time, any costs: the sum over subnets of their round trip (forward chain, backward chain, last update).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass
from typing import Any

import simpy
from simpy.events import NORMAL

from sim.csp import causal_deps, conflicts, csp_pick, subnet_table, wait_list
from sim.trace import Span, Trace

__all__ = ["CspProblem", "CspResult", "Decision", "StageStalls", "SHARING", "simulate_csp"]

#: How subnets share layers: from the table, every subnet with every other on every stage, or never.
SHARING = ("table", "all", "none")

TransferTime = Callable[[int, int, int, str], float]


def _table(name: str, values: Any, rows: int, cols: int) -> tuple[tuple[float, ...], ...]:
    table = tuple(tuple(float(x) for x in row) for row in values)
    if len(table) != rows or any(len(row) != cols for row in table):
        raise ValueError(f"{name} must be {rows} subnets x {cols} stages, got {[len(row) for row in table]}")
    if any(not 0 <= x < float("inf") for row in table for x in row):
        raise ValueError(f"{name} must hold finite times >= 0 s, got {table}")
    return table


@dataclass(frozen=True)
class CspProblem:
    """A CSP training run: a subnet sequence, per-op costs and the lookahead window.

    Attributes:
        num_stages: pipeline stages p, one per rank.
        uses: subnet table ``uses[subnet][stage]`` → layer keys (normalised by :func:`sim.csp.subnet_table`).
        fwd_s: forward time of each subnet on each stage, seconds (``fwd_s[subnet][stage]``).
        bwd_s: backward time, seconds.
        update_s: weight-update (OPT_STEP) time, seconds.
        transfer_s: seconds per activation or gradient message, a constant or ``f(src, dst, subnet, kind)``.
        lookahead: most subnets in flight at once (>= 1).
    """

    num_stages: int
    uses: tuple[tuple[frozenset[Hashable], ...], ...]
    fwd_s: tuple[tuple[float, ...], ...]
    bwd_s: tuple[tuple[float, ...], ...]
    update_s: tuple[tuple[float, ...], ...]
    transfer_s: float | TransferTime = 0.0
    lookahead: int = 30

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        uses = subnet_table(self.uses, self.num_stages)
        n, p = len(uses), self.num_stages
        object.__setattr__(self, "uses", uses)
        for name in ("fwd_s", "bwd_s", "update_s"):
            object.__setattr__(self, name, _table(name, getattr(self, name), n, p))
        if not callable(self.transfer_s) and not 0 <= self.transfer_s < float("inf"):
            raise ValueError(f"transfer_s must be a finite time >= 0 s or a function, got {self.transfer_s}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")

    @classmethod
    def uniform(cls, num_stages: int, uses: Any, fwd_s: float, bwd_s: float, update_s: float = 0.0,
                transfer_s: float | TransferTime = 0.0, lookahead: int = 30) -> CspProblem:
        """A problem whose every subnet costs the same on every stage (times in seconds)."""
        def grid(seconds: float) -> list[list[float]]:
            return [[seconds] * num_stages for _ in uses]

        return cls(num_stages, uses, grid(fwd_s), grid(bwd_s), grid(update_s), transfer_s, lookahead)

    @property
    def num_subnets(self) -> int:
        """Number of subnets N."""
        return len(self.uses)

    def transfer_time(self, src: int, dst: int, subnet: int, kind: str) -> float:
        """Seconds to move ``subnet``'s activation (``kind="F"``) or gradient (``"B"``) from ``src`` to ``dst``."""
        seconds = self.transfer_s(src, dst, subnet, kind) if callable(self.transfer_s) else self.transfer_s
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"transfer_s({src}, {dst}, {subnet}, {kind!r}) = {seconds}; expected a time >= 0 s")
        return float(seconds)


@dataclass(frozen=True)
class Decision:
    """One CSP decision of a stage: a forward picked, or every arrived forward blocked.

    Attributes:
        time: when it was made, seconds.
        stage: the deciding stage.
        picked: the subnet whose forward started, or ``None`` when blocked.
        arrived: the stage's arrived subnets, in arrival order, as :func:`csp_pick` saw them.
        unfinished: the stage's ``wait_list``, ascending.
        edges: ``(w, b)`` pairs for ``OPT_STEP(stage, w) → F(stage, b)``. When picked: the causal dependencies of
            ``b`` (:func:`sim.csp.causal_deps`, enough to replay the run). When blocked: every conflict that blocks an
            arrived ``b`` (:func:`sim.csp.conflicts`).
    """

    time: float
    stage: int
    picked: int | None
    arrived: tuple[int, ...]
    unfinished: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StageStalls:
    """CSP stalls of one stage: ``blocked_s`` seconds idle with only CSP-blocked forwards, ``blocked_decisions``."""

    stage: int
    blocked_s: float
    blocked_decisions: int


@dataclass(frozen=True)
class CspResult:
    """What :func:`simulate_csp` produced: the trace, every decision, and the stalls per stage."""

    trace: Trace
    decisions: tuple[Decision, ...]
    stalls: tuple[StageStalls, ...]

    @property
    def makespan(self) -> float:
        """Time from the first op's start to the last op's end, seconds."""
        return self.trace.makespan


class _AfterInstant(simpy.events.Event):
    """Fires at the current time once every ordinary (NORMAL-priority) event of this instant has been processed.

    Built like SimPy's own ``Timeout`` (an already-successful event, scheduled), one priority level lower.
    """

    def __init__(self, env: simpy.Environment) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority=NORMAL + 1)


_Proc = Generator[simpy.Event, Any, None]


class _Run:
    """The state of one simulation; built, run once, turned into a :class:`CspResult`."""

    def __init__(self, problem: CspProblem, window: int, uses: tuple) -> None:
        self.pb, self.window, self.uses = problem, window, uses
        n, p = problem.num_subnets, problem.num_stages
        self.env = simpy.Environment()
        self.arrived: list[list[int]] = [[] for _ in range(p)]  # NASPipe buffer_list, arrival order
        self.upper = [0] * p  # NASPipe wait_upper: 1 + the highest id arrived
        self.finished: list[set[int]] = [set() for _ in range(p)]
        self.grads: list[list[int]] = [[] for _ in range(p)]  # backwards ready, arrival order
        self.wake: list[simpy.Event] = [self.env.event() for _ in range(p)]
        self.updates_left = [p] * n
        self.next_subnet, self.in_flight = 0, 0
        self.spans: list[Span] = []
        self.decisions: list[Decision] = []
        self.blocked_since: list[float | None] = [None] * p
        self.blocked_s = [0.0] * p
        self.blocked_count = [0] * p
        self.pairs = 0

    # --- bookkeeping -----------------------------------------------------------------------------------------------

    def _notify(self, stage: int) -> None:
        if not self.wake[stage].triggered:
            self.wake[stage].succeed()

    def _inject(self) -> None:
        while self.next_subnet < self.pb.num_subnets and self.in_flight < self.window:
            b = self.next_subnet
            self.next_subnet, self.in_flight = b + 1, self.in_flight + 1
            self.arrived[0].append(b)  # the data loader feeds stage 0 directly
            self.upper[0] = b + 1
            self._notify(0)

    def _span(self, kind: str, stage: int, b: int, start: float, **comm: Any) -> None:
        stream = "send" if kind.startswith("SEND") else "recv" if kind.startswith("RECV") else "compute"
        self.spans.append(Span(f"{stage}{kind}{b}", kind, stage, stream, start, self.env.now, stage, b, **comm))

    def _end_stall(self, stage: int) -> None:
        since = self.blocked_since[stage]
        if since is not None:
            self.blocked_s[stage] += self.env.now - since
            self.blocked_since[stage] = None

    # --- processes -------------------------------------------------------------------------------------------------

    def _stage(self, s: int) -> _Proc:
        n = self.pb.num_subnets
        while len(self.finished[s]) < n:
            yield _AfterInstant(self.env)
            if self.grads[s]:  # backward first: it finishes a subnet, which is what unblocks CSP
                self._end_stall(s)
                yield from self._backward(s, self.grads[s].pop(0))
                continue
            if self.arrived[s]:
                arrived = tuple(self.arrived[s])
                unfinished = wait_list(self.upper[s], self.finished[s])
                b = csp_pick(s, arrived, unfinished, self.uses)
                if b is None:
                    edges = tuple((w, a) for a in arrived for w in conflicts(s, a, unfinished, self.uses))
                else:
                    edges = tuple((w, b) for w in causal_deps(s, b, self.uses))
                self.decisions.append(Decision(float(self.env.now), s, b, arrived, tuple(sorted(unfinished)), edges))
                if b is not None:
                    self._end_stall(s)
                    yield from self._forward(s, b)
                    continue
                self.blocked_count[s] += 1
                if self.blocked_since[s] is None:
                    self.blocked_since[s] = self.env.now
            self.wake[s] = self.env.event()
            yield self.wake[s]

    def _forward(self, s: int, b: int) -> _Proc:
        self.arrived[s].remove(b)
        start = self.env.now
        if self.pb.fwd_s[b][s] > 0:
            yield self.env.timeout(self.pb.fwd_s[b][s])
        self._span("F", s, b, start)
        if s == self.pb.num_stages - 1:
            self.grads[s].append(b)  # the last stage's F includes the loss
        else:
            self.env.process(self._transfer(s, s + 1, b, "F"))

    def _backward(self, s: int, b: int) -> _Proc:
        start = self.env.now
        if self.pb.bwd_s[b][s] > 0:
            yield self.env.timeout(self.pb.bwd_s[b][s])
        self._span("B", s, b, start)
        if s > 0:
            self.env.process(self._transfer(s, s - 1, b, "B"))
        start = self.env.now
        if self.pb.update_s[b][s] > 0:
            yield self.env.timeout(self.pb.update_s[b][s])
        self._span("OPT_STEP", s, b, start)
        self.finished[s].add(b)
        self.updates_left[b] -= 1
        if self.updates_left[b] == 0:  # finished everywhere: leaves the lookahead window
            self.in_flight -= 1
            self._inject()

    def _transfer(self, src: int, dst: int, b: int, kind: str) -> _Proc:
        pair, self.pairs = self.pairs, self.pairs + 1
        start = self.env.now
        yield self.env.timeout(self.pb.transfer_time(src, dst, b, kind))
        self._span(f"SEND_{kind}", src, b, start, pair=pair, peer=dst)
        self._span(f"RECV_{kind}", dst, b, start, pair=pair, peer=src)
        if kind == "F":
            self.arrived[dst].append(b)
            self.upper[dst] = max(self.upper[dst], b + 1)
        else:
            self.grads[dst].append(b)
        self._notify(dst)

    # --- driver ----------------------------------------------------------------------------------------------------

    def run(self, meta: dict[str, Any]) -> CspResult:
        self._inject()
        for s in range(self.pb.num_stages):
            self.env.process(self._stage(s))
        self.env.run()
        left = [b for b, count in enumerate(self.updates_left) if count]
        if left:  # cannot happen (sim.csp, property 3); report the state rather than a wrong trace
            state = "; ".join(f"stage {s}: arrived {self.arrived[s]}, grads {self.grads[s]}, finished "
                              f"{sorted(self.finished[s])}" for s in range(self.pb.num_stages))
            raise RuntimeError(f"CSP run deadlocked at t={self.env.now} s with subnets {left} unfinished: {state}")
        p = self.pb.num_stages
        trace = Trace.from_spans(self.spans, ("ideal",) * p, meta)
        stalls = tuple(StageStalls(s, self.blocked_s[s], self.blocked_count[s]) for s in range(p))
        return CspResult(trace, tuple(self.decisions), stalls)


def simulate_csp(problem: CspProblem, *, one_at_a_time: bool = False, sharing: str = "table") -> CspResult:
    """Simulate CSP training of ``problem``'s subnet sequence.

    Args:
        problem: subnets, costs and lookahead.
        one_at_a_time: the ablation without CSP overlap: subnet ``b`` enters stage 0 only after ``b - 1`` has
            finished on every stage (a lookahead of 1).
        sharing: ``"table"`` uses ``problem.uses``; ``"all"`` makes every two subnets conflict on every stage;
            ``"none"`` makes them never conflict (for tests and bounds).

    Returns:
        The trace (ops ``"2F5"``, ``"2B5"``, ``"2OPT_STEP5"``, ``"2SEND_F5"``/``"3RECV_F5"``, ``"2SEND_B5"``/
        ``"1RECV_B5"``; ``rank = vstage = stage``, ``mb = subnet``), every decision, and the stalls per stage. The
        same input gives the same result.

    Raises:
        ValueError: an unknown ``sharing``, or a transfer function returning a negative time.
    """
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {SHARING}, got {sharing!r}")
    p, n = problem.num_stages, problem.num_subnets
    if sharing == "all":
        uses = tuple((frozenset({"*"}),) * p for _ in range(n))
    elif sharing == "none":
        uses = tuple((frozenset({("own", b)}),) * p for b in range(n))
    else:
        uses = problem.uses
    window = 1 if one_at_a_time else problem.lookahead
    meta = {"source": "sim", "schedule": "csp", "lookahead": window, "sharing": sharing,
            "one_at_a_time": one_at_a_time, "num_subnets": n}
    return _Run(problem, window, uses).run(meta)
