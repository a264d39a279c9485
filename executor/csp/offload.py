"""The tensors behind CSP context switching: host master copies of every candidate layer, and the copies to and from
the device that :class:`sim.csp.memory.StageMemory` decides on (NASPipe §4.3, "stash the supernet in CPU memory").

Every choice-block candidate of the stage is one layer key ``(block, candidate)``. Its parameters *and* its optimizer
state (Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``; nothing for plain SGD) have a master copy in host memory,
pinned when the device is CUDA. Parameter identity never changes: each key keeps its ``nn.Parameter`` objects, and
only their ``.data`` is swapped between a device tensor (resident) and an empty placeholder (not resident), so the
optimizer, which holds the parameters and keys its state by them, keeps working; its per-parameter state moves in and
out with the parameter. An empty placeholder also makes a forward through a non-resident layer fail loudly instead
of reading stale weights. Copies are exact (``Tensor.copy_``), so training stays bitwise the same as without
offloading.

* CPU: the "device" is host memory too; a copy in is a clone into separate storage and a write-back a
  ``copy_`` into the master, both on the rank's one thread, timed with ``time.perf_counter`` (seconds,
  ``CLOCK_MONOTONIC``, the clock of the rank's other spans).
* A checkpoint (:meth:`whole`) needs every key's values in place at once: for its duration the host masters of the
  keys not resident stand in the parameters and the optimizer, then everything is put back as it was.
* A stage restored from a checkpoint has optimizer state before any key was resident: it becomes the keys' host
  state at construction, as if each key had just been written back.
* CUDA: copies run on one side stream with ``non_blocking=True`` between pinned host memory and the device, after
  the side stream waited for the compute stream (a write-back reads what an update just wrote); :meth:`ready` makes
  the compute stream wait on the event recorded after a key's copy before its forward. Spans come from CUDA events,
  put on the host clock at :meth:`close` against a reference event recorded at a known host time. One side stream
  serves both directions: a context switch writes its victims back before copying in, as in the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from executor.nn.supernet import ChoiceBlock
from sim.csp.memory import CopyPlan

__all__ = ["ParamOffload", "candidate_params"]


def candidate_params(stage: nn.Module) -> dict[tuple[int, int], list[nn.Parameter]]:
    """The trainable parameters of every choice-block candidate of ``stage``, by layer key ``(block, candidate)``
    (the keys of :func:`sim.csp.csp_plan.build_csp_problem`); candidates without parameters map to ``[]``."""
    return {(m.block, k): [p for p in candidate.parameters() if p.requires_grad]
            for m in stage.modules() if isinstance(m, ChoiceBlock) for k, candidate in enumerate(m.candidates)}


class ParamOffload:
    """Moves layer keys' parameters and optimizer state between their host masters and the device.

    Args:
        params: layer key → its parameters (:func:`candidate_params`); every key starts not resident.
        optimizer: the stage's optimizer; its ``state`` entries move with the parameters.
        device: where resident keys live (``cpu`` or a CUDA device).

    Attributes:
        spans: ``(kind, subnet, stream, start s, end s)`` of every copy, kind ``PREFETCH`` (stream ``h2d``) or
            ``EVICT`` (``d2h``); complete after :meth:`close`.
        h2d_tensor_bytes: tensor bytes copied in, parameters and optimizer state (fp32 here, so not the plan's
            bytes, which count the graph's dtype and no optimizer state).
        d2h_tensor_bytes: tensor bytes written back.
    """

    def __init__(self, params: Mapping[Hashable, list[nn.Parameter]], optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.params, self.optimizer, self.device = params, optimizer, device
        self.cuda = device.type == "cuda"
        self.host: dict[nn.Parameter, Tensor] = {}
        self.host_state: dict[nn.Parameter, dict[str, tuple[Tensor, torch.device]]] = {}
        self.ready_events: dict[Hashable, Any] = {}
        self.spans: list[tuple[str, int, str, float, float]] = []
        self._pending: list[tuple[str, int, str, Any, Any]] = []  # CUDA spans as event pairs
        self.h2d_tensor_bytes = self.d2h_tensor_bytes = 0
        if self.cuda:
            self.side = torch.cuda.Stream(device)
            torch.cuda.synchronize(device)
            self._ref_event, self._ref_host = self._event(), time.perf_counter()
        for plist in params.values():
            for p in plist:
                self.host[p] = self._host_copy(p.data)
                p.data = self._placeholder(p)
                for name, value in optimizer.state.pop(p, {}).items():  # a stage restored from a checkpoint
                    # Optimizers keep per-element state beside the parameter and scalar counters (Adam's step, not
                    # "capturable") on the host: the device each is loaded onto when the key becomes resident.
                    where = (device if value.dim() else value.device) if isinstance(value, Tensor) else None
                    self.host_state.setdefault(p, {})[name] = (
                        self._host_copy(value) if isinstance(value, Tensor) else value, where)

    # --- one tensor ------------------------------------------------------------------------------------------------

    def _host_copy(self, tensor: Tensor) -> Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda)
        return host.copy_(tensor)

    def _placeholder(self, p: nn.Parameter) -> Tensor:
        return torch.empty(0, dtype=p.dtype, device=self.device)

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _write_back(self, p: nn.Parameter) -> None:
        """Device → host master for ``p`` and its optimizer state; frees the device copies."""
        self.host[p].copy_(p.data, non_blocking=self.cuda)
        self.d2h_tensor_bytes += p.data.nbytes
        moved = []
        state = self.optimizer.state.pop(p, {})
        saved = self.host_state.setdefault(p, {})
        for name, value in state.items():
            if not isinstance(value, Tensor):  # no such entry in Adam or SGD; kept as a value if one appears
                saved[name] = (value, None)  # type: ignore[assignment]
                continue
            if name not in saved or saved[name][0].shape != value.shape:
                saved[name] = (torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                           pin_memory=self.cuda and value.is_cuda), value.device)
            saved[name][0].copy_(value, non_blocking=self.cuda)
            self.d2h_tensor_bytes += value.nbytes
            moved.append(value)
        if self.cuda:  # the side stream still reads them: the allocator must not hand the memory out before
            for tensor in (p.data, *moved):
                if tensor.is_cuda:
                    tensor.record_stream(self.side)
        p.data = self._placeholder(p)

    def _load(self, p: nn.Parameter) -> None:
        """Host master → a fresh device copy for ``p`` and its optimizer state."""
        p.data = self.host[p].to(self.device, copy=True, non_blocking=self.cuda)
        self.h2d_tensor_bytes += p.data.nbytes
        if p in self.host_state:
            state = {}
            for name, (value, device) in self.host_state[p].items():
                if device is None:
                    state[name] = value
                else:
                    state[name] = value.to(device, copy=True, non_blocking=self.cuda)
                    self.h2d_tensor_bytes += value.nbytes
            self.optimizer.state[p] = state

    @contextmanager
    def whole(self, resident: Iterable[Hashable]) -> Iterator[None]:
        """For the duration, every parameter and its optimizer state hold their current values, resident or not
        (what a checkpoint captures); afterwards the keys are as they were. ``resident``: the keys on the device."""
        if self.cuda:
            torch.cuda.synchronize(self.device)  # updates and write-backs in flight have landed
        on_device = {p for key in resident for p in self.params[key]}
        swapped: list[tuple[nn.Parameter, Tensor]] = []
        for p, host in self.host.items():
            if p in on_device:
                continue  # its data and optimizer state are the current ones
            swapped.append((p, p.data))
            p.data = host
            if p in self.host_state:
                self.optimizer.state[p] = {name: value for name, (value, _) in self.host_state[p].items()}
        try:
            yield
        finally:
            for p, placeholder in swapped:
                p.data = placeholder
                self.optimizer.state.pop(p, None)

    # --- context switches ------------------------------------------------------------------------------------------

    def copy_in(self, plan: CopyPlan) -> None:
        """Run ``plan``: write its victims back (span ``EVICT``), then copy its missing keys in (``PREFETCH``)."""
        if not self.cuda:
            if plan.victims:
                start = time.perf_counter()
                for key in plan.victims:
                    for p in self.params[key]:
                        self._write_back(p)
                self.spans.append(("EVICT", plan.subnet, "d2h", start, time.perf_counter()))
            start = time.perf_counter()
            for key in plan.missing:
                for p in self.params[key]:
                    self._load(p)
            self.spans.append(("PREFETCH", plan.subnet, "h2d", start, time.perf_counter()))
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # updates before write-backs
        with torch.cuda.stream(self.side):
            begin = self._event()
            if plan.victims:
                for key in plan.victims:
                    for p in self.params[key]:
                        self._write_back(p)
                    self.ready_events.pop(key, None)
                middle = self._event()
                self._pending.append(("EVICT", plan.subnet, "d2h", begin, middle))
                begin = middle
            for key in plan.missing:
                for p in self.params[key]:
                    self._load(p)
            end = self._event()
            self._pending.append(("PREFETCH", plan.subnet, "h2d", begin, end))
            for key in plan.missing:
                self.ready_events[key] = end

    def ready(self, keys: Iterable[Hashable]) -> None:
        """Before a forward over ``keys``: on CUDA, order the compute stream after their copies (no host wait)."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for key in keys:
            event = self.ready_events.pop(key, None)
            if event is None:
                continue
            compute.wait_event(event)
            for p in self.params[key]:  # allocated on the side stream, now used and freed on the compute stream
                p.data.record_stream(compute)
                for value in self.optimizer.state.get(p, {}).values():
                    if isinstance(value, Tensor) and value.is_cuda:
                        value.record_stream(compute)

    def close(self, resident: Iterable[Hashable]) -> None:
        """End of run: write the ``resident`` keys back (not counted as evictions), put every parameter's host
        master back in place so the module holds the final weights, and finish the spans."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for key in resident:
            for p in self.params[key]:
                self.host[p].copy_(p.data)
                for name, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, Tensor):
                        self.host_state.setdefault(p, {})[name] = (value.detach().cpu().clone(), value.device)
        for p, host in self.host.items():
            p.data = host
        for p, saved in self.host_state.items():
            self.optimizer.state[p] = {name: value for name, (value, _) in saved.items()}
        for kind, subnet, stream, begin, end in self._pending:
            self.spans.append((kind, subnet, stream, self._host_time(begin), self._host_time(end)))
        self._pending.clear()

    def _host_time(self, event: Any) -> float:
        return self._ref_host + self._ref_event.elapsed_time(event) / 1e3  # elapsed_time is in ms
