"""The memory ledger: what each op of a plan allocates and frees on its device, in bytes (DESIGN §6).

Every consumer that needs a device's memory asks this module: the SimPy engine's timeline, the fast evaluator's
peaks (``sim.bench.critical_path``), the search's memory screen (``sim.search.planner``) and the experiments. An op's
memory behaviour is its kind's :class:`~sim.ir.ops.MemoryEffect` and workspace flag (``sim.ir.ops.OP_SEMANTICS``);
the byte counts are the plan's cost view's (``sim.cost.cost_view.CostView``, which asks the oracle). A kind with an
effect this ledger has no rule for cannot reach it: :data:`RULES` covers every effect and a test holds it to that.

NASPipe's CSP runs (``sim.csp``) are the one exception. Their spans are op kinds of the plan's vocabulary, drawn on
the streams ``OP_SEMANTICS`` gives them, but their memory is counted by ``sim.csp.simulate`` (``_hold``), not here:

* what is counted: per stage, what stays resident all run (``StageMemoryModel.static_bytes``: the training state of
  the layers every subnet shares, and of every candidate when no budget moves them), plus
  each subnet's activations from its forward's start (after any copy it waited for) to its backward's end, an amount
  per (subnet, stage) (``activation_bytes[subnet][stage]``), plus, under a parameter budget, the training state of
  the layer keys resident at that moment (``StageMemory.used`` × ``state_per_param_byte``);
* when: the peak is read only when a subnet's activations are taken or freed, so a key copied in and written back
  between two such moments does not raise it, and no op holds a workspace.

Why not here: this ledger charges per-vstage sizes (one activation size per stage) to the ops of fixed programs,
whereas a CSP stage's activations differ per subnet and its copies move single layer keys of varying size, decided
online (``sim.csp.memory``). Charging CSP's PREFETCH and EVICT as ``LOAD_WEIGHTS``/``UNLOAD_WEIGHTS`` of a whole
stage, reading the peak at every op and adding the F and B workspace would give different peaks, so moving CSP onto
this ledger would change its ``metrics.json``; it stays apart, and a test keeps its kinds to the op table.

What a device holds, per rank of the plan (all bytes):

* **Resident from the start**: the training state (weights, gradients, optimizer state; ZeRO-1's share of the
  optimizer state) of every stage the rank runs, except a stage that lives in host memory (one with PREFETCH ops:
  its weights occupy the device from the start of a PREFETCH to the end of the next EVICT). Under weight stashing
  (PipeDream §3.3) the starting weights are copied once more when some microbatch runs its forward on them.
* **Activations** (``KEEP_ACTIVATIONS``, F): one microbatch's activations of the stage from the start of its F to the
  end of its backward (``RELEASE_ACTIVATIONS``, B). When the backward is split (zero bubble, Qi et al. 2023 §2), I
  (``DEFER_WEIGHT_GRADIENTS``) frees them but keeps what the weight gradients need, the weight GEMMs' inputs and
  output gradients (a measured profile's ``deferred_bytes``; where nothing was measured, all of the activations),
  until W (``RELEASE_DEFERRED``) frees it.
* **Full recomputation**: F keeps only the checkpoint, the input of every layer of the stage (Megatron-LM's
  ``uniform`` method with one layer per checkpoint; torchtitan's per-block ``full`` AC); R
  (``REBUILD_ACTIVATIONS``), right before the backward, holds one layer's rebuilt activations at a time, the largest
  layer's, until the backward ends (Chen et al. 2016 §3: each segment is recomputed from its checkpoint and its
  gradients taken before the next segment is recomputed).
* **Weight versions** (``UPDATE_WEIGHTS``, OPT_STEP under weight stashing): version u of a stage is one more copy of
  its weights from the update that makes it until the update of the last microbatch that ran on it; the update first
  retires the version its own microbatch ran on (when it was the last user), then copies the new weights if a later
  forward runs on them.
* **A PARTIME stream** (weight policy ``stream``): a stage holds one frame's activations, its newest forward's (or
  the drain's recompute); a forward replaces the one before it, a backward consumes it.
* **Reduction buffers** (``HOLD_REDUCTION_BUFFER``, REDUCE_GRAD): where the cost source says the framework reduces a
  flat copy of a stage's gradients (the executor's ``executor.data_parallel``): without ZeRO that copy, the
  all-reduce's result, from the reduction's issue until the update that waits for it starts; under ZeRO-1 and 2 the
  copy from the issue until the reduction ends (nothing references it once its reduce-scatter has completed) and the
  replica's slice of the result, 1/D of it, until the update; under ZeRO-2 the copy replaces the microbatch's
  gradients, which are freed as it is taken and made again by the next backward. Nothing where gradients are
  reduced in place (Megatron-LM's contiguous buffer: the model's default).
* **Workspace**: every op whose kind has ``workspace`` holds its stage's transient bytes while it runs, the
  backward's (``backward_workspace_bytes``) for the backward ops (B, I, W), else the forward's. A B's is its
  layer-by-layer peak: going from the last layer to the first, each layer's transient plus the gradient buffers made
  so far, less the activations of the layers already done, which the backward has freed.
* **Gathered parameters** (ZeRO-3, FSDP: ``sim.cost.fsdp``): a forward or backward op also holds, while it runs, the
  parameters it gathers (a layer's and the prefetched next one's) and, in the backward, the whole gradients being
  made and scattered. Without resharding after the forward, the stage's gathered parameters are taken by a forward
  when no microbatch of the stage is in flight and freed when the backward of the last one in flight ends.
* **Gathered for the step** (ZeRO-3 under a pipeline without resharding after the forward,
  ``Parallelism.fsdp_gathers_per_step``, as torchtitan and PyTorch's pipelining run FSDP): each vstage's whole
  (unsharded) parameters are taken by its first forward of the step, and its whole gradients, accumulated over the
  microbatches, by its first backward; both stay until its update starts, which waits for their reduce-scatter
  (the REDUCE_GRAD; FSDP frees them at its end, ``_post_backward``; the update is the first op of the rank's own
  program after it, which keeps this replay exact). So a rank holds the unsharded parameters of every vstage it runs
  for the whole step, and their unsharded gradients from the first backward on, on top of its shards: at its peak
  what ZeRO-1 holds plus the parameter and gradient shards. Its forwards and backwards gather nothing more.
* **Weight gradients**: part of the resident state where the framework keeps a persistent gradient buffer (Megatron's
  contiguous buffer, DDP's buckets: the model's default). Where the cost source says they live per step (a measured
  profile of the executor, whose optimizer step ends with ``zero_grad(set_to_none=True)``), a stage's gradients are
  allocated by its first backward op after an update (or the start) and freed when its update ends; under a split
  backward the I makes those of the parameters outside the weight GEMMs, the W the GEMMs'.

An op's effect at its start is ``(released, allocated)``: ``released`` bytes are freed first (a retired weight
version, a PARTIME frame being replaced), then ``allocated`` bytes are taken, so a peak is read after the allocation.
At its end it frees ``freed`` bytes. Messages, collectives and TP ops allocate nothing here (their buffers are not
modelled yet).

The ledger is stateful (stash versions and PARTIME frames are counted as they go): use one per replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sim.ir.ops import OP_SEMANTICS, Action, MemoryEffect, Op, OpKind
from sim.ir.plan import Plan
from sim.ir.weight_versions import weight_versions

__all__ = ["StageSizes", "ReductionMemory", "IN_PLACE", "MemoryLedger", "RULES", "program_order_peaks",
           "resident_bytes", "kept_bytes"]


@dataclass(frozen=True)
class ReductionMemory:
    """What one data-parallel reduction of a vstage's gradients holds on its device (the module docstring's
    reduction buffers).

    Attributes:
        until_update: bytes held from its issue until the update that waits for it starts.
        until_end: bytes held from its issue until the reduction ends.
        takes_gradients: whether taking its copy frees the microbatch's gradients (the next backward makes them
            afresh).
    """

    until_update: int = 0
    until_end: int = 0
    takes_gradients: bool = False


#: A reduction done in place: it holds nothing.
IN_PLACE = ReductionMemory()


class StageSizes(Protocol):
    """The per-vstage sizes a ledger reads (bytes): :class:`sim.cost.cost_view.CostView` provides them."""

    def state_bytes(self, vstage: int) -> int: ...
    def param_bytes(self, vstage: int) -> int: ...
    def activation_bytes(self, vstage: int) -> int: ...
    def checkpoint_bytes(self, vstage: int) -> int: ...
    def rebuilt_bytes(self, vstage: int) -> int: ...
    def workspace_bytes(self, vstage: int) -> int: ...
    def backward_workspace_bytes(self, vstage: int) -> int: ...
    def backward_peak_bytes(self, vstage: int, new_gradients: bool) -> int: ...
    def deferred_bytes(self, vstage: int) -> int | None: ...
    def input_backward_bytes(self, vstage: int) -> int: ...
    def weight_backward_bytes(self, vstage: int) -> int: ...
    def gradient_bytes(self, vstage: int) -> int: ...
    def deferred_gradient_bytes(self, vstage: int) -> int: ...
    def gradients_per_step(self, vstage: int) -> bool: ...
    def reduction_memory(self, vstage: int) -> ReductionMemory: ...
    def held_gradient_bytes(self, vstage: int) -> int: ...
    def gathered_bytes(self, vstage: int, backward: bool) -> int: ...
    def held_gathered_bytes(self, vstage: int) -> int: ...


#: Every memory effect of ``sim.ir.ops`` has a rule in :class:`MemoryLedger`: the name of the method that applies it
#: at the op's start (the end is :meth:`MemoryLedger.end`).
RULES: dict[MemoryEffect, str] = {
    MemoryEffect.NONE: "_nothing",
    MemoryEffect.KEEP_ACTIVATIONS: "_keep",
    MemoryEffect.REBUILD_ACTIVATIONS: "_rebuild",
    MemoryEffect.RELEASE_ACTIVATIONS: "_nothing",  # frees at the op's end
    MemoryEffect.DEFER_WEIGHT_GRADIENTS: "_nothing",  # frees at the op's end
    MemoryEffect.RELEASE_DEFERRED: "_nothing",  # frees at the op's end
    MemoryEffect.UPDATE_WEIGHTS: "_update",
    MemoryEffect.LOAD_WEIGHTS: "_load",
    MemoryEffect.UNLOAD_WEIGHTS: "_nothing",  # frees at the op's end
    MemoryEffect.HOLD_REDUCTION_BUFFER: "_hold_reduction",  # freed at its end and at the update (docstring)
}


class MemoryLedger:
    """The bytes each op of ``plan`` allocates and frees on its device, with ``sizes`` the plan's cost view of one
    replica (module docstring). Ranks are the plan's pipeline ranks.

    Raises:
        KeyError: the plan uses a memory effect with no rule (never for the kinds of ``sim.ir.ops``).
    """

    def __init__(self, plan: Plan, sizes: StageSizes) -> None:
        self.plan, self.sizes = plan, sizes
        self._effect = {kind: semantics.memory for kind, semantics in OP_SEMANTICS.items()}
        effects = {self._effect[kind] for kind in {op.kind for program in plan.programs for op in program}}
        missing = effects - RULES.keys()
        if missing:
            raise KeyError(f"the memory ledger has no rule for effect(s) {', '.join(sorted(missing))}")
        self._start_rule = {kind: getattr(self, RULES[semantics.memory]) for kind, semantics in OP_SEMANTICS.items()}
        self._workspace = {kind for kind, semantics in OP_SEMANTICS.items() if semantics.workspace}
        self._backward = {kind for kind, semantics in OP_SEMANTICS.items() if semantics.backward}
        # Byte counts that depend only on the op's kind and stage and the flags in their keys, asked of the cost view
        # once per run rather than once per op (a replay asks for every op).
        self._workspace_memo: dict[tuple[OpKind, int, int, bool], int] = {}
        self._kept_memo: dict[tuple[int, bool], int] = {}  # (vstage, recomputed) -> what its forward keeps
        self._held_memo: dict[tuple[int, bool], int] = {}  # (vstage, recomputed) -> what its last backward frees
        self._per_step_memo: dict[int, bool] = {}  # vstage -> whether its gradients live per step
        # vstage -> bytes of its per-step gradient buffers that exist now (all of them, or an I's share)
        self.gradients_held: dict[int, int] = {}
        self.deferred: dict[tuple[int, int | None], int] = {}  # (vstage, mb) -> bytes its I kept for its W
        self.reductions: dict[int, int] = {}  # vstage -> bytes its issued gradient reductions hold until the update
        self.reducing: dict[tuple[int, int | None], int] = {}  # running reduction -> bytes freed when it ends
        self.workspaces: dict[tuple[OpKind, int, int | None], int] = {}  # running op -> the workspace it took
        self.offloaded = ({op.vstage for program in plan.programs for op in program
                           if self._effect[op.kind] is MemoryEffect.LOAD_WEIGHTS}
                          if MemoryEffect.LOAD_WEIGHTS in effects else set())
        self.recomputed = ({(op.vstage, op.mb) for program in plan.programs for op in program
                            if self._effect[op.kind] is MemoryEffect.REBUILD_ACTIVATIONS}
                           if MemoryEffect.REBUILD_ACTIVATIONS in effects else set())
        self.is_partime = plan.weight_policy == "stream"
        self.held: dict[int, int] = {}  # PARTIME: vstage -> activation bytes of its current frame
        self.in_flight: dict[int, int] = {}  # ZeRO-3 kept gathered: vstage -> microbatches between F and backward
        # ZeRO-3 gathered for the step: vstage -> whole parameter (and, after its first backward, gradient) bytes.
        self.per_step = plan.layout.fsdp_gathers_per_step
        self.step_held: dict[int, int] = {}
        self.step_gradients: set[int] = set()
        # Weight stashing: (vstage, version) -> microbatches still to run on it; the updates each vstage has made.
        self.versions = weight_versions(plan) if plan.weight_policy == "stash" else {}
        self.stash_users: dict[tuple[int, int], int] = {}
        for (v, _), u in self.versions.items():
            self.stash_users[(v, u)] = self.stash_users.get((v, u), 0) + 1
        self.updates = [0] * plan.num_vstages

    # --- the three questions -----------------------------------------------------------------------------------------

    def resident(self, rank: int) -> int:
        """Bytes ``rank`` holds before its first op: its stages' training state (not a stage living in host memory)
        and, under weight stashing, the copy of a stage's starting weights some forward runs on."""
        vstages = [v for v in self.plan.placement.vstages_of(rank) if v not in self.offloaded]
        stashed = [v for v in vstages if (v, 0) in self.stash_users]
        return resident_bytes(self.sizes, vstages) + sum(self.sizes.param_bytes(v) for v in stashed)

    def start(self, op: Op) -> tuple[int, int]:
        """``(released, allocated)`` bytes when ``op`` starts: ``released`` is freed first, then ``allocated`` taken."""
        kind = op.kind
        released, kept = self._start_rule[kind](op)
        gradients = self._new_gradients(op) if kind in self._backward else 0
        if self.per_step and kind in self._backward and op.vstage not in self.step_gradients:
            self.step_gradients.add(op.vstage)  # the step's whole gradients, accumulated until the reduce-scatter
            whole = self.sizes.held_gradient_bytes(op.vstage)
            self.step_held[op.vstage] = self.step_held.get(op.vstage, 0) + whole
            kept += whole
        workspace = self._workspace_of(op, new_gradients=gradients) if kind in self._workspace else 0
        if workspace:
            self.workspaces[(kind, op.vstage, op.mb)] = workspace
        return released, workspace + kept + gradients

    def end(self, op: Op) -> int:
        """Bytes freed when ``op`` ends: its workspace, and what its effect releases. Negative when the op leaves
        more than it frees (an I whose weight-gradient inputs outweigh the activations it drops): the caller then
        allocates, and checks its peak."""
        kind, vstage, sizes = op.kind, op.vstage, self.sizes
        freed = self.workspaces.pop((kind, vstage, op.mb), 0) if self.workspaces else 0
        effect = self._effect[kind]
        if effect is MemoryEffect.NONE:
            return freed
        if effect is MemoryEffect.RELEASE_ACTIVATIONS:
            freed += self.held.pop(vstage, 0) if self.is_partime else self._held_until_backward(vstage, op.mb)
            freed += self._release_kept(vstage)
        elif effect is MemoryEffect.DEFER_WEIGHT_GRADIENTS:
            held = self._held_until_backward(vstage, op.mb)
            deferred = sizes.deferred_bytes(vstage)
            kept = held if deferred is None else deferred
            self.deferred[(vstage, op.mb)] = kept
            freed += held - kept
        elif effect is MemoryEffect.RELEASE_DEFERRED:
            freed += self.deferred.pop((vstage, op.mb), 0)
        elif effect is MemoryEffect.UNLOAD_WEIGHTS:
            freed += sizes.param_bytes(vstage)
        elif effect is MemoryEffect.UPDATE_WEIGHTS and vstage in self.gradients_held:
            freed += self.gradients_held.pop(vstage)  # zero_grad(set_to_none=True) after the step
        elif effect is MemoryEffect.HOLD_REDUCTION_BUFFER and self.reducing:
            freed += self.reducing.pop((vstage, op.mb), 0)
        return freed

    def _workspace_of(self, op: Op, *, new_gradients: int) -> int:
        """The transient bytes ``op`` (a kind with a workspace) holds while it runs; asked of the cost view once per
        kind, stage, gradient bytes made and recomputation (:meth:`_workspace_bytes`)."""
        kind, vstage = op.kind, op.vstage
        recomputed = kind is OpKind.B and (vstage, op.mb) in self.recomputed
        key = (kind, vstage, new_gradients, recomputed)
        found = self._workspace_memo.get(key)
        if found is None:
            found = self._workspace_memo[key] = self._workspace_bytes(kind, vstage, new_gradients, recomputed)
        return found

    def _workspace_bytes(self, kind: OpKind, vstage: int, new_gradients: int, recomputed: bool) -> int:
        """The transient bytes an op of ``kind`` (one with a workspace) of ``vstage`` holds while it runs: the
        backward's for B, I and W (a B's layer by layer, with the gradient buffers it makes; a ``recomputed`` one
        holds a single rebuilt layer, so its layers' largest transient), else the forward's. A B's may be negative:
        its peak is below the level it starts from. An I or W that makes ``new_gradients`` bytes of gradient buffers
        makes them from the temporaries its measured transient already holds, so those are not counted twice."""
        backward = kind in self._backward
        gathered = self.sizes.gathered_bytes(vstage, backward)
        if backward:
            if kind is OpKind.B and not self.is_partime and not recomputed:
                return self.sizes.backward_peak_bytes(vstage, new_gradients > 0) + gathered
            transient = (self.sizes.input_backward_bytes(vstage) if kind is OpKind.I
                         else self.sizes.weight_backward_bytes(vstage) if kind is OpKind.W
                         else self.sizes.backward_workspace_bytes(vstage))
            return max(0, transient - new_gradients) + gathered
        return self.sizes.workspace_bytes(vstage) + gathered

    def _new_gradients(self, op: Op) -> int:
        """Bytes of gradient buffers ``op`` creates where gradients live per step: a stage's first backward op since
        its last update makes them, except that under a split backward the I makes only those of the parameters
        outside the weight GEMMs and the W the GEMMs' (``deferred_gradient_bytes``)."""
        vstage, sizes = op.vstage, self.sizes
        if op.kind not in self._backward:
            return 0
        per_step = self._per_step_memo.get(vstage)
        if per_step is None:
            per_step = self._per_step_memo[vstage] = sizes.gradients_per_step(vstage)
        if not per_step:
            return 0
        total, held = sizes.gradient_bytes(vstage), self.gradients_held.get(vstage, 0)
        wanted = total - sizes.deferred_gradient_bytes(vstage) if op.kind is OpKind.I else total
        if held >= wanted:
            return 0
        self.gradients_held[vstage] = wanted
        return wanted - held

    # --- rules at an op's start: (released, kept beyond the workspace) -----------------------------------------------

    def _nothing(self, op: Op) -> tuple[int, int]:
        return 0, 0

    def _keep(self, op: Op) -> tuple[int, int]:
        if self.is_partime:
            return self._replace_frame(op.vstage)
        gathered = self._gather_kept(op.vstage)
        key = (op.vstage, (op.vstage, op.mb) in self.recomputed)
        kept = self._kept_memo.get(key)
        if kept is None:
            kept = self._kept_memo[key] = kept_bytes(self.sizes, op.vstage, recomputed=key[1])
        return 0, kept + gathered

    def _gather_kept(self, vstage: int) -> int:
        """ZeRO-3 without resharding after the forward: the stage's gathered parameters, taken by the forward that
        finds no microbatch of the stage in flight."""
        held = self.sizes.held_gathered_bytes(vstage)
        if not held:
            return 0
        if self.per_step:  # gathered once for the step, by its first forward (module docstring)
            if vstage in self.step_held:
                return 0
            self.step_held[vstage] = held
            return held
        self.in_flight[vstage] = self.in_flight.get(vstage, 0) + 1
        return held if self.in_flight[vstage] == 1 else 0

    def _release_kept(self, vstage: int) -> int:
        """The other half of :meth:`_gather_kept`: the backward of the last microbatch in flight frees them."""
        if vstage not in self.in_flight:
            return 0
        self.in_flight[vstage] -= 1
        if self.in_flight[vstage]:
            return 0
        del self.in_flight[vstage]
        return self.sizes.held_gathered_bytes(vstage)

    def _rebuild(self, op: Op) -> tuple[int, int]:
        if self.is_partime:  # the drain's recompute: a whole frame again
            return self._replace_frame(op.vstage)
        return 0, self.sizes.rebuilt_bytes(op.vstage)

    def _hold_reduction(self, op: Op) -> tuple[int, int]:
        held = self.sizes.reduction_memory(op.vstage)
        if held.until_update:
            self.reductions[op.vstage] = self.reductions.get(op.vstage, 0) + held.until_update
        if held.until_end:
            self.reducing[(op.vstage, op.mb)] = held.until_end
        # ZeRO-2's copy replaces the microbatch's gradients, which the next backward makes afresh (_new_gradients).
        dropped = self.gradients_held.pop(op.vstage, 0) if held.takes_gradients else 0
        return dropped, held.until_update + held.until_end

    def _update(self, op: Op) -> tuple[int, int]:
        reduced = self.reductions.pop(op.vstage, 0)  # the update has waited for its reduction, whose buffer goes
        if self.step_held:  # and, gathered for the step, the vstage's whole parameters and gradients with it
            reduced += self.step_held.pop(op.vstage, 0)
            self.step_gradients.discard(op.vstage)
        if not self.versions or op.mb is None:
            return reduced, 0
        vstage, sizes = op.vstage, self.sizes
        key = (vstage, self.versions[(vstage, op.mb)])
        self.stash_users[key] -= 1
        released = sizes.param_bytes(vstage) if self.stash_users[key] == 0 else 0
        self.updates[vstage] += 1
        kept = sizes.param_bytes(vstage) if (vstage, self.updates[vstage]) in self.stash_users else 0
        return released + reduced, kept

    def _load(self, op: Op) -> tuple[int, int]:
        return 0, self.sizes.param_bytes(op.vstage)

    def _replace_frame(self, vstage: int) -> tuple[int, int]:
        """A PARTIME stage's forward (or the drain's recompute) replaces the stage's frame: a warm-up forward that no
        gradient came back for is dropped."""
        kept = self.sizes.activation_bytes(vstage)
        released = self.held.get(vstage, 0)
        self.held[vstage] = kept
        return released, kept

    def _held_until_backward(self, vstage: int, mb: int | None) -> int:
        """What a microbatch's last backward op frees: its activations, or under recomputation its checkpoint and
        the layer it rebuilt."""
        key = (vstage, (vstage, mb) in self.recomputed)
        held = self._held_memo.get(key)
        if held is None:
            sizes = self.sizes
            held = self._held_memo[key] = (sizes.checkpoint_bytes(vstage) + sizes.rebuilt_bytes(vstage) if key[1]
                                           else sizes.activation_bytes(vstage))
        return held


