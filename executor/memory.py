"""One rank's measured peak tensor memory (bytes), the measured side of the prediction's ``peak_memory_bytes``.

On CUDA the caching allocator keeps the statistics: the peak is ``torch.cuda.max_memory_allocated`` after
``torch.cuda.reset_peak_memory_stats`` at the start of the measured iterations, i.e. the most bytes that live tensors
held at once (the allocator rounds each block up to a multiple of 512 bytes; what it caches beyond that, its reserved
memory, is not counted).

On the CPU torch keeps no statistics, so :class:`StorageCounter` counts at the level of tensor storages, the memory
an allocator hands to tensors:

* **Counted, bytes:** every storage on the device that is alive when counting starts and reachable from Python
  (parameters, buffers, optimizer state, gradients: :func:`live_tensors`), plus the storage of every tensor an
  operator returns while counting, each storage once (a view shares its base's storage and adds nothing; a storage
  an operator grows in place is counted at its new size), minus each storage when it is freed (a weak reference on
  the storage object, which torch keeps alive exactly as long as the storage itself). The peak is the largest total
  reached after any operator.
* **Not counted:** the allocator's own rounding, caching and fragmentation (the CPU allocator asks the C library
  for every tensor, aligned to 64 bytes); Python objects; memory a kernel allocates for itself and frees before it
  returns (e.g. scratch buffers inside attention or matrix-multiply kernels), which never becomes an operator's
  output; the communication library's buffers (gloo's, and anything allocated on its threads); storages that exist
  before counting starts but are held only from C++.

The counter is a ``TorchDispatchMode``: every aten operator of the thread that entered it (the autograd engine runs
a CPU backward on that thread too) passes through :meth:`StorageCounter.__torch_dispatch__`, which costs a few
microseconds per operator. On a 2-core host that made a 2-block GPT stage's forward, backward and Adam step 7-11 %
slower, and a 2-rank 1F1B run's median iteration 12-15 % slower (``experiments.run memory_real``), too much to leave
on while iteration times are measured, so ``executor.run`` counts only with ``--measure-memory`` (on CUDA the
statistics cost nothing and are always read). The torch profiler's memory events
(``profile_memory=True``), the other allocator-level source, cost 18 % on the same step before their events are
even read.
"""

from __future__ import annotations

import gc
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StorageCounter", "PeakMemory", "live_tensors", "CPU_METHOD", "CUDA_METHOD"]

#: How a CPU peak is measured (``compare.json``'s ``memory.method``).
CPU_METHOD = ("StorageCounter (executor.memory): bytes of live tensor storages, each once, counted operator by "
              "operator from the storages alive at the start; no allocator rounding, kernel scratch, Python "
              "objects or communication buffers")
#: How a CUDA peak is measured.
CUDA_METHOD = "torch.cuda.max_memory_allocated after reset_peak_memory_stats at the first measured iteration"


def live_tensors() -> list[Tensor]:
    """Every tensor object Python's garbage collector tracks now (parameters, optimizer state, gradients, ...)."""
    # type() rather than isinstance(): isinstance consults __class__, which some module proxies answer with warnings.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), Tensor)]


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of live tensor storages on one device type while entered (module docstring: what is counted).

    Use::

        counter = StorageCounter()
        counter.track(live_tensors())   # what is alive already
        with counter:
            ...                          # every operator's new storages counted, frees subtracted
        counter.peak_bytes

    A storage may be freed on another thread (a communication thread dropping the last reference): its callback
    only queues the bytes (``deque.append`` is atomic), and the thread that counts subtracts them before it next adds.

    Attributes:
        device_type: the device type whose storages count (``"cpu"``).
        peak_bytes: the most :attr:`live_bytes` has been since it was created or :meth:`reset_peak` was called.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self._live = 0
        self.peak_bytes = 0
        # Storage address (``_cdata``, unique while the storage lives) -> (weak reference, bytes counted).
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._freed_bytes: deque[int] = deque()

    @property
    def live_bytes(self) -> int:
        """Bytes of the storages counted and not yet freed."""
        self._apply_frees()
        return self._live

    def _apply_frees(self) -> None:
        while self._freed_bytes:
            self._live -= self._freed_bytes.popleft()

    def track(self, tensors: Iterable[Tensor]) -> None:
        """Count the storages of ``tensors`` (each once; those of other devices, and storages already counted, are
        skipped), e.g. the parameters and optimizer state alive before counting starts."""
        for tensor in tensors:
            self._note(tensor)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes

    def _freed(self, key: int) -> Any:
        def callback(_ref: weakref.ref) -> None:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self._freed_bytes.append(entry[1])
        return callback

    def _note(self, tensor: Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a sparse or wrapper tensor: no storage of its own
            return
        key, nbytes = storage._cdata, storage.nbytes()
        entry = self._storages.get(key)
        if entry is not None and entry[1] == nbytes:
            return
        self._apply_frees()
        if entry is None:
            self._storages[key] = (weakref.ref(storage, self._freed(key)), nbytes)
            self._live += nbytes
        else:  # resized in place (an out= operator, resize_)
            self._storages[key] = (entry[0], nbytes)
            self._live += nbytes - entry[1]
        if self._live > self.peak_bytes:
            self.peak_bytes = self._live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor):
            self._note(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, Tensor):
                    self._note(item)
                elif isinstance(item, (tuple, list)):  # e.g. a foreach operator's list inside a tuple
                    for inner in item:
                        if isinstance(inner, Tensor):
                            self._note(inner)
        return out


class PeakMemory:
    """A rank's peak tensor memory over its measured iterations, bytes: a context around all iterations.

    Args:
        device: the rank's device.
        count_cpu: on the CPU, count with a :class:`StorageCounter` (``--measure-memory``); without it a CPU rank
            measures nothing. CUDA is always measured (its statistics cost nothing).

    Call :meth:`start_measured` right before the first measured iteration; :attr:`peak_bytes` is then the peak from
    there to the context's end, or ``None`` when nothing was measured.
    """

    def __init__(self, device: torch.device, *, count_cpu: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.counter = StorageCounter(device.type) if count_cpu and not self.cuda else None
        self.peak_bytes: int | None = None
        self._started = False

    @property
    def method(self) -> str | None:
        """How the peak is measured (:data:`CUDA_METHOD`, :data:`CPU_METHOD`), or ``None`` when it is not."""
        return CUDA_METHOD if self.cuda else CPU_METHOD if self.counter is not None else None

    def __enter__(self) -> PeakMemory:
        if self.counter is not None:
            self.counter.track(live_tensors())
            self.counter.__enter__()
        return self

    def start_measured(self) -> None:
        """The measured iterations begin: the peak starts from what is alive now."""
        self._started = True
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.counter is not None:
            self.counter.reset_peak()

    def __exit__(self, *exc: object) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
            if self._started:
                self.peak_bytes = self.counter.peak_bytes
        elif self.cuda and self._started:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
