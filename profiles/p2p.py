"""Point-to-point time between two processes: a ping-pong measurement and its latency/bandwidth fit.

Two spawned processes form a two-rank process group (gloo on CPU, NCCL on two CUDA devices) that rendezvous through
a file in a fresh temporary directory, so no TCP port has to be found free. Rank 0 sends a buffer to rank 1, which
sends it straight back (:func:`executor.pingpong.round_trip_times`, the executor's own timer, which synchronises
CUDA around each trip); every round visits each message size once, and the one-way time of a size is half its
median round trip. The simulator's link model is ``time = latency + bytes / bandwidth`` (α-β, Hockney 1994), which
:func:`sim.cost.p2p_fit.fit_latency_bandwidth` fits to the measured points.

The parent never waits on a child unboundedly: the process group has a timeout, the parent polls for the result
with a deadline and notices a child that died, and any child still alive at the end is terminated, then killed.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from sim.core.errors import SpecError

__all__ = ["PingPong", "P2PError", "P2PChoice", "choose_p2p", "ping_pong", "power_of_two_sizes"]


@dataclass(frozen=True)
class PingPong:
    """Measured one-way times of a ping-pong.

    Attributes:
        backend: ``"gloo"`` or ``"nccl"``.
        sizes_bytes: message sizes in bytes, ascending.
        one_way_s: one-way time of each size in s: its median round trip / 2 (what the fit uses).
        one_way_min_s: one-way time of each size in s from its fastest round trip, kept so that a profile measured
            on a noisy host can be judged (and refitted) later.
    """

    backend: str
    sizes_bytes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    one_way_min_s: tuple[float, ...]


@dataclass(frozen=True)
class P2PChoice:
    """Which ping-pong the profiler runs for the device it profiles, or that it runs none.

    Attributes:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` when nothing is measured.
        device: where the messages live: ``"cpu"`` (host memory, between two CPU processes, for a cpu profile) or
            ``"cuda"`` (GPU to GPU, for a cuda profile); ``None`` when nothing is measured.
        note: one line for the profile's ``method.p2p``: what is measured and why.
    """

    backend: str | None
    device: str | None
    note: str


def choose_p2p(device_type: str, gpu_count: int) -> P2PChoice:
    """The point-to-point measurement for a profile of ``device_type`` on a host with ``gpu_count`` CUDA devices.

    * ``cpu``: gloo between two CPU processes, whatever GPUs the host has (the executor's CPU ranks use gloo).
    * ``cuda`` with two or more GPUs: NCCL between ``cuda:0`` and ``cuda:1``, as the executor's ranks talk.
    * ``cuda`` with one GPU: nothing. NCCL needs a GPU per rank, and a loopback between CPU processes would measure
      the host, not a GPU link, so ``sim.cost.profile`` would discard it for a cuda profile anyway.
    * ``cuda`` with no GPU: nothing (the profiler rejects ``--device cuda`` there before it gets this far).

    Raises:
        ValueError: ``device_type`` is not ``"cpu"`` or ``"cuda"``, or ``gpu_count`` is negative.
    """
    if gpu_count < 0:
        raise ValueError(f"gpu_count must be >= 0, got {gpu_count}")
    if device_type == "cpu":
        return P2PChoice("gloo", "cpu", "gloo ping-pong between two CPU processes")
    if device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if gpu_count >= 2:
        return P2PChoice("nccl", "cuda", "nccl ping-pong between two processes on cuda:0 and cuda:1")
    if gpu_count == 1:
        return P2PChoice(None, None, "skipped: NCCL p2p needs 2 CUDA devices, this host has 1")
    return P2PChoice(None, None, "skipped: no CUDA device")


class P2PError(RuntimeError):
    """The ping-pong could not run (a child failed, died or timed out); the message says which and why."""


def power_of_two_sizes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """Message sizes ``min_bytes, 2 min_bytes, 4 min_bytes, ...`` up to and including at most ``max_bytes``.

    Raises:
        SpecError: ``min_bytes`` < 1, or fewer than two sizes fit (a line needs two distinct points).
    """
    if min_bytes < 1:
        raise SpecError(f"p2p message sizes must be at least 1 byte, got a minimum of {min_bytes}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    if len(sizes) < 2:
        raise SpecError(f"p2p needs at least two message sizes to fit latency and bandwidth; [{min_bytes}, "
                        f"{max_bytes}] bytes holds {len(sizes)} (raise the maximum to >= {2 * min_bytes})")
    return tuple(sizes)


def _rank_main(rank: int, init_file: str, backend: str, sizes: tuple[int, ...], warmup: int, repeats: int,
               timeout_s: float, results: queue.Queue) -> None:
    """One rank of the ping-pong; rank 0 puts ``("ok", (medians, minima))`` or either rank ``("error", text)``."""
    try:
        import torch
        import torch.distributed as dist

        from executor.pingpong import round_trip_times  # imports torch, which only the spawned children need

        torch.set_num_threads(1)  # the two ranks share the host's cores; neither needs intra-op threads to copy
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s))
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        rounds = round_trip_times(buffers, 1 - rank, initiate=rank == 0, warmup=warmup, repeats=repeats)
        one_way = ([float(np.median(times)) / 2 for times in rounds], [min(times) / 2 for times in rounds])
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", one_way))
    except BaseException as exc:  # report anything, so the parent fails fast with the cause instead of timing out
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def ping_pong(sizes_bytes: Sequence[int], *, warmup: int, repeats: int, backend: str = "gloo",
              timeout_s: float = 120.0) -> PingPong:
    """Ping-pong ``sizes_bytes`` between two spawned processes; fit the result with :func:`fit_latency_bandwidth`.

    Args:
        sizes_bytes: message sizes in bytes.
        warmup: untimed rounds (connection setup, allocator and cache warm-up).
        repeats: timed rounds, >= 1; each round sends every size once.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (rank r on ``cuda:r``; needs two CUDA devices).
        timeout_s: limit in s on the measurement after start-up, and the process group's own timeout.

    Raises:
        P2PError: a rank failed or died, or no result came within ``timeout_s`` (plus a minute for start-up).
    """
    import torch.multiprocessing as mp

    sizes = tuple(sorted(int(s) for s in sizes_bytes))
    ctx = mp.get_context("spawn")  # fork would copy the parent's torch threads and CUDA state into the children
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pipedejavu-p2p-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(rank, init_file, backend, sizes, warmup, repeats, timeout_s, results))
                 for rank in range(2)]
        for proc in procs:
            proc.start()
        try:
            status, payload = _wait_for_result(procs, results, timeout_s)
        finally:
            _stop(procs)
    if status != "ok":
        raise P2PError(f"p2p ping-pong ({backend}) failed: {payload}")
    medians, minima = payload  # type: ignore[misc]
    return PingPong(backend, sizes, tuple(medians), tuple(minima))


def _wait_for_result(procs: list, results: queue.Queue, timeout_s: float) -> tuple[str, object]:
    """Rank 0's result or the first error, polling so that a child that died without reporting is noticed."""
    deadline = time.monotonic() + timeout_s + 60.0  # the children also import torch and rendezvous first
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            try:  # its error report may have landed just before it exited
                return results.get(timeout=1.0)
            except queue.Empty:
                return "error", f"a rank exited with status {dead[0].exitcode} without reporting"
    return "error", f"no result within {timeout_s + 60.0:.0f} s"


def _stop(procs: list) -> None:
    """Join the children briefly, then terminate and finally kill any that are still running."""
    for proc in procs:
        proc.join(timeout=10.0)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