def resident_bytes(sizes: StageSizes, vstages: Sequence[int], *, stashing: bool = False) -> int:
    """Bytes of training state ``vstages`` hold on their device from the start: weights, optimizer state and the
    gradient buffers that persist across steps (not those a cost source says live per step); under weight stashing
    (``stashing``) also the copy of the starting weights the first forwards run on."""
    state = sum(sizes.state_bytes(v) - (sizes.gradient_bytes(v) if sizes.gradients_per_step(v) else 0)
                for v in vstages)
    return state + (sum(sizes.param_bytes(v) for v in vstages) if stashing else 0)


def kept_bytes(sizes: StageSizes, vstage: int, *, recomputed: bool) -> int:
    """Bytes one microbatch's forward of ``vstage`` keeps until its backward: its activations, or under
    recomputation only its checkpoint (module docstring)."""
    return sizes.checkpoint_bytes(vstage) if recomputed else sizes.activation_bytes(vstage)


def program_order_peaks(plan: Plan, views: Sequence[StageSizes]) -> tuple[int, ...]:
    """The highest memory of each simulated rank (``i · P + p``: pipeline rank p of view i), bytes, replayed in
    program order without times.

    Exact, equal to the engine's peak, for every plan without host copies whose data-parallel collectives free
    nothing when they end: memory then changes only when the rank's own ops start and end, and those run one after
    another in program order. A data-parallel collective runs beside them and ends at a time program order does not
    know; what it frees at its end (a ZeRO-1 or ZeRO-2 reduce-scatter's flat input copy, under a cost source that
    copies) is freed here as it starts, no later than the engine frees it: the replay's peak is then a lower bound of
    the engine's, so a plan it says does not fit does not (the search's refusals stay sound). A plan with PREFETCH or
    EVICT (whose copies start when their deps are done, not when issued) is refused.

    Raises:
        ValueError: the plan has host copies.
    """
    if any(OP_SEMANTICS[op.kind].action is Action.HOST_COPY for program in plan.programs for op in program):
        raise ValueError("a plan with host copies (PREFETCH/EVICT) changes memory off its program order: simulate it")
    peaks = []
    for view in views:
        ledger = MemoryLedger(plan, view)
        for rank, program in enumerate(plan.programs):
            memory = peak = ledger.resident(rank)
            for op in program:
                released, allocated = ledger.start(op)
                memory += allocated - released
                peak = max(peak, memory)
                memory -= ledger.end(op)
                peak = max(peak, memory)  # an op may leave more than it frees
            peaks.append(peak)
    return tuple(peaks)
