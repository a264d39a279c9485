"""The schedule IR: op records, per-rank programs and the serialisable plan (DESIGN §3).

An op is identified by ``(kind, vstage, mb)`` and prints in the action syntax of PyTorch's
``torch.distributed.pipelining``: ``2F0`` is the forward of virtual stage 2 on microbatch 0, ``3SEND_F1`` sends the
output of stage 3's forward of microbatch 1, ``4RECV_F1`` receives it on stage 4, ``0OPT_STEP`` is the optimizer step
of stage 0. Because a virtual stage lives on exactly one rank, the string is unique within a plan and is the op's id.

Levels:
    * L0 — compute only (F, B, I, W, R): what generators emit and what ``schedule.csv`` holds.
    * L1 — lowered (``sim.plan.lower``): adds SEND/RECV with ``peer`` and ``pair``, OPT_STEP, and every cross-rank or
      cross-stream dependency written out in ``deps``.
    * L2 — a trace of L1 ops with times (``sim.ir.trace``).

The plan carries ids only: no tensors, no times. Costs live in ``sim.cost.cost_view``, timings in the trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sim.core.errors import SpecError
from sim.ir.ops import (
    COMPUTE_KINDS,
    COPY_KINDS,
    DP_KINDS,
    EP_KINDS,
    RECV_KINDS,
    SCHEDULED_KINDS,
    SEND_KINDS,
    TP_KINDS,
    Op,
    OpKind,
    op_id,
    stream_of,
)
from sim.ir.parallel import Parallelism

# The op vocabulary lives in sim.ir.ops; it is re-exported here, where most readers of a plan look for it.
__all__ = [
    "FORMAT_VERSION",
    "OpKind",
    "Op",
    "Placement",
    "Plan",
    "SCHEDULED_KINDS",
    "COMPUTE_KINDS",
    "SEND_KINDS",
    "RECV_KINDS",
    "COPY_KINDS",
    "TP_KINDS",
    "EP_KINDS",
    "DP_KINDS",
    "Parallelism",
    "stream_of",
    "op_id",
]

#: Bumped whenever the JSON layout of :class:`Plan` changes incompatibly.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Placement:
    """Which layers form each virtual stage, and which rank runs it.

    Attributes:
        vstage_layers: ``(start, end)`` half-open layer range of each vstage, contiguous and covering the model.
        vstage_to_rank: rank of each vstage.
    """

    vstage_layers: tuple[tuple[int, int], ...]
    vstage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.vstage_layers) != len(self.vstage_to_rank):
            raise ValueError(
                f"{len(self.vstage_layers)} layer ranges but {len(self.vstage_to_rank)} ranks in the placement"
            )
        expected_start = 0
        for v, (start, end) in enumerate(self.vstage_layers):
            if start != expected_start or end <= start:
                raise ValueError(f"vstage {v} has layer range [{start}, {end}); ranges must be contiguous, non-empty")
            expected_start = end

    @property
    def num_vstages(self) -> int:
        """Number of virtual stages."""
        return len(self.vstage_layers)

    @property
    def num_layers(self) -> int:
        """Number of layers covered."""
        return self.vstage_layers[-1][1] if self.vstage_layers else 0

    def vstages_of(self, rank: int) -> tuple[int, ...]:
        """The vstages placed on ``rank``, ascending."""
        return tuple(v for v, r in enumerate(self.vstage_to_rank) if r == rank)

    def layer_counts(self) -> tuple[int, ...]:
        """Number of layers in each vstage."""
        return tuple(end - start for start, end in self.vstage_layers)


@dataclass(frozen=True, repr=False)
class Plan:
    """Everything needed to simulate or execute one training iteration.

    Attributes:
        schedule: generator name (``"gpipe"``, ``"1f1b"``, ``"file"`` for a loaded CSV).
        level: ``"L0"`` (compute only) or ``"L1"`` (lowered).
        model: canonical model spec (``LayerGraph.spec``), enough to rebuild the model.
        topology: topology spec (``str(Topology)``).
        num_microbatches: microbatches per iteration (per flush).
        microbatch_size: samples per microbatch.
        weight_policy: ``"flush"`` (synchronous update after all microbatches), ``"stash"`` or ``"csp"``.
        placement: layers of each vstage and rank of each vstage.
        programs: per rank, the ops in program order.
        options: generator parameters and other settings, as sorted ``(key, value)`` pairs of JSON scalars.
        parallel: the tensor × data × pipeline layout (:mod:`sim.ir.parallel`); ``None`` for a pure pipeline, whose
            pipeline rank p is device p. Read it through :attr:`layout`.
        subnets: NASPipe CSP only (``weight_policy == "csp"``): the subnet table, one row per subnet in training
            order (subnet id = ``mb``), each row the chosen candidate of every choice block. Empty otherwise.
        format_version: JSON layout version.
    """

    schedule: str
    level: str
    model: str
    topology: str
    num_microbatches: int
    microbatch_size: int
    weight_policy: str
    placement: Placement
    programs: tuple[tuple[Op, ...], ...]
    options: tuple[tuple[str, Any], ...] = ()
    subnets: tuple[tuple[int, ...], ...] = ()
    parallel: Parallelism | None = None
    format_version: int = FORMAT_VERSION
    _index: dict[str, tuple[int, int]] = field(default=None, init=False, repr=False, compare=False)  # type: ignore

    def __repr__(self) -> str:
        """One line: schedule, level, model, topology, layout, batch and size; the programs themselves are
        :meth:`dumps`' (a 16k-device plan's default dataclass repr ran to megabytes)."""
        ops = sum(len(program) for program in self.programs)
        return (f"Plan({self.schedule} {self.level}: {self.model} on {self.topology}, {self.layout.describe()}, "
                f"{self.num_microbatches} microbatches × {self.microbatch_size}, {ops:,} ops on {self.num_ranks:,} "
                f"ranks)")

    def __post_init__(self) -> None:
        if self.level not in ("L0", "L1"):
            raise ValueError(f"plan level must be 'L0' or 'L1', got {self.level!r}")
        if self.num_microbatches < 1 or self.microbatch_size < 1:
            raise ValueError(
                f"microbatches and microbatch size must be >= 1, got {self.num_microbatches}, {self.microbatch_size}"
            )
        if self.parallel is not None:
            if self.parallel.pp != len(self.programs):
                raise ValueError(f"parallel layout has pp = {self.parallel.pp} but the plan has {len(self.programs)} "
                                 f"rank programs")
            if self.parallel.is_pure_pipeline:
                object.__setattr__(self, "parallel", None)  # one spelling of a pure pipeline, so equal plans compare

    @property
    def layout(self) -> Parallelism:
        """The parallel layout, a pure pipeline of :attr:`num_ranks` ranks when the plan has none."""
        return self.parallel if self.parallel is not None else Parallelism(pp=max(len(self.programs), 1))

    @property
    def world_size(self) -> int:
        """Devices the plan runs on: tensor × data × pipeline ranks."""
        return self.layout.world_size

    @property
    def num_ranks(self) -> int:
        """Number of ranks (one program each)."""
        return len(self.programs)

    @property
    def num_vstages(self) -> int:
        """Number of virtual stages."""
        return self.placement.num_vstages

    def op_index(self) -> dict[str, tuple[int, int]]:
        """Map op id → ``(rank, position in that rank's program)``; built once and cached."""
        if self._index is None:
            index: dict[str, tuple[int, int]] = {}
            for rank, program in enumerate(self.programs):
                for pos, op in enumerate(program):
                    if op.id in index:
                        raise SpecError(f"op {op.id} appears twice (rank {index[op.id][0]} and rank {rank})")
                    index[op.id] = (rank, pos)
            object.__setattr__(self, "_index", index)
        return self._index

    def option(self, key: str, default: Any = None) -> Any:
        """The value of one option, or ``default``."""
        return dict(self.options).get(key, default)

    def with_programs(self, programs: tuple[tuple[Op, ...], ...], level: str) -> Plan:
        """A copy with other programs (the lowering passes use this; a Plan is never mutated)."""
        return Plan(
            self.schedule, level, self.model, self.topology, self.num_microbatches, self.microbatch_size,
            self.weight_policy, self.placement, programs, self.options, self.subnets, self.parallel,
            self.format_version,
        )

    # --- canonical JSON -------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The canonical JSON object (see :meth:`dumps`); ``subnets`` only when the plan has a subnet table."""
        body = self.to_json_header()
        body["ranks"] = [[op.to_json() for op in program] for program in self.programs]
        return body

    def to_json_header(self) -> dict[str, Any]:
        """:meth:`to_json` without the rank programs."""
        body = {
            "format": "pipedejavu-plan",
            "format_version": self.format_version,
            "level": self.level,
            "schedule": self.schedule,
            "model": self.model,
            "topology": self.topology,
            "num_microbatches": self.num_microbatches,
            "microbatch_size": self.microbatch_size,
            "weight_policy": self.weight_policy,
            "options": {key: value for key, value in self.options},
            "placement": {
                "vstage_layers": [list(r) for r in self.placement.vstage_layers],
                "vstage_to_rank": list(self.placement.vstage_to_rank),
            },
        }
        if self.subnets:
            body["subnets"] = [list(row) for row in self.subnets]
        if self.parallel is not None:
            body["parallel"] = self.parallel.to_json()
        return body

    def dumps(self) -> str:
        """Canonical text: sorted keys, one op per line, so equal plans give byte-identical files."""
        return "".join(self.iter_dumps())

    def iter_dumps(self) -> Iterator[str]:
        """:meth:`dumps` in consecutive pieces, one op per piece, so a plan of millions of ops can be written
        without its whole text (or a dict per op) in memory at once."""
        body = self.to_json_header()
        head = json.dumps(body, sort_keys=True, indent=1)
        yield head[:-2] + ',\n "ranks": [\n'
        for r, program in enumerate(self.programs):
            yield (",\n" if r else "") + " [\n"
            for i, op in enumerate(program):
                yield (",\n  " if i else "  ") + json.dumps(op.to_json(), sort_keys=True)
            yield "\n ]"
        yield "\n ]\n}\n"

    @classmethod
    def loads(cls, text: str, source: str = "<plan>") -> Plan:
        """Parse a plan written by :meth:`dumps`; SpecError (naming ``source``) on anything malformed."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or data.get("format") != "pipedejavu-plan":
            raise SpecError(f"{source} is not a pipedejavu plan (missing format: pipedejavu-plan)")
        if data.get("format_version") != FORMAT_VERSION:
            raise SpecError(
                f"{source} has format_version {data.get('format_version')!r}; this version reads {FORMAT_VERSION}"
            )
        _only_known_fields(data, _PLAN_FIELDS, source)
        try:
            _only_known_fields(data["placement"], {"vstage_layers", "vstage_to_rank"}, f"{source}: placement")
            placement = Placement(
                tuple((int(a), int(b)) for a, b in data["placement"]["vstage_layers"]),
                tuple(int(r) for r in data["placement"]["vstage_to_rank"]),
            )
            programs = tuple(tuple(Op.from_json(op) for op in program) for program in data["ranks"])
            options = data.get("options", {})
            if not isinstance(options, dict):
                raise SpecError(f"{source}: options must be an object")
            return cls(
                schedule=str(data["schedule"]),
                level=str(data["level"]),
                model=str(data["model"]),
                topology=str(data["topology"]),
                num_microbatches=int(data["num_microbatches"]),
                microbatch_size=int(data["microbatch_size"]),
                weight_policy=str(data["weight_policy"]),
                placement=placement,
                programs=programs,
                options=tuple(sorted(options.items())),
                subnets=_subnet_table(data.get("subnets", []), source),
                parallel=(Parallelism.from_json(data["parallel"], len(programs), source)
                          if "parallel" in data else None),
            )
        except SpecError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"{source} is not a valid plan ({type(exc).__name__}: {exc})") from None


#: Every top-level field of a plan file; anything else is refused by name (a typo must not be silently ignored).
_PLAN_FIELDS = frozenset({"format", "format_version", "level", "schedule", "model", "topology", "num_microbatches",
                          "microbatch_size", "weight_policy", "options", "placement", "ranks", "subnets",
                          "parallel"})


def _only_known_fields(data: Any, known: frozenset[str] | set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise SpecError(f"{where} must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SpecError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; a plan has "
                        f"{', '.join(sorted(known))}")


def _subnet_table(rows: Any, source: str) -> tuple[tuple[int, ...], ...]:
    """The ``subnets`` field: a list of rows of candidate indices (non-negative ints)."""
    if not isinstance(rows, list) or not all(
            isinstance(row, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in row)
            for row in rows):
        raise SpecError(f"{source}: subnets must be a list of lists of candidate indices >= 0")
    return tuple(tuple(row) for row in rows)
