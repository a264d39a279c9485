"""NASPipe's causal synchronous parallel (CSP) training, run online on each rank (NASPipe, ASPLOS'22 §3.2; DESIGN §3).

CSP cannot be a fixed program: which subnet a stage runs next depends on what has finished. Each rank therefore
runs a small event loop instead of the L1 interpreter:

* Subnets enter stage 0 in chronological order, at most ``lookahead`` in flight. A stage keeps ``arrived`` (subnets
  whose forward input is here, in arrival order) and ``finished`` (backward + update done here); every id below the
  highest arrived one that is not finished counts as unfinished, arrived or not (``sim.csp.rules.wait_list``). It runs,
  in this priority: a backward whose output gradient has arrived (it frees layers for later subnets and its
  gradient unblocks the previous stage; NASPipe's loop runs backward as soon as a gradient arrives, schedules.md
  §7), else the forward that :func:`sim.csp.rules.csp_pick` chooses, else it waits for a message.
* After a subnet's backward on a stage comes its weight update on that stage, on the layers it used only (an
  optimizer over the stage skips parameters without gradients). The update happens before any later subnet that
  shares a layer may run its forward there, which is what makes the result independent of timing (NASPipe §3.2).
* Messages between stages carry a header (the subnet id) because the receiver cannot know the order in which its
  neighbour will run subnets; every channel has one outstanding header receive that the loop polls.

Context switching (``param_budget_bytes`` with ``prefetch`` ``"on_demand"`` or ``"predict"``; NASPipe §4.3). The
candidates' parameters and optimizer state live in host memory (:mod:`executor.csp.offload`) and the device holds at
most the budget of them, by the simulator's rules (:mod:`sim.csp.memory`): only arrivals that memory admission lets
start are offered to :func:`~sim.csp.rules.csp_pick`; a picked forward first makes its keys resident (a demand copy,
which the stage waits for); with ``"predict"``, picking a forward and finishing an update each predict the next forward
and prefetch its keys. On CUDA a prefetch is issued at once on the copy stream, after the demand copy. On CPU the rank
has no copy engine apart from its one thread, so a prefetch is queued and runs when the current op is done (after the
forward's activation is posted, or after the update), before the next decision, re-checked then as the simulator
re-checks a queued prefetch; it costs the thread the copy, but not the forward it was made for.

Every op is recorded as a :class:`sim.ir.trace.Span` on this rank's ``time.perf_counter`` clock: F, B, OPT_STEP on
``compute``, PREFETCH on ``h2d``, EVICT on ``d2h``, and SEND/RECV of activations and gradients with a ``pair`` id
both ends agree on; a send's span is its post time, a receive's the moment the payload was in;
:func:`executor.csp.trace.csp_trace` joins them into one trace in the simulator's format.

Checkpoints (``executor.run --checkpoint-every K``; NASPipe has none). A subnet is one training step, and the
checkpoint after K·j subnets must hold a state every stage agrees on: stage 0 lets no subnet at or past the boundary
in until it has finished every subnet before it, which it does last of all stages (a subnet's update on stage 0 follows
its backward on every later stage), so each stage finishes the subnets below the boundary and then has nothing else to
run: there it writes its shard (``at_drain``) and waits for the others at a barrier. Draining costs a pipeline bubble
at each checkpoint, and changes nothing in the result, which CSP makes independent of the schedule. A run resumed at
subnet N starts with subnets 0..N-1 finished on every stage.

Shared layers. The embedding and the head are used by every subnet; if they were trained, CSP would have to
serialise the first and last stage completely (every subnet conflicts with every earlier one there). Like a NAS
supernet whose search space is the choice blocks, they are frozen here (``requires_grad=False``), in the pipeline and
in the sequential reference alike.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from executor.csp.offload import ParamOffload, candidate_params
from sim.csp.memory import CopyPlan, StageMemory, StageState
from sim.csp.rules import csp_pick
from sim.ir.trace import Span

__all__ = ["CspRankResult", "run_csp_rank"]

_END = -1  # header of the end marker each rank sends its neighbours when it is done


@dataclass
class CspRankResult:
    """What one rank did.

    Attributes:
        losses: subnet → its loss (last stage only).
        decisions: ``(time s, subnet)`` of every forward this rank started, in order.
        spans: every op, on this rank's ``time.perf_counter`` clock (s); SEND/RECV not yet joined (module docstring).
        copies: context-switch statistics of this stage: the keys of ``sim.run``'s ``csp.copies`` (bytes in the
            plan's units; ``prefetches`` counts every copy-in, demand copies included), plus ``prefetches_ahead``
            (copy-ins the predictor made before the forward was picked) and ``h2d_tensor_bytes``/
            ``d2h_tensor_bytes`` (what torch moved: fp32 parameters and optimizer state); ``None`` without a budget.
        checkpoint_s: what each checkpoint took on this rank (``at_drain`` and the barrier after it), s; also a
            CHECKPOINT span on ``compute``.
    """

    losses: dict[int, float] = field(default_factory=dict)
    decisions: list[tuple[float, int]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    copies: dict[str, Any] | None = None
    checkpoint_s: list[float] = field(default_factory=list)


class _Channel:
    """One directed neighbour link, read by a thread: a header (subnet id) then a payload of known shape.

    A thread per incoming channel does blocking receives and puts ``(box, subnet, tensor, arrival s)`` on the rank's
    inbox, so the loop can wait for "whichever message comes first" without spinning (gloo's receive handles only
    learn they completed inside ``wait``, so they cannot be polled). The thread ends at the neighbour's end marker.
    """

    def __init__(self, box: str, peer: int, shape: tuple[int, ...], inbox: queue.Queue, group: Any = None) -> None:
        self.box, self.peer, self.shape, self.inbox, self.group = box, peer, shape, inbox, group
        self.thread = threading.Thread(target=self._run, name=f"csp-recv-{box}-{peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                header = torch.zeros(1, dtype=torch.int64)
                dist.recv(header, src=self.peer, group=self.group)
                subnet = int(header.item())
                if subnet == _END:
                    return
                payload = torch.empty(self.shape)
                dist.recv(payload, src=self.peer, group=self.group)
                self.inbox.put((self.box, subnet, payload, time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - handed to the loop, which raises it on the rank's thread
            self.inbox.put(("error", -1, exc, 0.0))

    def close(self, timeout_s: float) -> None:
        """Wait for the neighbour's end marker, so no receive is left outstanding at teardown."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"rank {self.peer} never sent its end marker on the {self.box} channel")


