"""A common clock for the ranks' spans: each rank's offset to rank 0's ``time.perf_counter``.

Ranks time their ops with their own monotonic clock. On one Linux host every process reads the same
``CLOCK_MONOTONIC``, but across hosts the clocks have unrelated origins, and a measured trace needs all spans on one
time axis to show the pipeline (and to measure an iteration as "first op starts → last op ends" over all ranks).

The estimate is Cristian's algorithm (Cristian 1989, "Probabilistic clock synchronization"), the one-step form of
NTP's offset estimate: rank 0 sends at t0, rank r answers with its clock reading t_r, rank 0 receives at t1; if the
two legs take equally long, rank r read its clock at rank 0's (t0 + t1) / 2, so ``offset = (t0 + t1) / 2 − t_r``
and the error is at most half the round trip (one exchange is one :func:`executor.pingpong.round_trip`, whose
hook writes rank r's reading into the answer). Of several exchanges the one with the shortest round trip is kept,
because queueing delay only ever adds to a leg. The offset is measured once per run, after the process group is up;
drift over a run of seconds is far below the microseconds that the round trip already admits.

Ranks on rank 0's own host need no estimate: on Linux ``time.perf_counter`` reads ``CLOCK_MONOTONIC``, one clock for
every process of the machine, so their offset is exactly 0. That matters in practice: on a busy 2-core machine a
gloo round trip can take milliseconds (the reply waits for a free core), and an estimate would then be off by as
much, where the truth is known.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.pingpong import round_trip

__all__ = ["ClockOffset", "offset_from_exchanges", "measure_offsets", "shares_host_clock"]


@dataclass(frozen=True)
class ClockOffset:
    """How to put one rank's clock readings on rank 0's clock: ``t_rank0 = t_rank + offset_s``.

    Attributes:
        offset_s: the estimated offset, s.
        uncertainty_s: half the shortest round trip, s; the true offset lies within ``offset_s ± uncertainty_s``
            when the two legs of that exchange are the only delay.
    """

    offset_s: float
    uncertainty_s: float


def offset_from_exchanges(exchanges: Sequence[tuple[float, float, float]]) -> ClockOffset:
    """The offset from ``(t0, t_r, t1)`` exchanges: rank 0 sent at t0, the rank read t_r, rank 0 got it back at t1.

    Raises:
        ValueError: no exchanges, or one where t1 < t0.
    """
    if not exchanges:
        raise ValueError("need at least one clock exchange")
    for t0, _, t1 in exchanges:
        if t1 < t0:
            raise ValueError(f"exchange ends before it starts (t0={t0}, t1={t1})")
    t0, t_r, t1 = min(exchanges, key=lambda e: e[2] - e[0])
    return ClockOffset((t0 + t1) / 2 - t_r, (t1 - t0) / 2)


def shares_host_clock(host_a: str, host_b: str) -> bool:
    """Whether two processes on these hosts read the same ``perf_counter`` clock (same host, Linux monotonic)."""
    monotonic = time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    return host_a == host_b and monotonic and sys.platform.startswith("linux")


def measure_offsets(rank: int, world_size: int, *, rounds: int = 32, device: torch.device | None = None,
                    group=None) -> list[ClockOffset]:
    """Each rank's offset to rank 0's clock; collective over the group.

    Ranks on rank 0's host get exactly 0 (:func:`shares_host_clock`); every other rank exchanges ``rounds`` clock
    readings with rank 0 and keeps the shortest round trip.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        rounds: exchanges per remote rank.
        device: where the message tensors live (CUDA for NCCL).

    Returns:
        On rank 0, the offset of every rank (rank 0's own is exactly 0). On other ranks, an empty list.
    """
    device = device or torch.device("cpu")
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    message = torch.zeros(1, dtype=torch.float64, device=device)
    offsets = [ClockOffset(0.0, 0.0)]
    for other in range(1, world_size):
        if shares_host_clock(hosts[0], hosts[other]):
            offsets.append(ClockOffset(0.0, 0.0))
            continue
        exchanges = []
        for _ in range(rounds):
            if rank == 0:
                t0, t1 = round_trip(message, other, initiate=True, group=group)
                exchanges.append((t0, float(message.item()), t1))
            elif rank == other:
                # round_trip synchronises CUDA before the hook, so the clock is read when the message has arrived,
                # not when its receive was enqueued.
                round_trip(message, 0, initiate=False, group=group,
                           on_arrival=lambda m: m.fill_(time.perf_counter()))
        if rank == 0:
            offsets.append(offset_from_exchanges(exchanges))
    return offsets if rank == 0 else []
