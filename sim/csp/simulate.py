"""A SimPy simulation of NASPipe's CSP pipeline training (NASPipe §4; DESIGN §3 "NASPipe CSP in the IR").

CSP has no fixed program, so this is a separate, dynamic engine rather than a plan for ``sim.engine.simpy_engine``: each
stage decides at run time, with :func:`sim.csp.rules.csp_pick`, which subnet's forward to run next. Semantics (the
training loop of NASPipe's ``main_with_runtime.py``, ``shared/reference/schedules.md`` §7):

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
  seconds (``kind`` is ``"F"`` or ``"B"``, the spelling of the op kind whose output moves). Transfers do not contend
  with each other or with compute.

Stall statistics: a stage is *blocked* while it idles with forward inputs on hand that CSP forbids; a blocked
decision is one where :func:`csp_pick` returned ``None`` with a non-empty ``arrived`` and no backward ready.

Closed forms (uniform t_f, t_b > 0 per op, update t_u, transfer t_c; the oracles of ``tests/sim/csp/test_simulate.py``):

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

Context switching (DESIGN §3; NASPipe's "stash the supernet in CPU memory, predict, prefetch/evict"). When the
problem has ``key_bytes`` and a ``param_budget_bytes`` and the policy is not ``"resident"``, each stage starts with
no layer resident and may hold at most the budget of layer parameters; a forward needs all its keys resident.
Each stage has one host-to-device copy engine (``h2d`` stream, a SimPy priority resource apart from compute, so
copies overlap compute) and one device-to-host engine (``d2h``). A copy of subnet ``b``'s missing keys is one span
``"{s}PREFETCH{b}"``; the write-back that made room for it is one span ``"{s}EVICT{b}"`` before it. Copies of a stage
are serialised on its h2d engine, a demand copy (the stage waits for it) before any queued prefetch.

* ``"resident"``: every layer resident, no copies, the budget ignored (the ablation "all layers resident"); the
  run is exactly the one without a budget.
* ``"on_demand"``: the missing keys are copied when the forward is picked, and the stage waits (NASPipe's released
  code: forward pre-hooks copying to the GPU).
* ``"predict"``: as on_demand, and in addition, when a stage picks a forward of ``b`` and after each backward +
  update, it predicts its next forward with :func:`sim.csp.rules.predict_next` on the state it will decide in: ``b``
  leaves ``arrived``; on the last stage ``b`` also finishes first (its backward follows at once), and so does every
  subnet whose gradient is already waiting (backward goes first); the next subnet to arrive (id ``upper``) counts as
  arrived, since the sequence is sampled ahead and mostly arrives in order; only subnets that memory admission would
  let start are candidates. NASPipe's own predictor looks at arrived subnets only; on a stage fed one subnet at a
  time that leaves nothing to predict while it computes. The predicted subnet's missing keys are prefetched,
  evicting only keys whose next use comes after it; if that does not free enough room the prefetch is dropped (the
  next prediction tries again), so it never holds the copy engine while waiting. A prefetch whose subnet has started
  by the time the engine is free is dropped too, and a forward whose keys are all resident never waits for the
  engine.

Eviction follows Belady's rule on the known subnet sequence: the key whose next user (the smallest subnet id that
has neither started nor finished on the stage) comes last goes first, least recently used among equals (use = a
forward or update of the key, or its copy). A *pinned* key (one used by a subnet whose forward has started on the
stage and that has not finished there) is never evicted, so a key is written back only after its last update.

Predict versus on_demand. On one stage the predictor is never slower (``tests/sim/csp/test_prefetch.py``): the next
subnet does not depend on timing there, so the prediction is exact and a prefetch is the demand copy issued early.
On several stages no predictor can promise it: CSP's greedy dispatch is not monotone in op durations (Graham's
list-scheduling anomaly); hiding a copy shortens the wait before a forward, which can let a gradient overtake a
forward on the critical path. Even every layer resident can be slower than copy-on-demand (the exact case is in the
tests). In 3000 random problems of 1-4 stages the predictor was faster in 2032, equal in 926 and slower in 42 (at
most 18%; ``python -m experiments.run csp_prefetch``); on NASPipe's spaces it is 12-27% faster (``naspipe``).

Memory admission (needed for deadlock freedom; not in NASPipe): a stage considers an arrived subnet ``b`` for
:func:`csp_pick` only if ``keys(b) ∪ pinned ∪ keys(w)`` fits the budget for every unfinished ``w < b`` of the stage
(and ``keys(b) ∪ pinned`` when there is none); the decision records the admitted arrivals. Then the smallest
unfinished subnet of a stage always fits beside the pinned keys (every pinned subnet was admitted with it in the
check, and pinned only shrinks otherwise), so with a budget of at least every subnet's own keys per stage, the
smallest unfinished subnet overall can always run and the CSP no-deadlock argument (:mod:`sim.csp.rules`, property 3)
still applies. Without it, a stage can pin a later subnet ``c`` so that the earlier ``m`` does not fit, while the next
stage waits for ``m`` before it may run ``c``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy
from simpy.events import NORMAL

from sim.csp.memory import CopyPlan, StageMemory, StageState
from sim.csp.problem import (
    PREFETCH_POLICIES,
    SHARING,
    CspProblem,
    CspResult,
    Decision,
    StageCopies,
    StageStalls,
)
from sim.csp.rules import causal_deps, conflicts, csp_pick, wait_list
from sim.ir.ops import OpKind, message_kinds, stream_of
from sim.ir.trace import Span, Trace

__all__ = ["CspProblem", "CspResult", "Decision", "PREFETCH_POLICIES", "StageCopies", "StageStalls", "SHARING",
           "simulate_csp"]

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

    def __init__(self, problem: CspProblem, window: int, uses: tuple, policy: str = "resident") -> None:
        self.pb, self.window, self.uses = problem, window, uses
        self.mem = policy != "resident" and problem.param_budget_bytes is not None
        self.policy = policy
        n, p = problem.num_subnets, problem.num_stages
        self.env = simpy.Environment()
        # Per stage: NASPipe's buffer_list (arrived), wait_upper (upper), finished, and the ready backwards.
        self.st = [StageState() for _ in range(p)]
        self.wake: list[simpy.Event] = [self.env.event() for _ in range(p)]
        self.updates_left = [p] * n
        self.next_subnet, self.in_flight = 0, 0
        self.spans: list[Span] = []
        self.decisions: list[Decision] = []
        self.blocked_since: list[float | None] = [None] * p
        self.blocked_s = [0.0] * p
        self.blocked_count = [0] * p
        self.pairs = 0
        # context switching (only when self.mem): the decisions are sim.csp.memory's, shared with the executor
        self.memory = [StageMemory(s, p, uses, problem.key_bytes or {}, problem.param_budget_bytes or 0, self.st[s])
                       for s in range(p)] if self.mem else []
        self.copy_wait = [0.0] * p
        self.admit_since: list[float | None] = [None] * p
        self.admit_wait = [0.0] * p
        self.h2d = [simpy.PriorityResource(self.env, capacity=1) for _ in range(p)]
        # device memory (only with problem.memory): static state + in-flight activations (+ resident keys' state)
        model = problem.memory
        self.in_use = list(model.static_bytes) if model else [0] * p
        self.peak_memory = list(self.in_use)
        self.d2h = [simpy.Resource(self.env, capacity=1) for _ in range(p)]

    # --- bookkeeping -----------------------------------------------------------------------------------------------

    def _notify(self, stage: int) -> None:
        if not self.wake[stage].triggered:
            self.wake[stage].succeed()

    def _inject(self) -> None:
        while self.next_subnet < self.pb.num_subnets and self.in_flight < self.window:
            b = self.next_subnet
            self.next_subnet, self.in_flight = b + 1, self.in_flight + 1
            self.st[0].arrived.append(b)  # the data loader feeds stage 0 directly
            self.st[0].upper = b + 1
            self._notify(0)

    def _span(self, kind: OpKind, stage: int, b: int, start: float, **comm: Any) -> None:
        """Record an op of the plan's vocabulary on its kind's stream (``sim.ir.ops.OP_SEMANTICS``), the subnet as
        its microbatch."""
        self.spans.append(Span(f"{stage}{kind.value}{b}", kind.value, stage, stream_of(kind), start, self.env.now,
                               stage, b, **comm))

    def _end_stall(self, stage: int) -> None:
        since = self.blocked_since[stage]
        if since is not None:
            self.blocked_s[stage] += self.env.now - since
            self.blocked_since[stage] = None

    # --- context switching -----------------------------------------------------------------------------------------

    def _copy(self, s: int, plan: CopyPlan) -> _Proc:
        """Run ``plan``: EVICT its victims (d2h), then PREFETCH its missing keys (h2d); the caller holds the h2d
        engine."""
        memory = self.memory[s]
        memory.begin(plan)
        if plan.victims:
            with self.d2h[s].request() as req:
                yield req
                start = self.env.now
                seconds = self.pb.copy_time("d2h", s, memory.nbytes(plan.victims))
                if seconds > 0:
                    yield self.env.timeout(seconds)
                self._span(OpKind.EVICT, s, plan.subnet, start)
            memory.evicted(plan)
        memory.copying(plan)
        start = self.env.now
        seconds = self.pb.copy_time("h2d", s, memory.nbytes(plan.missing))
        if seconds > 0:
            yield self.env.timeout(seconds)
        self._span(OpKind.PREFETCH, s, plan.subnet, start)
        memory.copied(plan)

    def _demand(self, s: int, b: int) -> _Proc:
        """Make ``b``'s keys on ``s`` resident before its forward (admission guarantees room)."""
        if self.memory[s].keys(b) <= self.memory[s].resident.keys():
            return  # nothing to copy: do not queue behind a prefetch of someone else's layers
        with self.h2d[s].request(priority=0) as req:
            yield req
            plan = self.memory[s].demand(b)  # decided now: a prefetch may have brought the keys meanwhile
            if plan is not None:
                yield from self._copy(s, plan)

    def _prefetch(self, s: int, x: int, done: frozenset[int]) -> _Proc:
        """Prefetch predicted subnet ``x``'s missing keys once the h2d engine is free, if still useful then."""
        with self.h2d[s].request(priority=1) as req:
            yield req
            plan = self.memory[s].prefetch(x, done)
            if plan is not None:
                yield from self._copy(s, plan)

    def _predict(self, s: int, running: int | None) -> None:
        if self.mem and self.policy == "predict":
            predicted = self.memory[s].predict(running)
            if predicted is not None:
                self.env.process(self._prefetch(s, *predicted))

    def _end_admit(self, s: int) -> None:
        since = self.admit_since[s]
        if since is not None:
            self.admit_wait[s] += self.env.now - since
            self.admit_since[s] = None

    # --- processes -------------------------------------------------------------------------------------------------

    def _stage(self, s: int) -> _Proc:
        n = self.pb.num_subnets
        while len(self.st[s].finished) < n:
            yield _AfterInstant(self.env)
            if self.st[s].grads:  # backward first: it finishes a subnet, which is what unblocks CSP
                self._end_stall(s)
                self._end_admit(s)
                yield from self._backward(s, self.st[s].grads.pop(0))
                continue
            unfinished = wait_list(self.st[s].upper, self.st[s].finished)
            arrived = self.memory[s].admitted(self.st[s].arrived, unfinished) if self.mem else tuple(self.st[s].arrived)
            if self.st[s].arrived and not arrived and self.admit_since[s] is None:
                self.admit_since[s] = self.env.now
            if arrived:
                self._end_admit(s)
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
        if self.mem:
            self._predict(s, b)  # before b leaves arrived: predict_next takes it out itself
        self.st[s].arrived.remove(b)
        start = self.env.now
        if self.mem:
            self.memory[s].start(b)
            yield from self._demand(s, b)
            self.copy_wait[s] += self.env.now - start
            self.memory[s].touch(self.memory[s].keys(b))
            start = self.env.now
        self._hold(s, b, +1)
        if self.pb.fwd_s[b][s] > 0:
            yield self.env.timeout(self.pb.fwd_s[b][s])
        self._span(OpKind.F, s, b, start)
        if s == self.pb.num_stages - 1:
            self.st[s].grads.append(b)  # the last stage's F includes the loss
        else:
            self.env.process(self._transfer(s, s + 1, b, OpKind.F))

    def _backward(self, s: int, b: int) -> _Proc:
        start = self.env.now
        if self.pb.bwd_s[b][s] > 0:
            yield self.env.timeout(self.pb.bwd_s[b][s])
        self._span(OpKind.B, s, b, start)
        self._hold(s, b, -1)
        if s > 0:
            self.env.process(self._transfer(s, s - 1, b, OpKind.B))
        start = self.env.now
        if self.pb.update_s[b][s] > 0:
            yield self.env.timeout(self.pb.update_s[b][s])
        self._span(OpKind.OPT_STEP, s, b, start)
        self.st[s].finished.add(b)
        if self.mem:
            self.memory[s].finish(b)
            self._predict(s, None)
        self.updates_left[b] -= 1
        if self.updates_left[b] == 0:  # finished everywhere: leaves the lookahead window
            self.in_flight -= 1
            self._inject()

    def _hold(self, s: int, b: int, sign: int) -> None:
        """Subnet ``b``'s activations on stage ``s`` are allocated (+1, its forward starts) or freed (-1, its
        backward ended); the peak counts the resident keys' training state too under a budget."""
        model = self.pb.memory
        if model is None:
            return
        self.in_use[s] += sign * model.activation_bytes[b][s]
        keys = int(self.memory[s].used * model.state_per_param_byte) if self.mem else 0
        self.peak_memory[s] = max(self.peak_memory[s], self.in_use[s] + keys)

    def _transfer(self, src: int, dst: int, b: int, source: OpKind) -> _Proc:
        """Move the output of ``source`` (F: the activation; B: the input gradient) from ``src`` to ``dst``."""
        pair, self.pairs = self.pairs, self.pairs + 1
        start = self.env.now
        yield self.env.timeout(self.pb.transfer_time(src, dst, b, source.value))
        send, recv = message_kinds(source)
        self._span(send, src, b, start, pair=pair, peer=dst)
        self._span(recv, dst, b, start, pair=pair, peer=src)
        if source is OpKind.F:
            self.st[dst].arrived.append(b)
            self.st[dst].upper = max(self.st[dst].upper, b + 1)
        else:
            self.st[dst].grads.append(b)
        self._notify(dst)

    # --- driver ----------------------------------------------------------------------------------------------------

    def run(self, meta: dict[str, Any]) -> CspResult:
        self._inject()
        for s in range(self.pb.num_stages):
            self.env.process(self._stage(s))
        self.env.run()
        left = [b for b, count in enumerate(self.updates_left) if count]
        if left:  # cannot happen (sim.csp.rules, property 3); report the state rather than a wrong trace
            state = "; ".join(f"stage {s}: arrived {self.st[s].arrived}, grads {self.st[s].grads}, finished "
                              f"{sorted(self.st[s].finished)}" for s in range(self.pb.num_stages))
            raise RuntimeError(f"CSP run deadlocked at t={self.env.now} s with subnets {left} unfinished: {state}")
        p = self.pb.num_stages
        trace = Trace.from_spans(self.spans, self.pb.devices or ("ideal",) * p, meta)
        stalls = tuple(StageStalls(s, self.blocked_s[s], self.blocked_count[s]) for s in range(p))
        copies = tuple(StageCopies(s, m.h2d_bytes, m.d2h_bytes, self.copy_wait[s], self.admit_wait[s], m.peak,
                                   m.prefetches, m.evictions) for s, m in enumerate(self.memory))
        return CspResult(trace, tuple(self.decisions), stalls, copies, tuple(self.peak_memory))


