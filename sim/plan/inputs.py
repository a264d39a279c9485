"""What the user chose, as ``sim.run`` and ``sim.search`` take it: the one record a plan is built from.

Its fields are the command line's flags, one for one, so that a search candidate (``sim.search.space``) and a
``sim.run`` invocation describe a plan the same way and print back as the same command. Ten of them (``tp``,
``dp``, ``pp``, ``rank_order``, ``sequence_parallel``, ``zero``, ``reshard_after_forward``, ``dp_replicate``,
``grad_overlap``, ``devices``) are the user's side of :class:`sim.ir.parallel.Parallelism`;
:func:`sim.plan.layout.plan_layout` is the one place they become one, checked against the topology (``pp`` may be
left to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cost.gpu_time import KernelModel
from sim.ir.parallel import DEFAULT_RANK_ORDER
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES

__all__ = ["PlanInputs", "format_builtin_lists"]


@dataclass(frozen=True)
class PlanInputs:
    """The user's choices, as given on the command line.

    Attributes:
        model: model spec, e.g. ``"gpt:layers=48,hidden=2048"``.
        topology: topology spec, e.g. ``"16xV100"``.
        schedule: schedule name (ignored when ``schedule_file`` is set).
        microbatches: microbatches per iteration (``None``: 8, or inferred from ``schedule_file``).
        microbatch_size: samples per microbatch.
        partition: ``uniform``, ``balanced`` or comma-separated layer counts per stage.
        profile: path of a measured profile JSON, or ``None`` for roofline costs.
        schedule_file: path of a compute-only schedule CSV to use instead of a generator.
        chunks: model chunks (virtual stages) per rank, for schedules that interleave them (``--chunks``).
        recompute: ``"full"`` (or ``True``): recompute every stage's forward before its backward (``--recompute``);
            ``"selective"``: part of each block inside its backward (``--recompute selective``: gpt's attention
            core, Korthikanti et al. §5; llama's and moe's as :mod:`sim.models.llama` and :mod:`sim.models.moe` say);
            ``"none"``
            (or ``False``).
        vertical_sync: every stage uses stage 0's weight version per microbatch (``--vertical-sync``, stash only).
        tp: tensor-parallel degree (``--tp``).
        dp: data-parallel degree (``--dp``).
        cp: context-parallel degree (``--cp``): devices that split each sequence (:mod:`sim.cost.context_parallel`).
        cp_comm: how they exchange keys and values (``--cp-comm``: ``ring`` or ``allgather``).
        pp: pipeline ranks (``--pp``); ``None``: the devices left, ``devices // (tp · dp)``.
        global_batch: samples per iteration over all replicas (``--global-batch``): the microbatch count is
            ``global_batch / (microbatch_size · dp)``.
        rank_order: nesting of the ranks, innermost first (``--rank-order``, default Megatron's ``tp-dp-pp``).
        sequence_parallel: Megatron's sequence parallelism (``--sequence-parallel``).
        zero: ZeRO stage, 0 to 3 (``--zero``; 3 is FSDP).
        reshard_after_forward: under ZeRO-3, gather each layer's parameters again for its backward (True, the
            default); False keeps them from forward to backward, and under a pipeline gathers each vstage once per
            step (:attr:`sim.ir.parallel.Parallelism.fsdp_gathers_per_step`); or a torchtitan policy, ``"default"``,
            ``"always"`` or ``"never"`` (``--fsdp-reshard-after-forward``), resolved once the pipeline degree is
            known (:func:`sim.ir.parallel.resolve_reshard_after_forward`: ``"default"`` keeps them under PP).
        dp_replicate: under ZeRO-3, HSDP's replicate degree (``--dp-replicate``; 1: plain FSDP).
        precision: the training precision (``--precision``, :mod:`sim.cost.precision`); ``None``: the model's own.
        compiled: the blocks under ``torch.compile`` (``--compile``, :mod:`sim.cost.compiled`).
        grad_overlap: reduce gradients in buckets during the last backward (``--grad-overlap``).
        devices: the device of each position of the rank order (``--devices``, a permutation; ``()``: in order).
        kernel_model: the GPU kernel model's software constants (default: the built-in, fitted ones).
        fps: ``--schedule stream`` only: the live source's rate, frames/s (``--fps``; ``None``: frames whenever the
            pipeline asks for one).
        cuda_graphs: each step captured as a CUDA graph and replayed (``--cuda-graphs``: Megatron-Core's
            full-iteration graphs, PARTIME's captured stream step; costed by :class:`~sim.cost.oracle.CostOracle`'s
            ``cuda_graphs``), on GPUs, without a measured profile, for any schedule but csp.
        ep: expert-parallel degree (``--ep``; the moe family): devices of a stage that split its experts.
        etp: expert-tensor-parallel degree (``--etp``): devices that split each expert's width.
        routing: how tokens spread over experts (``--routing``: ``balanced``, ``skew:S[:SEED]``, ``trace:FILE``;
            :mod:`sim.models.routing`).
        capacity_factor: tokens an expert computes at most, as a multiple of its balanced share
            (``--capacity-factor``; 0: dropless).
        ep_overlap: each expert all-to-all runs beside the next compute op of its rank instead of holding the
            compute stream (``--ep-overlap``; DualPipe's and Megatron-Core's overlap of one microbatch's dispatch and
            combine with another's compute; :mod:`sim.plan.lower_collectives`).
        fsdp_float8_gather: under ZeRO-3 and ``--precision fp8``, the blocks' linear weights all-gathered in FP8
            (``--fsdp-float8-all-gather``; :class:`~sim.ir.parallel.Parallelism`'s ``fsdp_float8_gather``).
        async_tp: the tensor-parallel collectives decomposed beside their GEMMs (``--async-tp``; PyTorch's async TP;
            :class:`~sim.ir.parallel.Parallelism`'s ``async_tp``).
        param_gather_overlap: under ZeRO-1 the parameter all-gather runs ahead of the next forward, bucket by bucket
            (``--param-gather-overlap``; Megatron's ``--overlap-param-gather``).
        grad_bucket_params: parameters per bucket of an overlapped reduction or gather (``--grad-bucket-size``;
            Megatron's ``--ddp-bucket-size``); 0: the framework's own rule.
        ep_dispatcher: how the expert-parallel ranks exchange tokens (``--ep-dispatcher``, one of
            :data:`sim.models.sharding.DISPATCHERS`): ``all-to-all``, ``deduplicated`` (once per server, DeepEP's)
            or ``all-gather`` (Megatron-Core's all-gather dispatcher).
        loss: how the framework computes the cross entropy over the vocabulary (``--loss``, one of
            :data:`sim.models.loss.LOSSES`): ``fused`` (Megatron-LM's), ``eager`` (torchtitan's without compile)
            or ``compiled`` (torchtitan's under ``torch.compile``); it decides the head's memory.
        blocks: the modules the framework builds each decoder block from (``--blocks``, one of
            :data:`sim.models.blocks.BLOCKS`): ``eager`` (PyTorch modules, torchtitan's) or ``transformer-engine``
            (Megatron-Core's Transformer Engine layers); it decides what a block keeps for its backward.
        offload_activations: the first N decoder blocks keep their activations in host memory between forward and
            backward (``--offload-activations``, Megatron-Core's ``cpu_offloading_num_layers``;
            :mod:`sim.models.offload`); 0: none.
        deallocate_pipeline_outputs: the pipeline runtime frees each stage's output once sent
            (``--deallocate-pipeline-outputs``, Megatron-Core's; :class:`sim.ir.parallel.Parallelism`).
        recompute_modules: what ``recompute="selective"`` drops in a moe-family block (``--recompute-modules``,
            Megatron-Core's output-discarding modules, :mod:`sim.models.recompute_modules`); the default: all three.
    """

    model: str
    topology: str
    schedule: str = "1f1b"
    microbatches: int | None = None
    microbatch_size: int = 1
    partition: str = "balanced"
    profile: str | None = None
    schedule_file: str | None = None
    chunks: int = 1
    recompute: bool | str = False
    vertical_sync: bool = False
    tp: int = 1
    dp: int = 1
    pp: int | None = None
    cp: int = 1
    cp_comm: str = "ring"
    global_batch: int | None = None
    rank_order: str = DEFAULT_RANK_ORDER
    sequence_parallel: bool = False
    zero: int = 0
    reshard_after_forward: bool | str = True
    dp_replicate: int = 1
    grad_overlap: bool = False
    kernel_model: KernelModel | None = None
    devices: tuple[int, ...] = ()
    fps: float | None = None
    cuda_graphs: bool = False
    precision: str | None = None
    compiled: bool = False
    ep: int = 1
    etp: int = 1
    routing: str = "balanced"
    capacity_factor: float = 0.0
    ep_overlap: bool = False
    ep_dispatcher: str = "all-to-all"
    fsdp_float8_gather: bool = False
    async_tp: bool = False
    param_gather_overlap: bool = False
    grad_bucket_params: int = 0
    deallocate_pipeline_outputs: bool = False
    loss: str = "fused"
    blocks: str = "eager"
    offload_activations: int = 0
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES

    @property
    def recompute_mode(self) -> str:
        """``"none"``, ``"full"`` or ``"selective"``."""
        return {False: "none", True: "full"}.get(self.recompute, self.recompute)  # type: ignore[arg-type]


def format_builtin_lists(model: str | None, topology: str | None) -> str | None:
    """What ``--model list`` and ``--topology list`` print (either alone, or both, a blank line apart), or ``None``
    when neither flag says ``list``. Every command that takes both flags asks here first, so that a list works without
    the command's other flags."""
    from sim.hw.topology import format_topology_list
    from sim.models import format_model_list

    lists = [text() for given, text in ((model, format_model_list), (topology, format_topology_list))
             if given == "list"]
    return "\n\n".join(lists) if lists else None