def _send(peer: int, subnet: int, tensor: Tensor, pending: list, group: Any = None) -> None:
    """Post header and payload without blocking: two neighbours may send to each other at the same moment, and a
    blocking send would wait for a receive the other side only posts when its loop comes round."""
    header, payload = torch.tensor([subnet], dtype=torch.int64), tensor.contiguous()
    pending.append((dist.isend(header, dst=peer, group=group), header))
    pending.append((dist.isend(payload, dst=peer, group=group), payload))


def _pair(kind: str, low_stage: int, subnet: int, num_stages: int) -> int:
    """The id both ends give the transfer of ``subnet``'s activation (``"F"``) or gradient (``"B"``) across the
    link between ``low_stage`` and ``low_stage + 1``."""
    return 2 * (subnet * max(1, num_stages - 1) + low_stage) + (kind == "B")


def run_csp_rank(*, rank: int, num_stages: int, stage: nn.Module, uses: Sequence[Sequence[frozenset]],
                 choose: Callable[[int], None], optimizer: torch.optim.Optimizer,
                 batch: Callable[[int], tuple[Tensor, Tensor]], loss: Callable[[Tensor, Tensor], Tensor],
                 boundary_shape: tuple[int, ...], lookahead: int, timeout_s: float = 120.0,
                 key_bytes: Mapping[Hashable, int] | None = None, param_budget_bytes: int | None = None,
                 prefetch: str = "resident", device: torch.device | None = None, first_subnet: int = 0,
                 drain_every: int = 0, at_drain: Callable[[int, Mapping[int, float]], None] | None = None,
                 before_forward: Callable[[int], None] | None = None,
                 after_update: Callable[[int, float, float], None] | None = None) -> CspRankResult:
    """Train every subnet of ``uses`` through this rank's stage with CSP; returns what this rank did.

    Args:
        rank: this rank = its stage index.
        num_stages: ranks in the pipeline.
        stage: this stage's module (trainable parameters: the choice blocks).
        uses: ``uses[subnet][stage]`` = the layer keys the subnet uses on each stage (``sim.csp.rules``'s table).
        choose: ``subnet -> None``, selects the subnet's candidates in ``stage`` (``set_subnet``).
        optimizer: over the stage's trainable parameters; stepped after each subnet's backward.
        batch: ``subnet -> (inputs, targets)`` of its minibatch (used by the first and last stage).
        loss: ``(output, targets) -> scalar``.
        boundary_shape: shape of the activation between stages (the same for every subnet).
        lookahead: at most this many subnets in flight from stage 0.
        timeout_s: how long to wait for a message before giving up with an error, s.
        key_bytes: bytes of each layer key of ``uses`` (the plan's ``problem.key_bytes``).
        param_budget_bytes: most layer-key bytes resident on this rank's device; ``None``: everything resident.
        prefetch: ``"predict"``, ``"on_demand"`` or ``"resident"`` (module docstring); only with a budget.
        device: where resident layers live (default CPU); the stage's other tensors must be there already.
        first_subnet: the subnet to start at; those before it are trained already (a resumed run's checkpoint).
        drain_every: drain the pipeline after every this many subnets (counted from subnet 0) and call ``at_drain``
            there (module docstring); 0: never.
        at_drain: ``(subnets done, this rank's losses so far) -> None``, with every parameter and its optimizer
            state in place (:meth:`executor.csp.offload.ParamOffload.whole`): write this rank's checkpoint shard.
        before_forward: called with the subnet before each forward (``--fail``'s injected crash).
        after_update: ``(subnet, its forward's start s, now s) -> None`` after each update, on this rank's
            ``time.perf_counter`` clock (a restart's measure of the first step).
    """
    if drain_every and at_drain is None:
        raise ValueError("drain_every needs at_drain (what to do at each drained boundary)")
    memory = offload = None
    state = StageState()
    if param_budget_bytes is not None and prefetch != "resident":
        if key_bytes is None:
            raise ValueError("param_budget_bytes needs key_bytes (the plan's bytes of each layer key)")
        memory = StageMemory(rank, num_stages, uses, key_bytes, param_budget_bytes, state)
        offload = ParamOffload(candidate_params(stage), optimizer, device or torch.device("cpu"))
    loop = _RankLoop(rank, num_stages, stage, uses, choose, optimizer, batch, loss, boundary_shape, lookahead,
                     timeout_s, state, memory, offload, prefetch == "predict")
    loop.start_at(first_subnet, drain_every, at_drain)
    loop.before_forward, loop.after_update = before_forward, after_update
    return loop.run()


