"""What a checkpoint costs: its bytes from the model, the copy to host memory over each device's host link, and the
write to storage.

A training checkpoint holds the persistent state, weights and optimizer state (not the gradients, which the next
step makes afresh), each element once: a distributed checkpoint (Megatron-Core's ``dist_checkpointing``, PyTorch's
DCP) has every device write a disjoint share, replicas splitting what they hold alike. So its size is the whole
model's persistent state (:func:`sim.cost.memory_sizes.persistent_bytes_per_param`: 2 + 4 + 8 = 14 bytes a parameter
for bf16 with an fp32 master copy and Adam), a 1/N share per device of N.

* **Snapshot**: every device copies its share to its host's memory over its host link, all at once (the slowest
  device's time: :func:`snapshot_seconds`).
* **Persist**: the host memories write the checkpoint to storage at the storage's aggregate bandwidth
  (``--storage-bandwidth``). By default it grows with the job, at Llama 3's share per GPU: the Tectonic file system
  that its 16,384 GPUs checkpointed to sustained 2 TB/s (arXiv 2407.21783 §3.3.1, which also reports 1 MB to 4 GB per
  GPU per checkpoint), 122 MB/s a GPU (:data:`STORAGE_BANDWIDTH_PER_DEVICE`).
* A **synchronous** checkpoint stalls training for both; an **asynchronous** one (``--async-checkpoint``; Megatron's
  ``--async-save``, PyTorch DCP's ``async_save``) only for the snapshot, the persist running behind the next
  iterations: the checkpoint is durable only once it ends, and the next snapshot waits for it
  (``sim.faults.long_run``).
* A **restart reads** the checkpoint back, from storage and over the host links, the same bytes the other way
  [assumed: reading at the write bandwidths].

Bytes in bytes, bandwidths in bytes/s, times in s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.cost.memory_sizes import persistent_bytes_per_param
from sim.hw.topology import Topology, message_time
from sim.models.graph import LayerGraph

__all__ = ["CheckpointCost", "checkpoint_bytes", "snapshot_seconds", "checkpoint_cost",
           "STORAGE_BANDWIDTH_PER_DEVICE"]

#: Storage write bandwidth per device of the job when none is given (bytes/s): Tectonic's sustained 2 TB/s over
#: Llama 3's 16,384 GPUs (module docstring).
STORAGE_BANDWIDTH_PER_DEVICE = 2e12 / 16_384


@dataclass(frozen=True)
class CheckpointCost:
    """The times of one checkpoint (module docstring).

    Attributes:
        nbytes: the checkpoint's size (bytes).
        blocking_s: how long training stalls for it (s).
        persist_s: after the stall, until it is durable (s; 0 for a synchronous checkpoint).
        load_s: reading it back at a restart (s).
        storage_bandwidth: the aggregate storage bandwidth it was written at (bytes/s).
    """

    nbytes: int
    blocking_s: float
    persist_s: float
    load_s: float
    storage_bandwidth: float = math.inf


def checkpoint_bytes(graph: LayerGraph) -> int:
    """The persistent training state of the whole model ``graph`` (unsharded; bytes)."""
    return math.ceil(graph.total_params * persistent_bytes_per_param(graph.dtype_bytes))


def snapshot_seconds(topology: Topology, share_bytes: float) -> float:
    """Seconds for every device to copy ``share_bytes`` to its host memory at once: the slowest host link's."""
    slowest, seen = 0.0, set()
    for rank, device in enumerate(topology.devices):
        if device.name in seen:  # the same device in the same kind of server: the same link
            continue
        seen.add(device.name)
        slowest = max(slowest, message_time(topology.device_to_host_path(rank), share_bytes))
    return slowest


def checkpoint_cost(graph: LayerGraph, topology: Topology, *, storage_bandwidth: float | None = None,
                    asynchronous: bool = False) -> CheckpointCost:
    """The cost of checkpointing ``graph``'s training on every device of ``topology`` (module docstring), with an
    aggregate ``storage_bandwidth`` (bytes/s; ``None``: :data:`STORAGE_BANDWIDTH_PER_DEVICE` per device).

    Raises:
        ValueError: a storage bandwidth that is not a finite number > 0.
    """
    if storage_bandwidth is None:
        storage_bandwidth = STORAGE_BANDWIDTH_PER_DEVICE * topology.num_ranks
    if not math.isfinite(storage_bandwidth) or storage_bandwidth <= 0:
        raise ValueError(f"storage bandwidth must be a finite number of bytes/s > 0, got {storage_bandwidth!r}")
    nbytes = checkpoint_bytes(graph)
    snapshot = snapshot_seconds(topology, nbytes / topology.num_ranks)
    persist = nbytes / storage_bandwidth
    if asynchronous:
        return CheckpointCost(nbytes, snapshot, persist, snapshot + persist, storage_bandwidth)
    return CheckpointCost(nbytes, snapshot + persist, 0.0, snapshot + persist, storage_bandwidth)
