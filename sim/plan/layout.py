"""The tensor × data × pipeline layout and the microbatch count a plan's inputs ask for, checked against the
topology: where :class:`~sim.plan.inputs.PlanInputs`' flags become a :class:`~sim.ir.parallel.Parallelism`.

``build_plan`` derives both first; the search's screen, planner and dp (and the bench's ``sim.bench.fast``) derive
them the same way for candidates they cost without building a whole plan.
"""

from __future__ import annotations

from dataclasses import fields, replace

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.parallel import Parallelism, resolve_reshard_after_forward
from sim.plan.inputs import PlanInputs

__all__ = ["plan_layout", "plan_microbatches", "plan_is_pipeline_only"]


def plan_is_pipeline_only(layout: Parallelism, topology: Topology) -> bool:
    """A pure pipeline over every device of the topology: what plans were before 3D layouts."""
    return layout.is_pure_pipeline and layout.pp == topology.num_ranks


#: The :class:`PlanInputs` field of each :class:`Parallelism` field whose flag says it otherwise (``--rank-order``).
_INPUT_NAMES = {"order": "rank_order"}
#: The layout's fields taken as asked: all but ``pp`` (``None`` in the inputs: the devices left) and ``devices``
#: (checked against the layout's width first). Derived from :class:`Parallelism`, so a layout field the inputs do not
#: carry fails here at once rather than being left at its default.
_ASKED = tuple(item.name for item in fields(Parallelism) if item.name not in ("pp", "devices"))


def plan_layout(inputs: PlanInputs, topology: Topology) -> Parallelism:
    """The tensor × data × pipeline layout the user asked for, checked against the topology's device count."""
    devices = topology.num_ranks
    # The layout checks its own fields (one line naming the flag and value) before they are multiplied here.
    given = {name: getattr(inputs, _INPUT_NAMES.get(name, name)) for name in _ASKED}
    policy = given["reshard_after_forward"]  # a torchtitan policy is resolved once pp is known
    if isinstance(policy, str):
        given["reshard_after_forward"] = True
    asked = Parallelism(pp=1 if inputs.pp is None else inputs.pp, **given)
    width = asked.tp * asked.data_ranks  # devices of one pipeline stage
    named = f"--tp {asked.tp} × --dp {asked.dp}" + (f" × --cp {asked.cp}" if asked.cp > 1 else "")
    if inputs.devices and len(inputs.devices) != width * (inputs.pp or 1) and inputs.pp is not None:
        raise SpecError(f"--devices lists {len(inputs.devices)} devices, {named} × --pp {inputs.pp} uses "
                        f"{width * inputs.pp}")
    if width > devices:
        raise SpecError(f"{named} = {width} devices, topology {topology} has {devices}")
    pp = inputs.pp if inputs.pp is not None else devices // width
    if width * pp > devices:
        raise SpecError(f"{named} × --pp {pp} = {width * pp} devices, topology {topology} has {devices}")
    resolved = (resolve_reshard_after_forward(policy, zero=asked.zero, pp=pp) if isinstance(policy, str)
                else asked.reshard_after_forward)
    return replace(asked, pp=pp, devices=tuple(inputs.devices), reshard_after_forward=resolved)


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
