"""Expert parallelism in the executor: each of E_p processes holds a contiguous block of E/E_p experts of every MoE
layer, and the tokens travel to the experts by all-to-all (GShard, Lepikhin et al. 2020, arXiv 2006.16668 §2.2;
Megatron-Core's all-to-all token dispatcher).

A mixture with an :class:`ExpertParallelComm` (``executor.nn.moe.Mixture``) routes its own tokens, then:

1. **counts**: sorts its token copies by expert (so by owning process: process q owns experts
   ``[q·E/E_p, (q+1)·E/E_p)``) and exchanges the number it sends each process (an all-to-all of E_p integers), so
   that every process knows how many rows it receives from each;
2. **dispatch**: an all-to-all of the copies' hidden states (and of their expert numbers) with those split sizes;
3. the process runs each of its experts on the rows it received for it;
4. **combine**: the reverse all-to-all sends every output row back to the process its token came from, which weights
   it by the router's score and adds it to the token's output.

The all-to-alls carry autograd (:func:`exchange`): the backward of a dispatch is a combine of the gradients and vice
versa, so a backward pass runs the same two exchanges in reverse.

Under the plan's ``--ep-dispatcher all-gather`` (Megatron-Core's all-gather dispatcher, Megatron-LM's default) the
mixture instead gathers every process's tokens, their routing map and scores (:func:`gather_rows`), runs its experts
on the rows routed to them among all of the group's tokens, and reduce-scatters the weighted outputs back to the
processes the tokens came from (:func:`scatter_sum`): the backward of a gather is a reduce-scatter of the gradients
and vice versa. Every process of a group holds the same number of tokens (the replicas' microbatches are one shape).

Every call is timed on the group's clock (:class:`executor.nn.collective_clock.CollectiveClock`), which the
interpreter reports as the plan's ``EP_F``, ``EP_B`` and ``EP_R`` spans.

Where the group comes from: the E_p processes of one pipeline rank that :meth:`sim.ir.parallel.Parallelism.ep_group`
names (Megatron-Core's parallel folding); the processes that hold the same experts reduce their gradients over the
expert-data-parallel group (``executor.data_parallel``). Each process builds its layers whole from the seed, as a
single process would, and keeps its block (:func:`shard_experts`), so the blocks together are the single-process
model's experts (``executor.nn.moe.shard_experts``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from executor.nn.collective_clock import CollectiveClock

__all__ = ["ExpertParallelComm", "exchange", "gather_rows", "scatter_sum", "EXPERT_PARAMETERS",
           "is_expert_parameter", "merge_expert_shards"]

#: The parameters of ``executor.nn.moe.Mixture`` stacked by expert (dimension 0), which expert parallelism splits.
EXPERT_PARAMETERS = ("w_gate", "w_up", "w_down", "b_gate_up", "b_down")


def is_expert_parameter(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` is a routed expert's: split by expert parallelism, its
    gradient reduced over the expert-data-parallel group."""
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMETERS


class ExpertParallelComm(CollectiveClock):
    """One process's expert-parallel group of E_p processes (``rank`` its expert-parallel rank), and a clock of the
    time its all-to-alls take."""

    def counts(self, send: Tensor) -> Tensor:
        """All-to-all of the row counts: ``send[q]`` rows go to process q; returns ``received[q]``, the rows that come
        from process q (int64, one per process)."""
        received = torch.empty_like(send)
        self.timed(lambda: dist.all_to_all_single(received, send, group=self.group))
        return received

    def all_to_all(self, rows: Tensor, send: list[int], receive: list[int]) -> Tensor:
        """All-to-all of ``rows`` (its first ``send[0]`` rows to process 0, the next ``send[1]`` to process 1, …);
        returns the rows received, ``receive[q]`` from process q, in process order."""
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        self.timed(lambda: dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive,
                                                  input_split_sizes=send, group=self.group))
        return out

    def all_gather(self, rows: Tensor) -> Tensor:
        """Every process's ``rows`` (the same shape on each), concatenated in process order along dimension 0."""
        out = rows.new_empty((self.size * rows.shape[0], *rows.shape[1:]))
        self.timed(lambda: dist.all_gather_single(out, rows.contiguous(), group=self.group))
        return out

    def reduce_scatter(self, rows: Tensor) -> Tensor:
        """The sum over the processes of ``rows`` (the same shape on each, ``size`` equal blocks along dimension 0),
        this process's block of it."""
        out = rows.new_empty((rows.shape[0] // self.size, *rows.shape[1:]))
        self.timed(lambda: dist.reduce_scatter_single(out, rows.contiguous(), group=self.group))
        return out


class _WithAdjoint(torch.autograd.Function):
    """A collective on rows whose backward is its adjoint on their gradients: an all-to-all's is the reverse
    all-to-all, an all-gather's a reduce-scatter (each process's rows were used by all), a reduce-scatter's an
    all-gather (each block's sum read every process's rows)."""

    @staticmethod
    def forward(ctx, rows: Tensor, collective: Callable[[Tensor], Tensor],  # type: ignore[override]
                adjoint: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.adjoint = adjoint
        return collective(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return ctx.adjoint(grad), None, None


def exchange(rows: Tensor, comm: ExpertParallelComm, send: list[int], receive: list[int]) -> Tensor:
    """Differentiable all-to-all: ``send[q]`` of ``rows`` go to process q, ``receive[q]`` rows come from it."""
    return _WithAdjoint.apply(rows, lambda x: comm.all_to_all(x, send, receive),
                              lambda g: comm.all_to_all(g, receive, send))


def gather_rows(rows: Tensor, comm: ExpertParallelComm) -> Tensor:
    """Differentiable all-gather: every process's ``rows`` in process order."""
    return _WithAdjoint.apply(rows, comm.all_gather, comm.reduce_scatter)


def scatter_sum(rows: Tensor, comm: ExpertParallelComm) -> Tensor:
    """Differentiable reduce-scatter: this process's block of the sum of every process's ``rows``."""
    return _WithAdjoint.apply(rows, comm.reduce_scatter, comm.all_gather)


def merge_expert_shards(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One state dict from the expert-parallel ranks' (in rank order): expert parameters concatenated by expert, the
    rest taken from rank 0 (every rank holds the same)."""
    merged = dict(shards[0])
    for key in merged:
        if is_expert_parameter(key):
            merged[key] = torch.cat([shard[key] for shard in shards], dim=0)
    return merged
