"""The published rows a second opinion is asked on (:mod:`experiments.second_opinion`): torchtitan's current rows
and Megatron-Bridge's newest expressible ones, each as its own experiment turns it into ``sim.run`` inputs and predicts
it, the rows refused and why, what makes rows one search problem, and a row's plan as a search candidate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from experiments import megatron_bridge, torchtitan
from sim.core.errors import SpecError
from sim.plan.inputs import PlanInputs
from sim.search.space import MODEL_PRECISION, Candidate, SearchProblem

__all__ = ["Published", "Refused", "SOURCES", "QUICK_ROWS", "load_published", "problem_key", "published_candidate"]

SOURCES = ("torchtitan", "megatron-bridge")
#: Rows of ``--quick``: one 8-GPU torchtitan row and two 8-GPU Megatron-Bridge rows of one problem.
QUICK_ROWS = ("torchtitan:tt2412_t1_1", "megatron-bridge:199", "megatron-bridge:208")


@dataclass(frozen=True)
class Published:
    """One published row, as the search sees it.

    Attributes:
        source: ``torchtitan`` or ``megatron-bridge``.
        row_id: the row's name in its file (torchtitan's ``row_id``; Megatron-Bridge's CSV line).
        model: the published model name.
        gpus: GPUs of the run.
        seq: tokens per sample.
        inputs: the row's ``sim.run`` inputs (its experiment's ``plan_inputs``).
        published_tokens_per_s_per_gpu: the published, measured throughput, tokens/s per GPU.
        predicted_tokens_per_s_per_gpu: its experiment's prediction of the row (``predict_row``), tokens/s per GPU.
        unmodelled: what of the row that prediction assumes or leaves out (its experiment's words).
    """

    source: str
    row_id: str
    model: str
    gpus: int
    seq: int
    inputs: PlanInputs
    published_tokens_per_s_per_gpu: float
    predicted_tokens_per_s_per_gpu: float
    unmodelled: tuple[str, ...]

    @property
    def key(self) -> str:
        """``source:row_id``, what ``--rows`` takes."""
        return f"{self.source}:{self.row_id}"


@dataclass(frozen=True)
class Refused:
    """A published row not searched, and why."""

    source: str
    row_id: str
    model: str
    gpus: int
    reason: str


def _torchtitan_rows(wanted: Callable[[str], bool]) -> tuple[list[Published], list[Refused]]:
    found, refused = [], []
    for row in torchtitan.load_rows():
        if not wanted(f"torchtitan:{row.row_id}"):
            continue
        try:
            result = torchtitan.predict_row(row)
        except SpecError as exc:
            refused.append(Refused("torchtitan", row.row_id, row.model, row.gpus, str(exc)))
            continue
        found.append(Published("torchtitan", row.row_id, row.model, row.gpus, row.seq, torchtitan.plan_inputs(row),
                               row.tokens_per_s_per_gpu, result.predicted, result.unmodelled))
    return found, refused


def _megatron_rows(wanted: Callable[[str], bool]) -> tuple[list[Published], list[Refused], int]:
    rows = megatron_bridge.load_rows()
    refused = [Refused("megatron-bridge", str(row.line), row.model, row.gpus, reason)
               for row in rows if (reason := megatron_bridge.expressible(row)) is not None]
    chosen = [row for row in rows if megatron_bridge.expressible(row) is None]
    current = megatron_bridge.newest(chosen)
    found = []
    for row in (row for row, now in zip(chosen, current, strict=True) if now):
        if not wanted(f"megatron-bridge:{row.line}"):
            continue
        result = megatron_bridge.predict_row(row)
        found.append(Published("megatron-bridge", str(row.line), row.model, row.gpus, row.seq,
                               megatron_bridge.plan_inputs(row), row.tokens_per_s_per_gpu, result.predicted,
                               result.unmodelled))
    return found, refused, len(chosen) - sum(current)


def load_published(keys: Sequence[str] | None = None) -> tuple[list[Published], list[Refused], int]:
    """Every published row searched (torchtitan's in file order, then Megatron-Bridge's), the rows refused and the
    superseded Megatron-Bridge rows' count; with ``keys`` (``source:row_id``), only those rows, in file order (and
    none refused or superseded).

    Raises:
        SpecError: a key that names no row searched (unknown, refused or superseded).
    """
    wanted = set(keys or ())
    titan, titan_refused = _torchtitan_rows(lambda key: keys is None or key in wanted)
    bridge, bridge_refused, superseded = _megatron_rows(lambda key: keys is None or key in wanted)
    rows = titan + bridge
    if keys is None:
        return rows, titan_refused + bridge_refused, superseded
    unknown = [key for key in keys if key not in {row.key for row in rows}]
    if unknown:
        raise SpecError(f"{{rows}}: no published row {', '.join(map(repr, unknown))} to search (rows are "
                        f"SOURCE:ID with SOURCE one of {', '.join(SOURCES)}, e.g. {QUICK_ROWS[0]}; refused and "
                        "superseded rows are not searched)", "rows")
    return rows, [], 0


def problem_key(row: Published) -> tuple:
    """What makes two rows one problem: model (with its sequence), topology, global batch, precision, compile, loss,
    blocks, freed stage outputs, recomputed modules."""
    inputs = row.inputs
    return (inputs.model, inputs.topology, inputs.global_batch, inputs.precision, inputs.compiled, inputs.loss,
            inputs.blocks, inputs.deallocate_pipeline_outputs, inputs.recompute_modules)


def published_candidate(inputs: PlanInputs) -> tuple[Candidate, tuple[str, ...]]:
    """``inputs`` as a search candidate, and the options of ``inputs`` it cannot carry (each ``name=value``): the
    fields in which the candidate's own inputs differ from ``inputs``."""
    candidate = Candidate(
        tp=inputs.tp, dp=inputs.dp, pp=inputs.pp or 1, microbatch_size=inputs.microbatch_size,
        schedule=inputs.schedule, chunks=inputs.chunks, recompute=inputs.recompute_mode,
        sequence_parallel=inputs.sequence_parallel, zero=inputs.zero, rank_order=inputs.rank_order,
        partition=inputs.partition, devices=inputs.devices, cp=inputs.cp, cp_comm=inputs.cp_comm,
        dp_replicate=inputs.dp_replicate, precision=inputs.precision or MODEL_PRECISION, compiled=inputs.compiled,
        ep=inputs.ep, etp=inputs.etp)
    problem = SearchProblem(inputs.model, inputs.topology, inputs.global_batch or 0, profile=inputs.profile,
                            kernel_model=inputs.kernel_model, loss=inputs.loss, blocks=inputs.blocks,
                            deallocate_pipeline_outputs=inputs.deallocate_pipeline_outputs,
                            recompute_modules=inputs.recompute_modules)
    own = replace(candidate.plan_inputs(problem), recompute=inputs.recompute)
    left = tuple(f"{f.name}={getattr(inputs, f.name)!r}" for f in fields(PlanInputs)
                 if getattr(inputs, f.name) != getattr(own, f.name))
    return candidate, left
