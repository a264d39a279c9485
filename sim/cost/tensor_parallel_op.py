"""What a tensor-parallel op costs (TP_F, TP_B, TP_R): every layer's tensor-parallel collectives of a stage, one after
another (Megatron-LM's f and g operators: all-reduces, or reduce-scatter plus all-gather under sequence
parallelism), and under async TP what the GEMMs hide of them. :class:`sim.cost.cost_view.CostView` asks here for its TP
ops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from sim.cost.comm_cost import CommCost, sequential_cost
from sim.cost.oracle import CostOracle
from sim.hw.catalog import DeviceSpec
from sim.ir.parallel import Parallelism
from sim.models.graph import Layer

__all__ = ["tensor_parallel_op_cost"]

Groups = tuple[tuple[int, ...], ...]


def tensor_parallel_op_cost(layers: Sequence[Layer], start: int, end: int, layout: Parallelism, groups: Groups,
                            own: tuple[int, ...], oracle: CostOracle, device: DeviceSpec, microbatch_size: int,
                            backward: bool) -> CommCost:
    """A TP op of the stage holding ``layers[start:end]`` on ``device``: each layer's collectives over ``groups``
    (every concurrent tensor-parallel group at once; the engine holds ``own``'s links), forward (TP_F, TP_R) or
    ``backward`` (TP_B), ``microbatch_size`` samples; under ``layout.async_tp`` less what the GEMMs hide
    (:func:`_async_tp_hidden`).

    Layers with the same collectives are costed once, and what depends on the topology, the groups and the buffers
    alone is kept in the topology's memo, for every view of a search that asks the same op of the same groups.
    """
    names = ("reduce_scatter", "all_gather") if layout.sequence_parallel else ("all_reduce",)
    buffers: dict[int, int] = {}
    for layer in layers[start:end]:
        count = layer.tp_comm_bwd_count if backward else layer.tp_comm_fwd_count
        total = layer.tp_comm_bwd_bytes if backward else layer.tp_comm_fwd_bytes
        if count:
            each = microbatch_size * total // count
            buffers[each] = buffers.get(each, 0) + count
    memo = oracle.topology.cost_memo
    key = ("tensor-parallel op", names, groups, own, tuple(sorted(buffers.items())))
    found = memo.get(key)
    if found is None:
        # Under sequence parallelism a reduce-scatter and an all-gather replace each all-reduce of the same buffer.
        parts, held = [], set()
        for each, count in sorted(buffers.items()):
            for name in names:
                cost = oracle.collective(name, groups, each)
                parts.append((cost, count, each))
                # The engine holds the simulated group's own links, for the algorithm costed for all groups.
                held.update(oracle.collective(name, (own,), each, cost.algorithm).link_keys)
        found = memo[key] = sequential_cost(parts, tuple(sorted(held)))
    if layout.async_tp:
        hidden = _async_tp_hidden(layers, start, end, layout.tp, groups, oracle, device, microbatch_size, backward)
        found = replace(found, seconds=found.seconds - hidden)
    return found


def _async_tp_hidden(layers: Sequence[Layer], start: int, end: int, t: int, groups: Groups, oracle: CostOracle,
                     device: DeviceSpec, microbatch_size: int, backward: bool) -> float:
    """Seconds of a TP op that async TP hides under the GEMMs (``Parallelism.async_tp``).

    PyTorch's async TP (``torch.distributed._symmetric_memory``'s ``fused_all_gather_matmul`` and
    ``fused_matmul_reduce_scatter``; Wang et al., "Overlap Communication with Dependent Computation via Decomposition
    in Large Deep Learning Models", ASPLOS'23) cuts a collective over t ranks into t chunks and its GEMM into the
    matching t parts: the local part is computed while the first remote chunk moves, each next part once its chunk
    has arrived. With the GEMM's t parts taking C' seconds in all and a collective of A, the pair takes
    ``max(C', A + C'/t)`` where it took ``C + A`` (C: the GEMM whole, which the compute op already counts); the
    hidden part is the difference (at most A), and what is left (a decomposed GEMM slower than the whole one
    included: on small GEMMs async TP can cost more than it hides) stays on the TP op. The GEMMs of each collective:
    :data:`sim.cost.gpu_time.ASYNC_TP_GEMMS`, their parts costed by the kernel model
    (:func:`sim.cost.gpu_time.async_tp_gemm_seconds`)."""
    hidden = 0.0
    for i in range(start, end):
        layer = layers[i]
        count = layer.tp_comm_bwd_count if backward else layer.tp_comm_fwd_count
        part = layer.transformer
        if not count or part is None or part.part != "block":
            continue
        each = microbatch_size * (layer.tp_comm_bwd_bytes if backward else layer.tp_comm_fwd_bytes) // count
        for name, whole, chunked in oracle.async_tp_gemms(i, device, backward):
            collective_s = oracle.collective(name, groups, each).seconds
            # At most the collective itself: were the parts faster than the whole, that would be the compute op's.
            hidden += min(collective_s, whole + collective_s - max(chunked, collective_s + chunked / t))
    return hidden
