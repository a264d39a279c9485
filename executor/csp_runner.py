"""NASPipe's causal synchronous parallel (CSP) training, run online on each rank (issue #5, DESIGN §3).

CSP cannot be a fixed program: which subnet a stage runs next depends on what has finished. Each rank therefore
runs a small event loop instead of the L1 interpreter:

* Subnets enter stage 0 in chronological order, at most ``lookahead`` in flight. A stage keeps ``arrived`` (subnets
  whose forward input is here, in arrival order) and ``finished`` (backward + update done here); every id below the
  highest arrived one that is not finished counts as unfinished, arrived or not (``sim.csp.wait_list``). It runs,
  in this priority: a backward whose output gradient has arrived (it frees layers for later subnets and its
  gradient unblocks the previous stage; NASPipe's loop runs backward as soon as a gradient arrives, schedules.md
  §7), else the forward that :func:`sim.csp.csp_pick` chooses, else it waits for a message.
* After a subnet's backward on a stage comes its weight update on that stage, on the layers it used only (an
  optimizer over the stage skips parameters without gradients). The update happens before any later subnet that
  shares a layer may run its forward there, which is what makes the result independent of timing (NASPipe §3.2).
* Messages between stages carry a header (the subnet id) because the receiver cannot know the order in which its
  neighbour will run subnets; every channel has one outstanding header receive that the loop polls.

Shared layers. The embedding and the head are used by every subnet; if they were trained, CSP would have to
serialise the first and last stage completely (every subnet conflicts with every earlier one there). Like a NAS
supernet whose search space is the choice blocks, they are frozen here (``requires_grad=False``), in the pipeline and
in the sequential reference alike.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sim.csp import csp_pick, wait_list

__all__ = ["CspRankResult", "run_csp_rank", "train_subnets_sequentially"]

_END = -1  # header of the end marker each rank sends its neighbours when it is done


@dataclass
class CspRankResult:
    """What one rank did.

    Attributes:
        losses: subnet → its loss (last stage only).
        decisions: ``(time s, subnet)`` of every forward this rank started, in order.
        records: ``(op id, start s, end s)`` of every op, on this rank's clock.
    """

    losses: dict[int, float] = field(default_factory=dict)
    decisions: list[tuple[float, int]] = field(default_factory=list)
    records: list[tuple[str, float, float]] = field(default_factory=list)


class _Channel:
    """One directed neighbour link, read by a thread: a header (subnet id) then a payload of known shape.

    A thread per incoming channel does blocking receives and puts ``(box, subnet, tensor)`` on the rank's inbox, so
    the loop can wait for "whichever message comes first" without spinning (gloo's receive handles only learn they
    completed inside ``wait``, so they cannot be polled). The thread ends at the neighbour's end marker.
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
                self.inbox.put((self.box, subnet, payload))
        except Exception as exc:  # noqa: BLE001 - handed to the loop, which raises it on the rank's thread
            self.inbox.put(("error", -1, exc))

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