def simulate_csp(problem: CspProblem, *, one_at_a_time: bool = False, sharing: str = "table",
                 prefetch: str = "predict") -> CspResult:
    """Simulate CSP training of ``problem``'s subnet sequence.

    Args:
        problem: subnets, costs and lookahead.
        one_at_a_time: the ablation without CSP overlap: subnet ``b`` enters stage 0 only after ``b - 1`` has
            finished on every stage (a lookahead of 1).
        sharing: ``"table"`` uses ``problem.uses``; ``"all"`` makes every two subnets conflict on every stage;
            ``"none"`` makes them never conflict (for tests and bounds).
        prefetch: context-switch policy, ``"predict"``, ``"on_demand"`` or ``"resident"`` (module docstring); it
            matters only when ``problem`` has a ``param_budget_bytes``.

    Returns:
        The trace (ops ``"2F5"``, ``"2B5"``, ``"2OPT_STEP5"``, ``"2SEND_F5"``/``"3RECV_F5"``, ``"2SEND_B5"``/
        ``"1RECV_B5"``, and under a budget ``"2PREFETCH5"`` on ``h2d``, ``"2EVICT5"`` on ``d2h``; ``rank = vstage =
        stage``, ``mb = subnet``), every decision, the stalls and the copy statistics per stage. The same input
        gives the same result.

    Raises:
        ValueError: an unknown ``sharing`` or ``prefetch``, a budget with ``sharing`` other than ``"table"``, or a
            transfer or copy function returning a negative time.
    """
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {SHARING}, got {sharing!r}")
    if prefetch not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch must be one of {PREFETCH_POLICIES}, got {prefetch!r}")
    mem = prefetch != "resident" and problem.param_budget_bytes is not None
    if mem and sharing != "table":
        raise ValueError(f"a parameter budget needs sharing='table' (key bytes are per table key), got {sharing!r}")
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
    if mem:
        meta.update(prefetch=prefetch, param_budget_bytes=problem.param_budget_bytes)
    return _Run(problem, window, uses, prefetch if mem else "resident").run(meta)
