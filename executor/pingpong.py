"""The one ping-pong timer: round trips of a tensor between two ranks, timed on this rank's ``time.perf_counter``.

Three measurements rest on it: the executor's point-to-point sweep for a calibrated profile
(``executor.rank_process.p2p_sweep``), the profiler's ping-pong between two spawned processes (``profiles.p2p``),
and the clock offsets of ranks on other hosts (``executor.clock``, Cristian's algorithm, which also needs the peer's
clock reading at the moment the message arrived: :func:`round_trip`'s ``on_arrival`` hook).

One side *initiates* (sends, then receives the message back); the other *answers* (receives, then sends it back).
On a CUDA tensor the collectives of NCCL only enqueue work on a stream, so a round trip is bracketed by
``torch.cuda.synchronize``: once before the start reading (nothing queued earlier is counted) and once before the
end reading (the trip has really finished). The answering side also synchronises before ``on_arrival``, so that a
clock read there is read when the message has arrived, not when its receive was enqueued. CPU tensors (gloo) need
none of this: their send and receive return when done. :func:`synchronizer` makes that decision, in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["synchronizer", "round_trip", "round_trip_times"]

#: A function that waits for the queued work of the message's device; ``None`` when there is none to wait for.
Synchronize = Callable[[], None] | None


def synchronizer(device: torch.device, *, cuda_synchronize: Callable[[torch.device], None] | None = None
                 ) -> Synchronize:
    """The wait that brackets a round trip of a tensor on ``device``: CUDA's synchronize on a CUDA device, else none.

    Args:
        device: the message tensor's device.
        cuda_synchronize: the CUDA wait (default ``torch.cuda.synchronize``); a test passes a fake one, since the
            decision must hold on a machine without a GPU too.
    """
    if device.type != "cuda":
        return None
    wait = cuda_synchronize or torch.cuda.synchronize
    return lambda: wait(device)


def round_trip(message: torch.Tensor, peer: int, *, initiate: bool, group=None,
               on_arrival: Callable[[torch.Tensor], None] | None = None,
               synchronize: Synchronize = None) -> tuple[float, float]:
    """One round trip of ``message`` with rank ``peer``, in place: ``(start, end)`` on this rank's
    ``time.perf_counter``, s.

    Args:
        message: the tensor sent and received (overwritten by what comes back).
        peer: the other rank (global rank, as ``torch.distributed.send`` takes it).
        initiate: this rank sends first and receives the answer; otherwise it receives and answers.
        group: the process group (default: the world).
        on_arrival: on the answering side, called with the received message before it is sent back (the clock
            writes its reading into it); ignored on the initiating side.
        synchronize: the device wait around the trip; by default :func:`synchronizer` decides from
            ``message.device``.
    """
    wait = synchronize or synchronizer(message.device)
    if wait is not None:
        wait()
    start = time.perf_counter()
    if initiate:
        dist.send(message, dst=peer, group=group)
        dist.recv(message, src=peer, group=group)
    else:
        dist.recv(message, src=peer, group=group)
        if on_arrival is not None:
            if wait is not None:
                wait()
            on_arrival(message)
        dist.send(message, dst=peer, group=group)
    if wait is not None:
        wait()
    return start, time.perf_counter()


def round_trip_times(messages: Sequence[torch.Tensor], peer: int, *, initiate: bool, warmup: int, repeats: int,
                     group=None) -> list[list[float]]:
    """Round trips of each message with ``peer``: ``repeats`` timed rounds after ``warmup`` untimed ones.

    Messages are interleaved (every round sends each message once) rather than timed one after another, so that a
    stretch of slow scheduling on a shared host slows all sizes alike instead of bending a latency/bandwidth line
    by slowing only the sizes that happened to be running then. Both ranks must call it with the same shapes.

    Returns:
        Per message, its ``repeats`` round-trip times in s, in the order measured (on either side).

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    times: list[list[float]] = [[] for _ in messages]
    for k in range(warmup + repeats):
        for message, trips in zip(messages, times):
            start, end = round_trip(message, peer, initiate=initiate, group=group)
            if k >= warmup:
                trips.append(end - start)
    return times