def run_csp_rank(*, rank: int, num_stages: int, stage: nn.Module, uses: Sequence[Sequence[frozenset]],
                 choose: Callable[[int], None], optimizer: torch.optim.Optimizer,
                 batch: Callable[[int], tuple[Tensor, Tensor]], loss: Callable[[Tensor, Tensor], Tensor],
                 boundary_shape: tuple[int, ...], lookahead: int, timeout_s: float = 120.0) -> CspRankResult:
    """Train every subnet of ``uses`` through this rank's stage with CSP; returns what this rank did.

    Args:
        rank: this rank = its stage index.
        num_stages: ranks in the pipeline.
        stage: this stage's module (trainable parameters: the choice blocks).
        uses: ``uses[subnet][stage]`` = the layer keys the subnet uses on each stage (``sim.csp``'s table).
        choose: ``subnet -> None``, selects the subnet's candidates in ``stage`` (``set_subnet``).
        optimizer: over the stage's trainable parameters; stepped after each subnet's backward.
        batch: ``subnet -> (inputs, targets)`` of its minibatch (used by the first and last stage).
        loss: ``(output, targets) -> scalar``.
        boundary_shape: shape of the activation between stages (the same for every subnet).
        lookahead: at most this many subnets in flight from stage 0.
        timeout_s: how long to wait for a message before giving up with an error, s.
    """
    first, last = rank == 0, rank == num_stages - 1
    num_subnets = len(uses)
    inbox: queue.Queue = queue.Queue()
    # One process group per direction of each neighbour link, so that every group is used by one thread per process
    # (a receiver thread or the loop): gloo's pairs are not meant to be driven from two threads at once, and doing
    # so aborted runs now and then. new_group is collective, so every rank creates every group, in one order.
    forward_groups, backward_groups = [], []
    for k in range(num_stages - 1):
        forward_groups.append(dist.new_group([k, k + 1]))  # activations k -> k + 1
        backward_groups.append(dist.new_group([k, k + 1]))  # gradients k + 1 -> k
    forward_in = None if first else _Channel("forward", rank - 1, boundary_shape, inbox, forward_groups[rank - 1])
    backward_in = None if last else _Channel("backward", rank + 1, boundary_shape, inbox, backward_groups[rank])
    result = CspRankResult()
    arrived: list[int] = []
    inputs: dict[int, Tensor] = {}
    grads: dict[int, Tensor] = {}
    saved: dict[int, tuple[Tensor, Tensor]] = {}
    finished: set[int] = set()  # backward and update done on this stage
    seen_upper = 0  # one more than the highest subnet id that has arrived here (NASPipe's wait_upper)
    def accept(box: str, subnet: int, tensor: Any) -> None:
        nonlocal seen_upper
        if box == "error":
            raise tensor
        if box == "forward":
            arrived.append(subnet)
            inputs[subnet] = tensor
            seen_upper = max(seen_upper, subnet + 1)
        else:
            grads[subnet] = tensor

    sent: list[tuple[Any, Tensor]] = []  # (work, tensor kept alive until the send completes)
    done, injected = 0, 0
    while done < num_subnets:
        if first:
            while injected < num_subnets and injected - done < lookahead:
                arrived.append(injected)
                inputs[injected] = batch(injected)[0]
                injected += 1
                seen_upper = injected
        while True:  # take every message that is already here
            try:
                accept(*inbox.get_nowait())
            except queue.Empty:
                break
        ready = sorted(s for s in grads if s in saved)
        if ready:
            subnet = ready[0]
            start = time.perf_counter()
            x, y = saved.pop(subnet)
            choose(subnet)
            grad = grads.pop(subnet)
            if y.requires_grad:  # else nothing trainable upstream: frozen embedding and an identity candidate
                torch.autograd.backward(y, grad)
            if not first:
                _send(rank - 1, subnet, x.grad, sent, backward_groups[rank - 1])
            result.records.append((f"{rank}B{subnet}", start, time.perf_counter()))
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.records.append((f"{rank}OPT_STEP{subnet}", start, time.perf_counter()))
            finished.add(subnet)
            done += 1
            continue
        # Earlier subnets that have not even arrived yet count as unfinished: stage k - 1 may have reordered them.
        pick = csp_pick(rank, arrived, wait_list(seen_upper, finished), uses)
        if pick is None:
            accept(*_wait(inbox, timeout_s, rank))  # nothing runnable: sleep until a message comes
            continue
        arrived.remove(pick)
        start = time.perf_counter()
        result.decisions.append((start, pick))
        x = inputs.pop(pick)
        if not first:
            x.requires_grad_(True)
        choose(pick)
        y = stage(x)
        if last:
            value = loss(y, batch(pick)[1])
            result.losses[pick] = float(value.detach())
            saved[pick] = (x, value)
            grads[pick] = torch.ones((), dtype=value.dtype)
        else:
            saved[pick] = (x, y)
            _send(rank + 1, pick, y.detach(), sent, forward_groups[rank])
        result.records.append((f"{rank}F{pick}", start, time.perf_counter()))
    # Tell each neighbour nothing more comes on the channel to it: gradients to rank - 1, activations to rank + 1.
    for peer, group in ((rank - 1, backward_groups[rank - 1] if not first else None),
                        (rank + 1, forward_groups[rank] if not last else None)):
        if group is not None:
            marker = torch.tensor([_END], dtype=torch.int64)
            sent.append((dist.isend(marker, dst=peer, group=group), marker))
    for channel in (forward_in, backward_in):
        if channel is not None:
            channel.close(timeout_s)
    for work, _ in sent:
        work.wait()
    for group in (*forward_groups, *backward_groups):
        dist.destroy_process_group(group)
    return result


def _wait(inbox: queue.Queue, timeout_s: float, rank: int) -> tuple[str, int, Any]:
    """The next message, blocking (nothing is runnable until one comes); raises a receiver thread's error."""
    try:
        box, subnet, tensor = inbox.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"rank {rank}: no message for {timeout_s} s while waiting for work") from None
    if box == "error":
        raise tensor
    return box, subnet, tensor


def train_subnets_sequentially(stage: nn.Module, num_subnets: int, choose: Callable[[int], None],
                               optimizer: torch.optim.Optimizer, batch: Callable[[int], tuple[Tensor, Tensor]],
                               loss: Callable[[Tensor, Tensor], Tensor]) -> dict[int, float]:
    """The oracle: the same subnets one by one in one process, each updating the layers it used; their losses."""
    losses = {}
    for subnet in range(num_subnets):
        inputs, targets = batch(subnet)
        choose(subnet)
        value = loss(stage(inputs), targets)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[subnet] = float(value.detach())
    return losses


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters CSP trains (the choice blocks; frozen shared layers excluded)."""
    return [p for p in module.parameters() if p.requires_grad]


def freeze_shared(module: nn.Module, shared_names: Sequence[str]) -> None:
    """Freeze the layers every subnet uses (embedding, head), by submodule name prefix."""
    for name, param in module.named_parameters():
        if any(name.startswith(prefix) for prefix in shared_names):
            param.requires_grad_(False)