class _RankLoop:
    """The event loop of one rank (module docstring); built and run once by :func:`run_csp_rank`."""

    def __init__(self, rank: int, num_stages: int, stage: nn.Module, uses: Sequence[Sequence[frozenset]],
                 choose: Callable[[int], None], optimizer: torch.optim.Optimizer,
                 batch: Callable[[int], tuple[Tensor, Tensor]], loss: Callable[[Tensor, Tensor], Tensor],
                 boundary_shape: tuple[int, ...], lookahead: int, timeout_s: float, state: StageState,
                 memory: StageMemory | None, offload: ParamOffload | None, predict: bool) -> None:
        self.rank, self.num_stages, self.stage, self.uses, self.choose = rank, num_stages, stage, uses, choose
        self.optimizer, self.batch, self.loss = optimizer, batch, loss
        self.lookahead, self.timeout_s = lookahead, timeout_s
        self.first, self.last = rank == 0, rank == num_stages - 1
        self.state, self.memory, self.offload = state, memory, offload
        self.predict = predict and memory is not None
        self.result = CspRankResult()
        self.inbox: queue.Queue = queue.Queue()
        self.inputs: dict[int, Tensor] = {}
        self.grad_in: dict[int, Tensor] = {}
        self.saved: dict[int, tuple[Tensor, Tensor]] = {}
        self.sent: list[tuple[Any, Tensor]] = []  # (work, tensor kept alive until the send completes)
        self.prefetches: list[tuple[int, frozenset[int]]] = []  # CPU: predicted (subnet, done), to run
        self.done = self.injected = self.ahead = 0
        self.copy_wait_s = self.admission_wait_s = 0.0
        # One process group per direction of each neighbour link, so that every group is used by one thread per
        # process (a receiver thread or the loop): gloo's pairs are not meant to be driven from two threads at once,
        # and doing so aborted runs now and then. new_group is collective: every rank creates every group, in order.
        self.drain_every: int = 0
        self.at_drain: Callable[[int, Mapping[int, float]], None] | None = None
        self.before_forward: Callable[[int], None] | None = None
        self.after_update: Callable[[int, float, float], None] | None = None
        self.forward_start: dict[int, float] = {}
        self.forward_groups, self.backward_groups = [], []
        for k in range(num_stages - 1):
            self.forward_groups.append(dist.new_group([k, k + 1]))  # activations k -> k + 1
            self.backward_groups.append(dist.new_group([k, k + 1]))  # gradients k + 1 -> k
        self.channels = [
            None if self.first else _Channel("forward", rank - 1, boundary_shape, self.inbox,
                                             self.forward_groups[rank - 1]),
            None if self.last else _Channel("backward", rank + 1, boundary_shape, self.inbox,
                                            self.backward_groups[rank]),
        ]

    def start_at(self, first_subnet: int, drain_every: int,
                 at_drain: Callable[[int, Mapping[int, float]], None] | None) -> None:
        """Resume at ``first_subnet`` (those before it finished on every stage) and drain as
        :func:`run_csp_rank` says."""
        self.done = self.injected = self.state.upper = first_subnet
        self.state.finished.update(range(first_subnet))
        self.drain_every, self.at_drain = drain_every, at_drain

    def _injection_limit(self, num_subnets: int) -> int:
        """Stage 0 lets no subnet in at or past the next checkpoint boundary before the pipeline has drained."""
        if not self.drain_every:
            return num_subnets
        return min(num_subnets, (self.done // self.drain_every + 1) * self.drain_every)

    def _span(self, kind: str, subnet: int, start: float, end: float | None = None, stream: str = "compute",
              pair: int | None = None, peer: int | None = None) -> None:
        end = time.perf_counter() if end is None else end
        self.result.spans.append(Span(f"{self.rank}{kind}{subnet}", kind, self.rank, stream, start, end, self.rank,
                                      subnet, pair, peer))

    def _accept(self, box: str, subnet: int, tensor: Any, arrival: float) -> None:
        if box == "error":
            raise tensor
        st = self.state
        if box == "forward":
            st.arrived.append(subnet)
            st.upper = max(st.upper, subnet + 1)
            self.inputs[subnet] = tensor
            pair, peer = _pair("F", self.rank - 1, subnet, self.num_stages), self.rank - 1
        else:
            st.grads.append(subnet)
            self.grad_in[subnet] = tensor
            pair, peer = _pair("B", self.rank, subnet, self.num_stages), self.rank + 1
        self._span(f"RECV_{box[0].upper()}", subnet, arrival, arrival, "recv", pair, peer)

    def _post(self, kind: str, peer: int, subnet: int, tensor: Tensor, group: Any) -> None:
        now = time.perf_counter()
        _send(peer, subnet, tensor, self.sent, group)
        self._span(f"SEND_{kind}", subnet, now, now, "send", _pair(kind, min(self.rank, peer), subnet,
                                                                  self.num_stages), peer)

    def run(self) -> CspRankResult:
        num_subnets, st = len(self.uses), self.state
        while self.done < num_subnets:
            if self.first:
                limit = self._injection_limit(num_subnets)
                while self.injected < limit and self.injected - self.done < self.lookahead:
                    st.arrived.append(self.injected)
                    self.inputs[self.injected] = self.batch(self.injected)[0]
                    self.injected += 1
                    st.upper = self.injected
            while True:  # take every message that is already here
                try:
                    self._accept(*self.inbox.get_nowait())
                except queue.Empty:
                    break
            self._run_prefetches()
            if st.grads:  # first come, first served, as in the simulator
                self._backward(st.grads[0])
                continue
            unfinished = st.unfinished()
            # Earlier subnets that have not even arrived yet count as unfinished: stage k - 1 may have reordered them.
            candidates = st.arrived if self.memory is None else self.memory.admitted(st.arrived, unfinished)
            pick = csp_pick(self.rank, candidates, unfinished, self.uses)
            if pick is not None:
                self._forward(pick)
            else:  # nothing runnable: sleep until a message comes
                start, by_memory = time.perf_counter(), bool(st.arrived) and not candidates
                self._accept(*_wait(self.inbox, self.timeout_s, self.rank))
                if by_memory:  # none of the arrivals fit beside the pinned layers
                    self.admission_wait_s += time.perf_counter() - start
        self._close()
        return self.result

    def _forward(self, pick: int) -> None:
        if self.before_forward is not None:
            self.before_forward(pick)
        st, memory = self.state, self.memory
        predicted = memory.predict(pick) if self.predict else None  # type: ignore[union-attr]
        st.arrived.remove(pick)
        start = time.perf_counter()
        self.result.decisions.append((start, pick))
        self.forward_start[pick] = start
        if memory is not None:
            memory.start(pick)
            self._switch(memory.demand(pick))
            self.offload.ready(memory.keys(pick))  # type: ignore[union-attr]
            memory.touch(memory.keys(pick))
            self.copy_wait_s += time.perf_counter() - start
            self._request_prefetch(predicted)  # after the demand copy, which goes first on the copy engine
            start = time.perf_counter()
        x = self.inputs.pop(pick)
        if not self.first:
            x.requires_grad_(True)
        self.choose(pick)
        y = self.stage(x)
        if self.last:
            value = self.loss(y, self.batch(pick)[1])
            self.result.losses[pick] = float(value.detach())
            self.saved[pick] = (x, value)
            self.grad_in[pick] = torch.ones((), dtype=value.dtype)
            st.grads.append(pick)
            self._span("F", pick, start)
        else:
            self.saved[pick] = (x, y)
            self._span("F", pick, start)
            self._post("F", self.rank + 1, pick, y.detach(), self.forward_groups[self.rank])

    def _backward(self, subnet: int) -> None:
        start = time.perf_counter()
        x, y = self.saved.pop(subnet)
        self.choose(subnet)
        self.state.grads.remove(subnet)
        grad = self.grad_in.pop(subnet)
        if y.requires_grad:  # else nothing trainable upstream: frozen embedding and an identity candidate
            torch.autograd.backward(y, grad)
        self._span("B", subnet, start)
        if not self.first:
            self._post("B", self.rank - 1, subnet, x.grad, self.backward_groups[self.rank - 1])
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._span("OPT_STEP", subnet, start)
        if self.after_update is not None:
            self.after_update(subnet, self.forward_start[subnet], time.perf_counter())
        self.state.finished.add(subnet)
        self.done += 1
        if self.memory is not None:
            self.memory.finish(subnet)
            if self.predict:
                self._request_prefetch(self.memory.predict(None))
        if self.drain_every and self.done % self.drain_every == 0:
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Every subnet below ``done`` is finished here and none later has started (module docstring): hand the
        state to ``at_drain`` with every parameter in place."""
        assert self.at_drain is not None and not self.state.arrived and not self.saved
        start = time.perf_counter()
        if self.offload is not None:
            with self.offload.whole(self.memory.resident):  # type: ignore[union-attr]
                self.at_drain(self.done, self.result.losses)
        else:
            self.at_drain(self.done, self.result.losses)
        self.result.checkpoint_s.append(time.perf_counter() - start)
        self._span("CHECKPOINT", self.done, start)

    def _switch(self, plan: CopyPlan | None, ahead: bool = False) -> bool:
        """Run a context switch if there is one; ``ahead``: it is a prefetch, not a demand copy."""
        if plan is None:
            return False
        self.offload.copy_in(plan)  # type: ignore[union-attr]
        self.memory.apply(plan)  # type: ignore[union-attr]
        self.ahead += ahead
        return True

    def _request_prefetch(self, predicted: tuple[int, frozenset[int]] | None) -> None:
        if predicted is None:
            return
        if self.offload.cuda:  # type: ignore[union-attr]
            self._switch(self.memory.prefetch(*predicted), ahead=True)  # type: ignore[union-attr]
        else:
            self.prefetches.append(predicted)

    def _run_prefetches(self) -> None:
        """Run the queued CPU prefetches, each re-checked now (its subnet may have started meanwhile)."""
        while self.prefetches:
            self._switch(self.memory.prefetch(*self.prefetches.pop(0)), ahead=True)  # type: ignore[union-attr]

    def _close(self) -> None:
        # Tell each neighbour nothing more comes on the channel to it: gradients to rank - 1, activations to rank + 1.
        rank = self.rank
        for peer, group in ((rank - 1, None if self.first else self.backward_groups[rank - 1]),
                            (rank + 1, None if self.last else self.forward_groups[rank])):
            if group is not None:
                marker = torch.tensor([_END], dtype=torch.int64)
                self.sent.append((dist.isend(marker, dst=peer, group=group), marker))
        for channel in self.channels:
            if channel is not None:
                channel.close(self.timeout_s)
        for work, _ in self.sent:
            work.wait()
        for group in (*self.forward_groups, *self.backward_groups):
            dist.destroy_process_group(group)
        memory, offload = self.memory, self.offload
        if memory is not None and offload is not None:
            offload.close(memory.resident)
            self.result.spans.extend(Span(f"{rank}{kind}{subnet}", kind, rank, stream, start, end, rank, subnet)
                                     for kind, subnet, stream, start, end in offload.spans)
            self.result.copies = {
                "stage": rank, "h2d_bytes": memory.h2d_bytes, "d2h_bytes": memory.d2h_bytes,
                "copy_wait_s": self.copy_wait_s, "admission_wait_s": self.admission_wait_s,
                "peak_resident_bytes": memory.peak, "prefetches": memory.prefetches, "evictions": memory.evictions,
                "prefetches_ahead": self.ahead, "h2d_tensor_bytes": offload.h2d_tensor_bytes,
                "d2h_tensor_bytes": offload.d2h_tensor_bytes}


def _wait(inbox: queue.Queue, timeout_s: float, rank: int) -> tuple[str, int, Any, float]:
    """The next message, blocking (nothing is runnable until one comes); raises a receiver thread's error."""
    try:
        box, subnet, tensor, arrival = inbox.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"rank {rank}: no message for {timeout_s} s while waiting for work") from None
    if box == "error":
        raise tensor
    return box, subnet, tensor, arrival
