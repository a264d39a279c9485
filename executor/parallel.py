"""A process of a 3D plan: where it sits (pipeline rank, data-axis position, tensor shard), its groups, its share of
the data, what it builds, and the checks a 3D plan passes before launch.

A plan's programs are its pipeline ranks; with tensor parallelism T, data parallelism D and context parallelism C,
``plan.world_size = T·D·C·P`` processes run them, process ``layout.device(p, d, t)`` running ``plan.programs[p]``
(``sim.ir.parallel``: Megatron's tp-dp-pp numbering by default, the C sequence parts of a replica innermost on the
data axis, ``d = replica·C + part``). Each process:

* finds ``(p, d, t) = layout.coords(rank)`` (:class:`Place`);
* creates every tensor-parallel group, then every data-parallel group (the D·C processes of the data axis), then
  every context-, expert- and expert-data-parallel group, in ``layout.groups()`` order, on every process
  (``torch.distributed.new_group`` must be called by all processes for every group, in one order), and keeps its
  own (:func:`make_groups`);
  groups of one process are not created;
* builds its pipeline rank's vstages: whole layers from the seed as a single process would, then, under tensor
  parallelism, its shard of each (``executor.nn.gpt_parallel``, ``llama_parallel``), so the T shards are the
  single-process model split; under context parallelism its Llama blocks know their group
  (``executor.nn.context_parallel``); under ZeRO-3 its layers are sharded (``executor.fsdp``); its mixtures of
  experts route as the plan says (``executor.nn.forced_routing``) and, under expert parallelism, keep the process's
  block of experts (``executor.nn.expert_parallel``), reducing their gradients over the processes that hold the same
  block (``executor.data_parallel``);
* trains on its replica's slice of each iteration's global batch: replica r runs microbatches
  ``iteration·D·m + r·m + j`` (j < m) of :func:`executor.nn.stages.synthetic_batch`, i.e. samples
  ``r·m·b … (r+1)·m·b − 1`` of the iteration's D·m·b, the very batches single-process training on the global batch
  uses (:func:`microbatch_index`), each of its C processes keeping its own tokens;
* exchanges activations with the process of the neighbouring pipeline rank in the same data position and shard
  (:meth:`Place.peer`).

Not supported, and refused before launch (:func:`check_parallel`): sequence parallelism, tensor parallelism of a
model other than ``gpt`` and ``llama`` (the sharded layers exist for them only), context parallelism of a model
other than ``llama``, expert tensor parallelism (``etp`` > 1), freeing stage outputs once sent
(``deallocate_pipeline_outputs``), HSDP, data parallelism with a schedule that updates
per microbatch (weight stashing), and ``--calibrate-out`` (a profile times one device's whole layers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sim.core.errors import SpecError
from sim.core.spec import parse_spec
from sim.ir.parallel import Parallelism
from sim.ir.plan import Plan

__all__ = ["Place", "ProcessGroups", "make_groups", "microbatch_index", "check_parallel", "build_process", "save_state",
           "ProcessModel", "tensor_parallel_module"]


@dataclass(frozen=True)
class Place:
    """Where one process sits in a plan's layout.

    Attributes:
        rank: its global rank.
        pp: pipeline rank (the program it runs).
        dp: data-parallel replica.
        tp: tensor-parallel shard.
        layout: the plan's layout.
    """

    rank: int
    pp: int
    dp: int
    tp: int
    layout: Parallelism

    @classmethod
    def of(cls, layout: Parallelism, rank: int) -> Place:
        return cls(rank, *layout.coords(rank), layout)

    def peer(self, pipeline_rank: int) -> int:
        """The global rank of ``pipeline_rank`` in this process's replica and shard (a SEND/RECV's peer)."""
        return self.layout.device(pipeline_rank, self.dp, self.tp)


def microbatch_index(iteration: int, j: int, m: int, replica: int, replicas: int) -> int:
    """Which synthetic microbatch replica ``replica`` of ``replicas`` runs as its ``j``-th of ``m`` in
    ``iteration``: ``iteration·D·m + replica·m + j`` (module docstring)."""
    return (iteration * replicas + replica) * m + j


@dataclass(frozen=True)
class ProcessGroups:
    """This process's groups (``None`` for a dimension of size 1).

    Attributes:
        tp: its tensor-parallel group.
        dp: its data-parallel group (the replicas and their sequence parts).
        cp: its context-parallel group.
        ep: its expert-parallel group (``sim.ir.parallel.Parallelism.ep_group``).
        expert_dp: the processes holding the same experts (``Parallelism.expert_dp_group``).
    """

    tp: Any = None
    dp: Any = None
    cp: Any = None
    ep: Any = None
    expert_dp: Any = None


def make_groups(layout: Parallelism, rank: int) -> ProcessGroups:
    """Create every tensor-, data-, context-, expert- and expert-data-parallel group (collectively: every process must
    call this, and creates them in this one order) and return this process's. The data-parallel group spans the
    replicas and their sequence parts (``sim.ir.parallel``)."""
    mine: dict[str, Any] = {}
    groups = layout.groups()
    if layout.ep > 1:
        groups["expert_dp"] = [list(layout.expert_dp_group(p, e, t)) for p in range(layout.pp)
                               for e in range(layout.ep) for t in range(layout.etp)]
    for kind in ("tp", "dp", "cp", "ep", "expert_dp"):
        for members in groups.get(kind, []):
            if len(members) > 1:
                group = dist.new_group(members)
                if rank in members:
                    mine[kind] = group
    return ProcessGroups(**mine)


def check_parallel(plan: Plan) -> None:
    """What the executor cannot run of a 3D plan, refused before launch (module docstring).

    Raises:
        SpecError: naming the feature and the plan's value.
    """
    layout = plan.layout
    if layout.sequence_parallel:
        raise SpecError(f"the executor does not implement sequence parallelism (plan: {layout.describe()}); "
                        f"simulate it with sim.run, run the plan without --sequence-parallel")
    model = parse_spec(plan.model)[0]
    if layout.etp > 1:
        raise SpecError(f"the executor does not implement expert tensor parallelism (etp = {layout.etp}); simulate it "
                        f"with sim.run, run the plan with --etp 1")
    if layout.tp > 1 and model not in ("gpt", "llama"):
        raise SpecError(f"tensor parallelism (tp = {layout.tp}) is implemented for gpt and llama only, not {model!r}")
    if layout.cp > 1 and parse_spec(plan.model)[0] != "llama":
        raise SpecError(f"context parallelism (cp = {layout.cp}) is implemented for the llama family only, not "
                        f"{plan.model!r}")
    if layout.deallocate_pipeline_outputs:
        raise SpecError("the executor keeps each stage's output until its backward; a plan that frees it once sent "
                        "(--deallocate-pipeline-outputs) is simulated only: simulate it with sim.run, run the plan "
                        "without --deallocate-pipeline-outputs")
    if layout.dp_replicate > 1:
        raise SpecError(f"the executor runs FSDP over the whole data-parallel group; HSDP (plan: {layout.describe()}) "
                        f"is simulated only so far: simulate it with sim.run, run the plan without --dp-replicate")
    if layout.dp > 1 and plan.weight_policy != "flush":
        raise SpecError(f"data parallelism (dp = {layout.dp}) runs schedules that update once per iteration; "
                        f"{plan.schedule} has {plan.weight_policy!r} weights")


@dataclass
class ProcessModel:
    """What one process trains: its vstages, their optimizers, the loss, and its parallel helpers.

    Attributes:
        stages: vstage → module (a tensor shard of it under tensor parallelism).
        optimizers: vstage → what the interpreter's OPT_STEP steps.
        loss: ``(last stage's output, targets) -> scalar``.
        tp_comm: the tensor-parallel group's clock, or ``None``.
        ep_comm: the expert-parallel group's clock, or ``None``.
        data_parallel: the :class:`executor.data_parallel.DataParallel`, or under ZeRO-3 gathered once per step the
            :class:`executor.fsdp.FullyShardedStages` (it runs the plan's GATHER_PARAMS and REDUCE_GRAD), or ``None``.
        fully_sharded: under ZeRO-3, the :class:`executor.fsdp.FullyShardedStages` (``None`` otherwise).
    """

    stages: dict[int, nn.Module]
    optimizers: dict[int, Any]
    loss: Callable[..., torch.Tensor]
    tp_comm: Any = None
    data_parallel: Any = None
    fully_sharded: Any = None
    ep_comm: Any = None


def build_process(plan: Plan, place: Place, groups: ProcessGroups, *, seed: int, optimizer: str,
                  lr: float | None, device: torch.device, aggregate: str = "mean",
                  byzantine: tuple[tuple[int, str, float], ...] = (), data_seed: int = 0) -> ProcessModel:
    """Build the process's vstages (sharded under tensor and expert parallelism, their mixtures routed as the plan
    says), optimizers (sharded under ZeRO) and loss."""
    from executor.nn.optim import make_optimizer
    from executor.nn.stages import Stage, build_stage, loss_fn

    layout = plan.layout
    vstages = plan.placement.vstages_of(place.pp)
    stages: dict[int, nn.Module] = {}
    comm, loss = None, loss_fn(plan.model)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if layout.tp > 1:
        from executor.nn.gpt_parallel import parallel_loss
        from executor.nn.tensor_parallel import TensorParallelComm

        shard_layer = tensor_parallel_module(plan.model).shard_layer

        comm = TensorParallelComm(groups.tp, layout.tp, place.tp, sync=sync)
        values = {key: int(value) for key, value in parse_spec(plan.model)[1].items()}
        for v in vstages:
            whole = build_stage(plan.model, *plan.placement.vstage_layers[v], seed=seed)
            layers = {name: shard_layer(layer, values, comm) for name, layer in whole.layers.items()}
            stages[v] = Stage(whole.spec, whole.start, layers)
        loss = parallel_loss(values, comm)
    else:
        stages = {v: build_stage(plan.model, *plan.placement.vstage_layers[v], seed=seed) for v in vstages}
    experts, ep_comm = _route_and_shard_experts(plan, place, groups, stages, sync)
    stages = {v: stage.to(device) for v, stage in stages.items()}
    if layout.cp > 1:
        from executor.nn.context_parallel import ContextParallel

        context = ContextParallel(groups.cp, place.dp % layout.cp, layout.cp)
        for stage in stages.values():
            for layer in stage.layers.values():
                if hasattr(layer, "context"):  # the attention of a Llama-family block
                    layer.context = context
    if layout.data_ranks > 1 and layout.zero == 3:
        from executor.fsdp import FullyShardedStages

        per_step = layout.fsdp_gathers_per_step  # the plan's GATHER_PARAMS and REDUCE_GRAD run through it
        sharded = FullyShardedStages(stages, groups.dp, layout.data_ranks, place.dp,
                                     reshard_after_forward=layout.reshard_after_forward, optimizer=optimizer, lr=lr,
                                     per_step=per_step)
        return ProcessModel(stages, sharded.optimizers, loss, comm, data_parallel=sharded if per_step else None,
                            fully_sharded=sharded)
    if layout.data_ranks > 1:
        from executor.data_parallel import DataParallel

        dp = DataParallel(stages, groups.dp, layout.data_ranks, place.dp, zero=layout.zero, optimizer=optimizer,
                          lr=lr, experts=experts, zeno=_zeno(plan, stages, aggregate, optimizer, lr, data_seed, loss),
                          byzantine=_byzantine(byzantine, place.dp))
        return ProcessModel(stages, dp.optimizers, loss, comm, dp, ep_comm=ep_comm)
    return ProcessModel(stages, {v: make_optimizer(optimizer, stages[v].parameters(), lr) for v in vstages}, loss,
                        comm)


def _zeno(plan: Plan, stages: Mapping[int, nn.Module], aggregate: str, optimizer: str, lr: float | None,
          data_seed: int, loss: Callable[..., torch.Tensor]) -> Any:
    """Zeno's aggregator over the one vstage of a data-parallel plan (``executor.zeno``), or ``None`` for the
    mean."""
    from executor.zeno import ZenoAggregator, parse_aggregate

    rule = parse_aggregate(aggregate, plan.layout.data_ranks)
    if rule is None:
        return None
    from executor.nn.optim import DEFAULT_LR

    (stage,) = stages.values()
    return ZenoAggregator(stage, rule, lr if lr is not None else DEFAULT_LR[optimizer], plan.model,
                          plan.microbatch_size, data_seed, loss)


def _byzantine(byzantine: tuple[tuple[int, str, float], ...], replica: int) -> Any:
    """This replica's corruption (``executor.byzantine``), or ``None`` when it is honest."""
    from executor.byzantine import Byzantine

    return next((Byzantine(*entry) for entry in byzantine if entry[0] == replica), None)


def _route_and_shard_experts(plan: Plan, place: Place, groups: ProcessGroups, stages: Mapping[int, nn.Module],
                             sync: Callable[[], None] | None) -> tuple[Any, Any]:
    """Force the plan's routing on every mixture of ``stages`` (``executor.nn.forced_routing``) and, under expert
    parallelism, keep this process's block of experts (``executor.nn.expert_parallel``). Returns what
    ``DataParallel`` needs to reduce the experts' gradients over their own group, and the expert-parallel clock
    (``(None, None)`` without expert parallelism)."""
    if parse_spec(plan.model)[0] != "moe":
        return None, None
    from executor.nn.moe import force_routing
    from sim.cost.plan_settings import plan_dispatcher, plan_routing

    routing, capacity_factor = plan_routing(plan)
    for stage in stages.values():
        force_routing(stage, routing, capacity_factor)
    layout = plan.layout
    if layout.ep == 1:
        return None, None
    from executor.data_parallel import ReductionGroup
    from executor.nn.expert_parallel import ExpertParallelComm, is_expert_parameter
    from executor.nn.moe import shard_experts

    expert_dp, ep_rank, _ = layout.expert_coords(place.rank)
    ep_comm = ExpertParallelComm(groups.ep, layout.ep, ep_rank, sync=sync)
    for stage in stages.values():
        shard_experts(stage, ep_comm, plan_dispatcher(plan))
    return (ReductionGroup(groups.expert_dp, layout.expert_dp, expert_dp), is_expert_parameter), ep_comm


def save_state(directory: str, plan: Plan, place: Place, model: ProcessModel, groups: ProcessGroups) -> None:
    """``--save-state``: every vstage's whole parameters as ``stage<v>.pt``, named as a single process names them.

    Replica 0 saves (the replicas hold the same parameters); under ZeRO-3 every replica first takes part in gathering
    the shards (a collective of the data-parallel group); under tensor parallelism its shards are gathered to shard 0
    (collectively: every process of the replica's tensor-parallel group must call this), which saves; under expert
    parallelism the expert blocks of replica 0's expert-parallel group are gathered to it first.
    """
    sharded = model.fully_sharded
    expert_parallel = model.ep_comm is not None and plan.layout.expert_coords(place.rank)[0] == 0
    if place.dp != 0 and sharded is None and not expert_parallel:
        return
    for v, stage in sorted(model.stages.items()):
        if sharded is not None:  # every replica takes part in gathering the shards; replica 0 saves
            state = {key: tensor.detach().cpu() for key, tensor in sharded.state_dict(v, stage).items()}
            if place.dp != 0:
                continue
        else:
            state = {key: tensor.detach().cpu() for key, tensor in stage.state_dict().items()}
        if expert_parallel:
            from executor.nn.expert_parallel import merge_expert_shards

            blocks: list[Any] = [None] * plan.layout.ep
            dist.all_gather_object(blocks, state, group=groups.ep)
            if place.dp != 0:
                continue
            state = merge_expert_shards(blocks)
        if plan.layout.tp > 1:
            unshard_state = tensor_parallel_module(plan.model).unshard_state
            shards: list[Any] = [None] * plan.layout.tp
            dist.all_gather_object(shards, state, group=groups.tp)
            if place.tp != 0:
                continue
            state = _unshard_stage(shards, int(parse_spec(plan.model)[1]["vocab"]), unshard_state)
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(directory, f"stage{v}.pt"))


def tensor_parallel_module(model: str) -> Any:
    """The module of ``model``'s tensor-parallel shards (its ``shard_layer`` and ``unshard_state``): gpt's or llama's.

    Raises:
        KeyError: a model without tensor-parallel shards (:func:`check_parallel` refuses it first).
    """
    from executor.nn import gpt_parallel, llama_parallel

    return {"gpt": gpt_parallel, "llama": llama_parallel}[parse_spec(model)[0]]


def _unshard_stage(shards: list[Mapping[str, torch.Tensor]], vocab: int, unshard) -> dict[str, torch.Tensor]:
    """A stage's state dict (``layers.<layer>.<param>``) from its shards', layer by layer."""
    layers = sorted({key.split(".")[1] for key in shards[0]})
    state: dict[str, torch.Tensor] = {}
    for layer in layers:
        prefix = f"layers.{layer}."
        parts = [{k[len(prefix):]: t for k, t in shard.items() if k.startswith(prefix)} for shard in shards]
        state.update({prefix + key: tensor for key, tensor in unshard(parts, vocab).items()})
    return state
