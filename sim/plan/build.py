"""From what the user typed to a validated L1 plan with its cost model: the front half of ``sim.run``.

``build_plan`` parses the model and topology specs, generates (or loads) the L0 schedule, partitions the layers,
validates, lowers and validates again, so that an invalid plan is rejected before anything is simulated or executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sim.core.errors import SpecError
from sim.cost.gpu_time import KernelModel
from sim.cost.model import CostModel, plan_sharding
from sim.cost.oracle import CostOracle
from sim.cost.profile import MeasuredProfile, load_profile
from sim.hw.topology import Topology
from sim.ir.parallel import DEFAULT_RANK_ORDER, Parallelism
from sim.ir.plan import Op, OpKind, Placement, Plan
from sim.ir.schedule_csv import load_schedule_csv
from sim.ir.weight_versions import VERTICAL_SYNC_OPTION
from sim.models import build_model
from sim.models.graph import LayerGraph
from sim.plan.collectives import add_collectives
from sim.plan.lower import add_recompute, lower
from sim.plan.partition import counts_to_ranges, parse_partition
from sim.plan.validate import validate, validate_l0
from sim.schedules import ScheduleEntry, get_schedule

__all__ = ["PlanInputs", "BuiltPlan", "build_plan", "MAX_PLAN_OPS", "plan_op_count", "check_plan_size", "place_layers",
           "inputs_oracle", "plan_layout", "plan_microbatches"]

#: Peak memory of ``sim.run`` per op of the plan it simulates, bytes, measured by ``python -m sim.bench_memory``:
#: 1F1B on 4 ranks peaks at 75 MB, 251 MB and 2,045 MB of resident memory for 1,000, 10,000 and 100,000 microbatches
#: (20,004, 200,004 and 2,000,004 ops), 55 MB of it fixed (interpreter, imports): 980 to 1,015 bytes per op at every
#: size. The peak is while plan.json is written: the plan's ops (~210 bytes each), the trace's spans (~210) and the
#: JSON of every op on its way to disk (~490) are alive at once.
PEAK_BYTES_PER_OP = 1000
#: What a plan may make ``sim.run`` hold at once: 8 GiB, half of a 16 GB workstation.
MEMORY_BUDGET_BYTES = 8 * 2**30
#: The most ops (lowered: compute, SEND/RECV, optimizer steps) a plan may have: the memory budget at the measured
#: peak per op, about 8.6 million (430,000 microbatches of a 4-rank 1F1B plan). Time grows in proportion too: about
#: 70 µs an op end to end on one core, so the largest plan takes ten minutes.
MAX_PLAN_OPS = MEMORY_BUDGET_BYTES // PEAK_BYTES_PER_OP
#: Largest byte count the memory accounting may reach: the engine's counters are Python ints, but metrics.json
#: carries them to readers with 64-bit integers (the executor's torch memory stats among them).
MAX_BYTES = 2**63 - 1


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
            ``"selective"``: only the attention core (``--recompute selective``, Korthikanti et al. §5); ``"none"``
            (or ``False``).
        vertical_sync: every stage uses stage 0's weight version per microbatch (``--vertical-sync``, stash only).
        tp: tensor-parallel degree (``--tp``).
        dp: data-parallel degree (``--dp``).
        pp: pipeline ranks (``--pp``); ``None``: the devices left, ``devices // (tp · dp)``.
        global_batch: samples per iteration over all replicas (``--global-batch``): the microbatch count is
            ``global_batch / (microbatch_size · dp)``.
        rank_order: nesting of the ranks, innermost first (``--rank-order``, default Megatron's ``tp-dp-pp``).
        sequence_parallel: Megatron's sequence parallelism (``--sequence-parallel``).
        zero: ZeRO stage, 0 or 1 (``--zero``).
        grad_overlap: reduce gradients in buckets during the last backward (``--grad-overlap``).
        devices: the device of each position of the rank order (``--devices``, a permutation; ``()``: in order).
        kernel_model: the GPU kernel model's software constants (default: the built-in, fitted ones).
        fps: ``--schedule stream`` only: the live source's rate, frames/s (``--fps``; ``None``: frames whenever the
            pipeline asks for one).
        cuda_graphs: ``--schedule stream`` only: each step captured as a CUDA graph (``--cuda-graphs``; costed by
            :class:`~sim.cost.oracle.CostOracle`'s ``cuda_graphs``), on GPUs and without a measured profile.
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
    global_batch: int | None = None
    rank_order: str = DEFAULT_RANK_ORDER
    sequence_parallel: bool = False
    zero: int = 0
    grad_overlap: bool = False
    kernel_model: KernelModel | None = None
    devices: tuple[int, ...] = ()
    fps: float | None = None
    cuda_graphs: bool = False

    @property
    def recompute_mode(self) -> str:
        """``"none"``, ``"full"`` or ``"selective"``."""
        return {False: "none", True: "full"}.get(self.recompute, self.recompute)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BuiltPlan:
    """A validated L1 plan and everything needed to simulate it."""

    plan: Plan
    graph: LayerGraph
    topology: Topology
    costs: CostModel
    profile: MeasuredProfile | None


def _placement_from_programs(programs: tuple[tuple[Op, ...], ...], source: str) -> tuple[int, ...]:
    """Infer ``vstage_to_rank`` from where each vstage's ops appear, as PyTorch's ``_validate_schedule`` does."""
    rank_of: dict[int, int] = {}
    for rank, program in enumerate(programs):
        for op in program:
            if rank_of.setdefault(op.vstage, rank) != rank:
                raise SpecError(f"{source}: vstage {op.vstage} has ops on rank {rank_of[op.vstage]} and rank {rank}")
    missing = sorted(set(range(max(rank_of) + 1)) - set(rank_of))
    if missing:
        raise SpecError(f"{source}: vstage(s) {missing} have no ops")
    return tuple(rank_of[v] for v in range(len(rank_of)))


def compute_ops_per_microbatch(entry: ScheduleEntry) -> int:
    """Compute ops (F, B, I, W, R) a schedule gives each (vstage, microbatch): 2, or 3 with a split backward.

    Counted on the schedule itself at 2 ranks and 2 microbatches (2 chunks where it takes them), the smallest
    instance every generator accepts, so a new generator needs no entry here.
    """
    probe = entry.build(2, 2, 2 if entry.chunked else 1)
    vstages = len(entry.vstage_to_rank(2, 2 if entry.chunked else 1))
    return -(-sum(len(program) for program in probe) // (vstages * 2))


def plan_op_count(num_microbatches: int, vstage_to_rank: tuple[int, ...], compute_per_microbatch: float,
                  update_per_microbatch: bool) -> int:
    """Ops of the lowered plan, before generating it.

    Per microbatch: ``compute_per_microbatch`` ops on each vstage, four (SEND_F, RECV_F, SEND_B, RECV_B) at each
    boundary between consecutive vstages on different ranks, and an OPT_STEP per vstage when weights are updated per
    microbatch (``stash``); otherwise one OPT_STEP per vstage in all.
    """
    per_microbatch, fixed = _op_rate(vstage_to_rank, compute_per_microbatch, update_per_microbatch)
    return math.ceil(num_microbatches * per_microbatch) + fixed


def _op_rate(vstage_to_rank: tuple[int, ...], compute_per_microbatch: float,
             update_per_microbatch: bool) -> tuple[float, int]:
    """(ops per microbatch, ops once per plan) of :func:`plan_op_count`."""
    vstages = len(vstage_to_rank)
    crossings = sum(a != b for a, b in zip(vstage_to_rank, vstage_to_rank[1:]))
    per_microbatch = vstages * compute_per_microbatch + 4 * crossings + (vstages if update_per_microbatch else 0)
    return per_microbatch, 0 if update_per_microbatch else vstages


def check_plan_size(graph: LayerGraph, num_microbatches: int, microbatch_size: int, vstage_to_rank: tuple[int, ...],
                    compute_per_microbatch: float, update_per_microbatch: bool) -> None:
    """Reject, before anything is generated, a plan over :data:`MAX_PLAN_OPS` ops or whose byte counts overflow.

    Raises:
        SpecError: the plan would have more than :data:`MAX_PLAN_OPS` ops (naming ``--microbatches``), or its
            microbatches' activations could exceed :data:`MAX_BYTES` (naming ``--microbatch-size``).
    """
    ops = plan_op_count(num_microbatches, vstage_to_rank, compute_per_microbatch, update_per_microbatch)
    if ops > MAX_PLAN_OPS:
        per_microbatch, fixed = _op_rate(vstage_to_rank, compute_per_microbatch, update_per_microbatch)
        fit = int((MAX_PLAN_OPS - fixed) // per_microbatch)
        raise SpecError(
            f"a plan of {ops:,} ops ({len(vstage_to_rank)} stages on {len(set(vstage_to_rank))} ranks, "
            f"{per_microbatch:g} ops per microbatch) is over the limit of {MAX_PLAN_OPS:,} ops, set by the "
            f"~{PEAK_BYTES_PER_OP:,} bytes of memory sim.run needs per op (measured) and an "
            f"{MEMORY_BUDGET_BYTES // 2**30} GiB budget: at most {fit:,} microbatches fit; "
            f"--microbatches {num_microbatches}")
    # Every byte the engine accounts is at most all microbatches' activations (and workspace) at once, per sample
    # at most the model input plus everything each layer keeps or uses.
    per_sample = graph.input_bytes + sum(layer.activation_bytes + layer.saved_bytes + layer.workspace_bytes
                                         for layer in graph.layers)
    if num_microbatches * microbatch_size * max(per_sample, 1) > MAX_BYTES:
        raise SpecError(
            f"{num_microbatches} microbatches × {microbatch_size} samples × {per_sample:,} bytes per sample of "
            f"{graph.spec} overflow the memory accounting (at most 2^63 - 1 bytes, the 64-bit counts metrics.json "
            f"readers use); --microbatch-size {microbatch_size}")


def build_plan(inputs: PlanInputs) -> BuiltPlan:
    """Parse, generate, partition, validate and lower.

    Raises:
        SpecError: any bad input (unknown model/topology/schedule, sizes, a malformed or invalid schedule file, a
            partition that does not fit); the message names the offending value.
    """
    if inputs.microbatch_size < 1:
        raise SpecError(f"--microbatch-size must be >= 1, got {inputs.microbatch_size}")
    if inputs.microbatches is not None and inputs.microbatches < 1:
        raise SpecError(f"--microbatches must be >= 1, got {inputs.microbatches}")
    if inputs.chunks < 1:
        raise SpecError(f"--chunks must be >= 1, got {inputs.chunks}")
    if inputs.recompute_mode not in ("none", "full", "selective"):
        raise SpecError(f"--recompute takes full or selective, got {inputs.recompute!r}")
    if inputs.schedule_file and inputs.vertical_sync:
        raise SpecError("--vertical-sync applies to the pipedream schedule, not to a schedule file")
    if inputs.schedule_file and inputs.chunks != 1:
        raise SpecError(f"--chunks {inputs.chunks} applies to generated schedules; a schedule file places its "
                        f"stages where its ops are ({inputs.schedule_file})")
    topology = Topology.parse(inputs.topology)
    layout = plan_layout(inputs, topology)
    microbatches = plan_microbatches(inputs, layout)
    if layout.tp > 1 and inputs.profile:
        raise SpecError(f"a measured profile times whole layers on one device; --tp {layout.tp} splits them "
                        f"({inputs.profile})")
    graph = build_model(inputs.model, plan_sharding(layout, inputs.recompute_mode))
    profile = load_profile(inputs.profile) if inputs.profile else None
    if inputs.schedule_file:
        programs = load_schedule_csv(inputs.schedule_file)
        vstage_to_rank = _placement_from_programs(programs, inputs.schedule_file)
        inferred = 1 + max(op.mb for program in programs for op in program if op.mb is not None)
        if microbatches is not None and microbatches != inferred:
            raise SpecError(f"{inputs.schedule_file} has {inferred} microbatches, --microbatches (or --global-batch) "
                            f"says {microbatches}")
        num_microbatches, schedule_name, weight_policy = inferred, "file", "flush"
        # The file itself is bounded (sim.core.fileio.INPUT_LIMITS); its lowered plan and sizes are checked here.
        compute = sum(len(program) for program in programs)
        if inputs.recompute_mode == "full":
            compute += sum(op.kind in (OpKind.B, OpKind.I) for program in programs for op in program)
        # Under tensor parallelism each compute op is followed by its collective: at most twice the ops.
        check_plan_size(graph, num_microbatches, inputs.microbatch_size, vstage_to_rank,
                        compute * (2 if layout.tp > 1 else 1) / (len(vstage_to_rank) * num_microbatches), False)
        generator_options: tuple[tuple[str, int | bool], ...] = ()
        if len(programs) * layout.tp * layout.dp > topology.num_ranks:
            raise SpecError(f"{inputs.schedule_file} has {len(programs)} ranks, × TP {layout.tp} × DP {layout.dp} "
                            f"devices, topology {topology} has {topology.num_ranks} devices")
        if inputs.pp is not None and inputs.pp != len(programs):
            raise SpecError(f"{inputs.schedule_file} has {len(programs)} ranks, --pp says {inputs.pp}")
        layout = replace(layout, pp=len(programs))
    else:
        entry = get_schedule(inputs.schedule)
        num_microbatches = microbatches if microbatches is not None else 8
        num_ranks = layout.pp
        # Sizes first, so that a too-small model is named before the generator's own constraints, and counted before
        # the placement is built (--chunks 1000000000 would otherwise make a tuple of billions first).
        num_vstages = num_ranks * inputs.chunks if entry.chunked else num_ranks
        if num_vstages > len(graph):
            per_rank = f"{inputs.chunks} per device" if entry.chunked else "one per device"
            where = (str(topology) if plan_is_pipeline_only(layout, topology) else
                     f"{num_ranks} pipeline ranks ({layout.describe()})")
            raise SpecError(f"more stages ({num_vstages}, {per_rank} of {where}) than layers "
                            f"({len(graph)}) in {graph.spec}")
        vstage_to_rank = entry.vstage_to_rank(num_ranks, inputs.chunks) if entry.chunked else tuple(range(num_ranks))
        # Bounded work: what the plan will hold is known from its sizes, so it is checked before generating it.
        check_plan_size(graph, num_microbatches, inputs.microbatch_size, vstage_to_rank,
                        (compute_ops_per_microbatch(entry) + int(inputs.recompute_mode == "full"))
                        * (2 if layout.tp > 1 else 1), entry.weight_policy in ("stash", "stream"))
        programs = entry.build(num_ranks, num_microbatches, inputs.chunks)
        schedule_name, weight_policy = entry.name, entry.weight_policy
        generator_options = (("chunks", inputs.chunks),) if entry.chunked else ()
        if inputs.fps is not None:
            if weight_policy != "stream":
                raise SpecError(f"--fps {inputs.fps:g} is the frame rate of a live source, for --schedule stream, "
                                f"not {entry.name}")
            if not (isinstance(inputs.fps, (int, float)) and math.isfinite(inputs.fps) and inputs.fps > 0):
                raise SpecError(f"--fps must be a finite number of frames per second > 0, got {inputs.fps!r}")
            generator_options += (("fps", float(inputs.fps)),)
        if inputs.cuda_graphs:
            _check_cuda_graphs(inputs, entry.name, topology, layout)
            generator_options += (("cuda_graphs", True),)
        if inputs.vertical_sync:
            if weight_policy != "stash":
                raise SpecError(f"--vertical-sync applies to weight stashing (pipedream), not {entry.name}")
            generator_options += ((VERTICAL_SYNC_OPTION, True),)
    if weight_policy == "stream" and inputs.recompute_mode != "none":
        raise SpecError(f"--recompute {inputs.recompute_mode} does not apply to --schedule stream: a stage keeps one "
                        f"frame's activations, and recomputes only when the stream has ended (the drain)")
    oracle, placement = place_layers(inputs, graph, profile, topology, layout, vstage_to_rank)
    l0 = Plan(
        schedule=schedule_name,
        level="L0",
        model=graph.spec,
        topology=str(topology),
        num_microbatches=num_microbatches,
        microbatch_size=inputs.microbatch_size,
        weight_policy=weight_policy,
        placement=placement,
        programs=programs,
        parallel=layout,
        # The profile is recorded so that executor.run predicts with the costs this plan was made with.
        options=tuple(sorted((("partition", inputs.partition),) + generator_options
                             + ((("profile", inputs.profile),) if inputs.profile else ()))),
    )
    if inputs.recompute_mode == "selective":
        if any(op.kind is OpKind.R for program in programs for op in program):
            raise SpecError(f"--recompute selective recomputes inside the backward; {inputs.schedule_file} has R ops "
                            f"(full recomputation)")
        l0 = replace(l0, options=tuple(sorted({**dict(l0.options), "recompute": "selective"}.items())))
    elif inputs.recompute_mode == "full" or (weight_policy != "stream" and any(
            op.kind is OpKind.R for program in programs for op in program)):
        l0 = add_recompute(l0)  # also records ("recompute", True) in the options
    validate_l0(l0)
    plan = add_collectives(lower(l0))
    validate(plan)
    costs = CostModel(graph, topology, placement, inputs.microbatch_size, profile, oracle=oracle, layout=layout,
                      concurrent=tuple(range(layout.dp)))
    return BuiltPlan(plan, graph, topology, costs, profile)


def _check_cuda_graphs(inputs: PlanInputs, schedule: str, topology: Topology, layout: Parallelism) -> None:
    """``--cuda-graphs`` models a captured stream step: a stream, on GPUs, costed by the catalog (a measured profile's
    times include the eager overheads a graph removes, in a share no profile records)."""
    if schedule != "stream":
        raise SpecError(f"--cuda-graphs models PARTIME's captured step, for --schedule stream, not {schedule}")
    if inputs.profile:
        raise SpecError(f"--cuda-graphs cannot apply to a measured profile ({inputs.profile}): its times include the "
                        f"per-op overheads a graph removes, in a share it does not record")
    cpus = sorted({topology.devices[layout.device(p, d, t)].name for p in range(layout.pp) for d in range(layout.dp)
                   for t in range(layout.tp) if not topology.devices[layout.device(p, d, t)].is_gpu})
    if cpus:
        raise SpecError(f"--cuda-graphs needs GPUs; topology {topology} runs the plan on {', '.join(cpus)}")


def inputs_oracle(inputs: PlanInputs, graph: LayerGraph, profile: MeasuredProfile | None, topology: Topology,
                  layout: Parallelism) -> CostOracle:
    """The cost oracle of the plan ``inputs`` describe: its microbatch size, ZeRO sharding of the optimizer, profile
    and kernel model (:func:`sim.cost.model.plan_oracle` makes the same from a written plan, which records no kernel
    model)."""
    return CostOracle(graph, inputs.microbatch_size, profile, topology, cuda_graphs=inputs.cuda_graphs,
                      optimizer_shards=layout.dp if layout.zero else 1, kernel_model=inputs.kernel_model)


def place_layers(inputs: PlanInputs, graph: LayerGraph, profile: MeasuredProfile | None, topology: Topology,
                 layout: Parallelism, vstage_to_rank: tuple[int, ...]) -> tuple[CostOracle, Placement]:
    """The cost oracle of a plan (its microbatch size, ZeRO sharding, profile, kernel model) and where its layers
    go: the partition rule resolved on the first replica's devices (tensor shard 0 of each group stands for it).
    ``build_plan`` calls it, and so does the search's fast evaluator for plans of a structure it has built once.

    Raises:
        SpecError: the partition does not fit (see :func:`sim.plan.partition.parse_partition`).
    """
    oracle = inputs_oracle(inputs, graph, profile, topology, layout)
    counts = parse_partition(inputs.partition, oracle, len(vstage_to_rank),
                             tuple(layout.device(rank, 0, 0) for rank in vstage_to_rank))
    return oracle, Placement(counts_to_ranges(counts), vstage_to_rank)


def plan_is_pipeline_only(layout: Parallelism, topology: Topology) -> bool:
    """A pure pipeline over every device of the topology: what plans were before 3D layouts."""
    return layout.is_pure_pipeline and layout.pp == topology.num_ranks


def plan_layout(inputs: PlanInputs, topology: Topology) -> Parallelism:
    """The tensor × data × pipeline layout the user asked for, checked against the topology's device count."""
    devices = topology.num_ranks
    # The layout checks its own fields (one line naming the flag and value) before they are multiplied here.
    asked = Parallelism(tp=inputs.tp, dp=inputs.dp, pp=1 if inputs.pp is None else inputs.pp,
                        order=inputs.rank_order, sequence_parallel=inputs.sequence_parallel, zero=inputs.zero,
                        grad_overlap=inputs.grad_overlap)
    if inputs.devices and len(inputs.devices) != asked.tp * asked.dp * (inputs.pp or 1) and inputs.pp is not None:
        raise SpecError(f"--devices lists {len(inputs.devices)} devices, --tp {asked.tp} × --dp {asked.dp} × --pp "
                        f"{inputs.pp} uses {asked.tp * asked.dp * inputs.pp}")
    if asked.tp * asked.dp > devices:
        raise SpecError(f"--tp {asked.tp} × --dp {asked.dp} = {asked.tp * asked.dp} devices, topology {topology} "
                        f"has {devices}")
    pp = inputs.pp if inputs.pp is not None else devices // (asked.tp * asked.dp)
    if asked.tp * asked.dp * pp > devices:
        raise SpecError(f"--tp {asked.tp} × --dp {asked.dp} × --pp {pp} = {asked.tp * asked.dp * pp} devices, "
                        f"topology {topology} has {devices}")
    return replace(asked, pp=pp, devices=tuple(inputs.devices))


def plan_microbatches(inputs: PlanInputs, layout: Parallelism) -> int | None:
    """Microbatches per iteration: ``--microbatches``, or ``--global-batch / (--microbatch-size · --dp)``, which
    must be whole; ``None`` when neither is given."""
    if inputs.global_batch is None:
        return inputs.microbatches
    g, b, d = inputs.global_batch, inputs.microbatch_size, layout.dp
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise SpecError(f"--global-batch must be an integer >= 1, got {g!r}")
    if g % (b * d):
        raise SpecError(f"--global-batch {g} is not a whole number of microbatches of --microbatch-size {b} on "
                        f"--dp {d} replicas ({g} / ({b} × {d}) = {g / (b * d):g})")
    m = g // (b * d)
    if inputs.microbatches is not None and inputs.microbatches != m:
        raise SpecError(f"--microbatches {inputs.microbatches} disagrees with --global-batch {g} = {m} microbatches × "
                        f"{b} samples × {d} replicas; give one of them")
    return m
