"""A data-parallel reduction or gather run bucket by bucket: how large the frameworks make a bucket, what the
buckets of an op cost, and what a forward cannot hide of a gather run ahead of it.

An overlapped gradient reduction (``--grad-overlap``) streams its buckets behind the backward that makes them
(:mod:`sim.engine.comm`); an overlapped parameter gather (``--param-gather-overlap``) runs ahead of the forward that
uses them (:mod:`sim.plan.lower_collectives`). Both are cut into the same buckets, as Megatron-Core's parameter and
gradient buffer cuts them, and each bucket is one collective over every group of the op at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.cost.oracle import CostOracle
from sim.ir.parallel import Parallelism

__all__ = ["GRADIENT_BUCKET_BYTES", "MEGATRON_BUCKET_PARAMS", "MEGATRON_BUCKET_PARAMS_PER_RANK", "bucket_bytes",
           "bucketed", "exposed_gather_s"]

#: Gradient bytes per bucket when the data-parallel reduction overlaps the backward without ZeRO: PyTorch DDP's
#: default ``bucket_cap_mb=25`` (torch.nn.parallel.DistributedDataParallel documentation), 25 MiB.
GRADIENT_BUCKET_BYTES = 25 * 2**20

#: Parameters per gradient bucket under ZeRO-1 (Megatron-Core's distributed optimizer) with ``bucket_size`` unset:
#: ``max(40_000_000, 1_000_000 × the data-parallel group's size)`` (megatron/core/distributed/
#: distributed_data_parallel.py: "make buckets larger to ensure that chunks used in NCCL ring-reduce implementations
#: are large enough to remain bandwidth-bound rather than latency-bound"), over the data- and context-parallel
#: group as its recent versions count it.
MEGATRON_BUCKET_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_RANK = 1_000_000


def bucket_bytes(layout: Parallelism, dtype_bytes: int) -> int:
    """Bytes of one bucket: the plan's own size when it names one (``grad_bucket_params``, Megatron's
    ``--ddp-bucket-size``, parameters of ``dtype_bytes`` bytes); else as the framework whose optimizer the plan names
    buckets them: PyTorch DDP's 25 MiB without
    ZeRO (:data:`GRADIENT_BUCKET_BYTES`); under ZeRO-1, Megatron-Core's distributed optimizer,
    :data:`MEGATRON_BUCKET_PARAMS` or :data:`MEGATRON_BUCKET_PARAMS_PER_RANK` per member of the data-parallel group,
    whichever is more, of parameters of ``dtype_bytes`` bytes. Small buckets cost a collective's latency each, which
    at hundreds of replicas outweighs the bytes: 25 MiB buckets over 128 replicas made an overlapped reduction slower
    than one after the backward."""
    if layout.grad_bucket_params:
        return layout.grad_bucket_params * dtype_bytes
    if not layout.zero:
        return GRADIENT_BUCKET_BYTES
    return max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_RANK * layout.data_ranks) * dtype_bytes


def bucketed(parts: Sequence[tuple[str, tuple[tuple[int, ...], ...], int]], bucket: int,
             oracle: CostOracle) -> tuple[int, float]:
    """``(K, s)``: the buckets of ``bucket`` bytes an op of ``parts`` (``(collective, groups, bytes)``, each run over
    all its groups at once) is cut into, the last one smaller but costed alike, and one bucket's time (an op over
    several kinds of group, as a stage with experts over its data- and expert-data-parallel groups: the mean of
    their times, weighted by their bytes)."""
    parts = [part for part in parts if part[2]]
    total = sum(nbytes for _, _, nbytes in parts)
    if not parts:
        return 1, 0.0
    size = min(bucket, total)
    seconds = sum(oracle.collective(name, groups, size).seconds * nbytes for name, groups, nbytes in parts) / total
    return max(1, -(-total // max(size, 1))), seconds


def exposed_gather_s(count: int, bucket_s: float, forward_s: float) -> float:
    """What a forward of ``forward_s`` seconds cannot hide of a parameter gather of ``count`` buckets of ``bucket_s``
    seconds each run ahead of it, s. Megatron-Core's forward waits for a bucket's gather where it first uses that
    bucket's parameters, and the wait dispatches the next bucket's gather (``finish_param_sync`` in
    ``megatron/core/distributed/param_and_grad_buffer.py``): with the forward spread evenly over the buckets, the
    first is waited for whole and each next one for what its gather outlasts the compute of the bucket before it,
    T + (K − 1)·max(0, T − f/K)."""
    return bucket_s + (count - 1) * max(0.0, bucket_s - forward_s / count)
