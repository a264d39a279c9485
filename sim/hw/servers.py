"""From a topology's description to its servers: each group's wiring and NIC ports, one fabric, the slowed devices.

The second of the three steps of :meth:`sim.hw.topology.Topology.parse` (the text is read by :mod:`sim.hw.grammar`,
the servers' link graph built by :func:`sim.hw.link_graph.build_graph`). For each
:class:`~sim.hw.description.ServerGroup`, in rank order:

* its server is the one a real system of ``count`` × ``device`` is (:func:`sim.hw.node_shapes.default_shape`: the
  wiring, unless the group asks for one, and the NIC ports), a preset's with the preset's own ports; a server that
  cannot be built (too many devices for any wiring of them, a wiring the device cannot have) is an error naming the
  group;
* ``repeat`` copies of it follow one another;
* a compact ``NxDEVICE`` of a rack-scale device (GB200 and GB300 NVL72) larger than one NVLink domain is N GPUs in
  domains of 72, the last one partial (:data:`sim.hw.node_shapes.RACK_SCALE`).

Then every server gets the same NIC port type, the description's ``network`` or the slowest of their own
(:func:`unify_network`: a heterogeneous cluster shares one fabric), and the ranks of ``slowdown`` get a
device that many times slower (:attr:`sim.hw.node_shapes.NodeShape.slowdown`).
"""

from __future__ import annotations

from dataclasses import replace

from sim.core.errors import SpecError
from sim.hw.catalog import LinkSpec
from sim.hw.description import ClusterDescription, ServerGroup
from sim.hw.node_shapes import RACK_SCALE, NodeShape, default_shape, max_gpus_per_node

__all__ = ["server_shapes", "unify_network"]


def server_shapes(description: ClusterDescription) -> list[NodeShape]:
    """The servers ``description`` describes, in rank order (module docstring).

    Raises:
        SpecError: a group's server cannot be built (the message begins with the group's ``where``), or
            ``nics_per_node`` does not fit a server whose GPUs have one NIC each.
    """
    shapes: list[NodeShape] = []
    for group in description.groups:
        if group.name and group.device.name in RACK_SCALE and group.count > max_gpus_per_node(group.device):
            shapes += _racks(group) * group.repeat
            continue
        shapes += [_server(group)] * group.repeat
    shapes = unify_network(shapes, description.network, description.nics_per_node)
    return _slow_down(shapes, dict(description.slowdown)) if description.slowdown else shapes


def _racks(group: ServerGroup) -> list[NodeShape]:
    """``group.count`` GPUs of a rack-scale device (GB200, GB300) in full NVLink domains of 72 and, as a scheduler
    hands them out, a last partial one."""
    limit = max_gpus_per_node(group.device)
    full, rest = divmod(group.count, limit)
    sizes = [limit] * full + ([rest] if rest else [])
    return [default_shape(group.device, size, group.intra) for size in sizes]


def _server(group: ServerGroup) -> NodeShape:
    """One server of ``group``."""
    if group.name:  # a compact spec's term: too large a server is answered in the grammar's words
        limit = max_gpus_per_node(group.device)
        if group.count > limit:
            hint = (f"{group.count // limit}x{limit}x{group.name}" if group.count % limit == 0
                    else f"Mx{limit}x{group.name}")
            raise SpecError(f"{group.where}: one server holds at most {limit} x {group.device.name}; write "
                            f"MxNxDEVICE, e.g. {hint}")
    try:
        shape = default_shape(group.device, group.count, group.intra)
    except SpecError as exc:
        raise SpecError(f"{group.where}: {exc}") from None
    if group.preset:
        shape = replace(shape, network=group.network, nics=group.nics, preset=group.preset)
    return shape


def _slow_down(shapes: list[NodeShape], factors: dict[int, float]) -> list[NodeShape]:
    """``shapes`` with ``factors`` (global rank → factor) written into each server's :attr:`NodeShape.slowdown`."""
    slowed, first = [], 0
    for shape in shapes:
        own = tuple(factors.get(rank, 1.0) for rank in range(first, first + shape.count))
        first += shape.count
        slowed.append(replace(shape, slowdown=own) if any(f != 1.0 for f in own) else shape)
    return slowed


def unify_network(shapes: list[NodeShape], network: LinkSpec | None = None, nics: int | None = None) -> list[NodeShape]:
    """Give every server the same NIC port type, by default the slowest of their own (fabric speed).

    A heterogeneous cluster shares one fabric, so it runs every port at the speed of the slowest server's NICs
    (lowest effective bandwidth; ties: higher latency, then name). Each server keeps its own port count unless
    ``nics`` is given.

    Raises:
        SpecError: ``nics`` differs from the GPU count of a server whose GPUs have one NIC each (a GH200 node).
    """
    if network is None:
        network = min((s.network for s in shapes), key=lambda link: (link.bandwidth, -link.latency, link.name))
    for s in shapes:
        if nics is not None and s.nic_per_gpu and nics != s.count:
            raise SpecError(f"nics_per_node {nics} does not fit a server of {s.count} x {s.device.name}: each of its "
                            f"GPUs has its own NIC, so it has {s.count}")
    return [replace(s, network=network, nics=s.nics if nics is None else nics) for s in shapes]
