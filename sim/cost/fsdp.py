"""ZeRO-3 / FSDP inside a stage's forward and backward: each layer's parameters gathered, its gradients scattered,
overlapped with the neighbouring layers' compute.

Under ZeRO-3 (Rajbhandari et al., arXiv 1910.02054 §5.3) every replica holds ``1/D`` of each layer's parameters. Before
a layer's forward the replicas all-gather its parameters; PyTorch's FSDP wraps each transformer block as a unit and
prefetches the next unit's all-gather while the current one computes, so at most two units are gathered at once
(FSDP2's default: one unit of prefetch). The backward walks the layers in reverse: each layer's parameters are
gathered again (unless they were kept after the forward: ``reshard_after_forward=False``), the next layer's gather is
prefetched while it computes, and its gradients are reduce-scattered once it is done, overlapped with the layers
before it. Gradients are reduce-scattered after every microbatch's backward (FSDP's default with gradient
accumulation), and the optimizer steps on the local shard.

A stage's forward and backward are single ops of the plan, so this overlap is costed inside them: a two-stream
pipeline over the stage's layers, one stream computing and one running the collectives in the order they are issued
(all-gathers and reduce-scatters share the data-parallel links, so they are not run side by side). Each collective's
time is the data-parallel group's, with every group of the same collective running at once
(``sim.cost.oracle.CostOracle.collective``). The op ends when its last collective has: the optimizer, and the next
microbatch's gathers, wait for it. Not modelled: the links the collectives hold are not held in the engine (the
overlap with pipeline sends is not seen), and a backward that follows another backward of the same stage under
``reshard_after_forward=False`` (a cool-down) gathers again in FSDP, which is not counted.

Memory: a replica holds its ``1/D`` of the state for the whole run (``sim.cost.memory_sizes.StateShards``); while a
forward runs it also holds the gathered parameters of the layer computing and of the one prefetched, and while a
backward runs those of the layer computing and the one prefetched (when they are gathered again), plus the whole
gradients of the layer computing and of the layer before it in backward order, whose reduce-scatter may still run.
Under ``reshard_after_forward=False`` a stage's gathered parameters stay from a forward until the backward of the
last microbatch then in flight (``sim.cost.ledger``).

Under a pipeline without resharding after the forward (``Parallelism.fsdp_gathers_per_step``, torchtitan's default
there) none of this applies: the forward and backward ops carry no collective; each stage's layers are all-gathered
once per step by a GATHER_PARAMS op and reduce-scattered once by a REDUCE_GRAD op (``sim.plan.lower_collectives``),
costed layer after layer over the same groups (``sim.cost.cost_view.CostView._fsdp_per_step``), and the ledger holds
the stage's whole parameters and gradients for the step.

Every function takes per-layer figures in layer order (forward order): seconds, or bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["forward_seconds", "backward_seconds", "forward_gathered_bytes", "backward_gathered_bytes"]


def forward_seconds(compute: Sequence[float], gather: Sequence[float]) -> float:
    """Seconds of a stage's forward: layer i waits for its own all-gather; the gather of layer i + 1 is issued when
    layer i starts (one layer of prefetch), and the gathers run one after another.

    Args:
        compute: each layer's forward compute, s.
        gather: each layer's parameter all-gather, s.
    """
    if len(compute) != len(gather):
        raise ValueError(f"{len(compute)} layers' compute but {len(gather)} layers' gathers")
    if not compute:
        return 0.0
    gathered = gather[0]  # when layer 0's parameters are there
    comm_free = gathered
    compute_free = 0.0
    for i, seconds in enumerate(compute):
        start = max(compute_free, gathered)
        if i + 1 < len(compute):
            comm_start = max(comm_free, start)
            comm_free = gathered = comm_start + gather[i + 1]
        compute_free = start + seconds
    return max(compute_free, comm_free)


def backward_seconds(compute: Sequence[float], gather: Sequence[float] | None, scatter: Sequence[float]) -> float:
    """Seconds of a stage's backward: the layers in reverse; layer i waits for its all-gather (``gather`` ``None``:
    the parameters were kept after the forward), the gather of the layer before it is issued when layer i starts, and
    layer i's gradients are reduce-scattered once it is done; the collectives run one after another in issue order.

    Args:
        compute: each layer's backward compute, s (forward order).
        gather: each layer's parameter all-gather, s, or ``None``.
        scatter: each layer's gradient reduce-scatter, s.
    """
    n = len(compute)
    if len(scatter) != n or (gather is not None and len(gather) != n):
        raise ValueError("compute, gather and scatter must list the same layers")
    if not n:
        return 0.0
    ready = [0.0] * n  # when each layer's parameters are there
    comm_free = 0.0
    if gather is not None:
        comm_free = ready[n - 1] = gather[n - 1]
    compute_free = 0.0
    for i in reversed(range(n)):
        start = max(compute_free, ready[i])
        if gather is not None and i > 0:
            comm_start = max(comm_free, start)
            comm_free = ready[i - 1] = comm_start + gather[i - 1]
        compute_free = start + compute[i]
        comm_free = max(comm_free, compute_free) + scatter[i]
    return max(compute_free, comm_free)


def forward_gathered_bytes(params: Sequence[int]) -> int:
    """The most gathered parameter bytes a forward holds at once: a layer's and the next one's (prefetched).

    Args:
        params: each layer's whole (gathered) parameter bytes.
    """
    if len(params) <= 1:
        return sum(params)
    return max(params[i] + params[i + 1] for i in range(len(params) - 1))


def backward_gathered_bytes(params: Sequence[int], gradients: Sequence[int], *, gather: bool) -> int:
    """The most bytes a backward holds at once beyond the shards: the gathered parameters of a layer and of the one
    before it (prefetched; only when the backward gathers them), and the whole gradients of the layer and of the one
    after it, whose reduce-scatter may still run.

    Args:
        params: each layer's whole parameter bytes.
        gradients: each layer's whole gradient bytes.
        gather: whether the backward gathers the parameters (False when they were kept after the forward).
    """
    n = len(params)
    if len(gradients) != n:
        raise ValueError(f"{n} layers' parameters but {len(gradients)} layers' gradients")
    most = 0
    for i in range(n):
        held = gradients[i] + (gradients[i + 1] if i + 1 < n else 0)
        if gather:
            held += params[i] + (params[i - 1] if i > 0 else 0)
        most = max(most, held)
    return most
