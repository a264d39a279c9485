"""What a topology spec or file says, before any server is wired: groups of identical servers and the network.

Reading a topology goes one way: :mod:`sim.hw.grammar` parses the text (a compact spec or a YAML file) into a
:class:`ClusterDescription`, checking its syntax, its counts and its names (devices and links are looked up in the
catalog); :mod:`sim.hw.servers` turns the description into the servers it describes (each one's wiring and NIC ports,
one fabric for all, the slowed devices); :mod:`sim.hw.link_graph` builds their link graph. Nothing in the description is
derived from another field, so the description is exactly what was written, and ``repeat`` keeps identical servers
as one entry however many there are.

A description may describe at most :data:`MAX_RANKS` ranks, checked (:func:`check_rank_count`) while the text is
read, before any server is listed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.hw.catalog import DeviceSpec, LinkSpec

__all__ = ["ServerGroup", "ClusterDescription", "MAX_RANKS", "MAX_RANKS_REASON", "check_rank_count"]

#: The largest topology accepted, in ranks: over five times the largest run in the reference (Megatron, 3072 GPUs,
#: hardware.md §3), and its link graph already takes about 2 s and 100 MB to build. Every spec and topology file is
#: checked against it (:func:`check_rank_count`) before any server list or graph is built, so a count such as
#: ``repeat: 10000000000`` costs nothing.
MAX_RANKS = 16384

#: Why :data:`MAX_RANKS`, for the error line.
MAX_RANKS_REASON = "over 5x the largest published pipeline-parallel run, 3072 GPUs; the link graph grows with it"


def check_rank_count(ranks: int, what: str) -> None:
    """Raise :class:`SpecError` if ``ranks`` exceeds :data:`MAX_RANKS` (call it before building anything); the
    message is ``what``, the count, the limit and why (``what`` ends in a verb: ``"'3000x8xV100' would make"``)."""
    if ranks > MAX_RANKS:
        raise SpecError(f"{what} {ranks} ranks; at most {MAX_RANKS} are supported ({MAX_RANKS_REASON})")


@dataclass(frozen=True)
class ServerGroup:
    """``repeat`` identical servers of ``count`` × ``device``, as one term of a spec or one ``nodes:`` entry wrote
    them.

    Attributes:
        device: the device of every GPU (the catalog's entry for the name written, or the preset's).
        count: GPUs per server, >= 1.
        repeat: servers in the group, >= 1.
        intra: the wiring asked for (a file's ``intra:``, a preset's), or ``None``: the device's default.
        preset: the preset the servers are (``"dgx-a100"``), or ``""``.
        network: a preset's NIC port type, or ``None``: the device's default.
        nics: a preset's NIC ports per server, or ``None``: the device's default.
        name: the device name as a compact spec's term wrote it (``"V100"``), or ``""`` for a file's entry or a
            preset: a server too large for its device is then reported in the grammar's words, with an example
            (``write MxNxDEVICE, e.g. Mx16xV100``).
        where: what an error about the group begins with: ``bad topology 'SPEC': 'TERM'`` or
            ``topology file 'F': nodes[i]``.
    """

    device: DeviceSpec
    count: int
    repeat: int = 1
    intra: str | None = None
    preset: str = ""
    network: LinkSpec | None = None
    nics: int | None = None
    name: str = ""
    where: str = ""

    @property
    def ranks(self) -> int:
        """GPUs in the group: ``repeat`` × ``count``."""
        return self.repeat * self.count


@dataclass(frozen=True)
class ClusterDescription:
    """A whole topology as written: its server groups in rank order and what applies to all of them.

    Attributes:
        spec: the compact spec or the file's path, as given.
        groups: the server groups; ranks are numbered group by group, server by server.
        network: a file's ``network:``, one NIC port type for every server, or ``None``: the slowest of the
            servers' own.
        nics_per_node: a file's ``nics_per_node:``, or ``None``: each server's own.
        slowdown: a file's ``slowdown:``, ``(rank, factor)`` pairs in the order written, each factor in
            ``[1, MAX_SLOWDOWN]`` (:func:`sim.hw.catalog.slowed_device`); empty when none.
    """

    spec: str
    groups: tuple[ServerGroup, ...]
    network: LinkSpec | None = None
    nics_per_node: int | None = None
    slowdown: tuple[tuple[int, float], ...] = ()

    @property
    def ranks(self) -> int:
        """GPUs in the topology."""
        return sum(group.ranks for group in self.groups)
