"""The simulator from Python: build a plan, simulate it, search a cluster, and read every result as plain data.

For notebooks and scripts, the same library calls as the commands underneath (``sim.run`` and ``sim.search``):
:func:`plan` resolves its arguments into :class:`sim.plan.inputs.PlanInputs` and builds the plan with
:func:`sim.plan.build.build_plan`; :func:`simulate` predicts it with :func:`sim.predict.predict`, the one prediction
path; :func:`search` runs :func:`sim.search.search.run_search`. So a figure here is the figure the command prints,
and a plan written here is the ``plan.json`` the executor runs.

Results are plain data first: numbers, ``dict`` and ``list`` rows with units in their names (``_s`` seconds,
``_bytes`` bytes); where pandas is installed, the same rows as a ``DataFrame`` (pandas is optional and imported only
then); the Gantt chart as a matplotlib figure, which a notebook shows inline (matplotlib imported only then).

Example::

    from sim import api

    built = api.plan("gpt:layers=24,hidden=2048", "8xA100", schedule="1f1b", microbatches=16)
    run = api.simulate(built)
    run.iteration_time_s, run.devices()        # seconds; one dict per device
    run.gantt()                                 # the timeline

Bad arguments raise :class:`sim.core.errors.SpecError` with the same message the commands print after ``error:``; a
plan that does not fit its devices' memory raises :class:`sim.engine.simpy_engine.OutOfMemoryError` (a ``SpecError``)
naming the settings that would make it fit, as ``sim.run`` names its flags. A setting is taken as the command's flag
reads it: ``zero="1"`` is ``zero=1``, and a search choice given once (``zero=1``, ``schedules="1f1b"``) or as the
command's list (``zero="0,1"``) is that tuple.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.core.errors import SpecError, did_you_mean
from sim.core.fileio import prepare_output_dir, read_text
from sim.cost.profile import load_profile
from sim.engine.simpy_engine import OutOfMemoryError
from sim.ir.plan import Plan
from sim.ir.trace import Trace
from sim.plan.build import BuiltPlan, build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.memory_fit import out_of_memory_message
from sim.predict import Prediction, predict, predict_built
from sim.search.search import SearchResult, run_search
from sim.search.space import SearchProblem, SearchSpace

__all__ = ["plan", "load_plan", "simulate", "search", "Simulation", "Search", "OutOfMemoryError", "PLAN_SETTINGS",
           "SPACE_SETTINGS"]

#: The settings :func:`plan` takes beside the model and topology: the fields of :class:`sim.plan.inputs.PlanInputs`
#: (each documented there; ``sim.run``'s flags by the same names).
PLAN_SETTINGS = tuple(field.name for field in dataclasses.fields(PlanInputs) if field.name not in ("model", "topology"))

#: The choices :func:`search` takes as its space: the fields of :class:`sim.search.space.SearchSpace`, each a tuple.
SPACE_SETTINGS = tuple(field.name for field in dataclasses.fields(SearchSpace))


def _unknown(given: dict[str, Any], valid: tuple[str, ...], what: str) -> None:
    """Refuse keyword arguments that name no setting, with the closest valid names."""
    for name in given:
        if name not in valid:
            raise SpecError(f"{name!r} is not a {what}{did_you_mean(name, valid)} (valid: {', '.join(valid)})")


def _keyword(name: str, value: object) -> str:
    """One change of a memory remedy as the keyword argument that makes it (``tp=4``, ``recompute='full'``)."""
    return f"{name}={value!r}"


def _whole_number(text: str) -> int | None:
    """``text`` as the integer a command's ``type=int`` flag reads from it, or ``None``."""
    try:
        return int(text)
    except ValueError:
        return None


def _plan_setting(name: str, value: Any, hint: Any) -> Any:
    """A :func:`plan` setting as :class:`PlanInputs` holds it: a number written as text for an integer setting
    (``zero="1"``) read as ``sim.run``'s flag reads it; a list as a tuple; anything else as given (checked there)."""
    if isinstance(value, str) and (hint is int or int in typing.get_args(hint)):
        number = _whole_number(value)
        return value if number is None else number
    return tuple(value) if isinstance(value, list) else value


def _space_setting(name: str, value: Any, hint: Any) -> Any:
    """A :func:`search` choice as :class:`SearchSpace` holds it, a tuple: a list as a tuple, one choice as a tuple of
    it (``zero=1``), a comma-separated text as ``sim.search`` reads its flag (``zero="0,1"``, ``schedules="1f1b"``).

    Raises:
        SpecError: a choice of the wrong type (the message names the type wanted and gives an example).
    """
    element = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else None
    if element not in (int, str, bool):
        return tuple(value) if isinstance(value, list) else value  # placements (a bool), settings (tuples)
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        value = tuple(_whole_number(part) if element is int and _whole_number(part) is not None else part
                      for part in parts)
    elif isinstance(value, list | tuple):
        value = tuple(value)
    else:
        value = (value,)
    if not all(type(choice) is element for choice in value):
        example = getattr(SearchSpace(), name) or {int: (1, 2), str: ("a", "b"), bool: (False, True)}[element]
        raise SpecError(f"search space setting {name} takes a tuple of {element.__name__} (e.g. {name}={example!r}, "
                        f"or one {element.__name__}), got {value!r}")
    return value


def plan(model: str, topology: str, **settings: Any) -> BuiltPlan:
    """Build and validate a plan: ``model`` (e.g. ``"llama3.1-8b,seq=8192"``) on ``topology`` (e.g. ``"8xH100"``),
    with any of :data:`PLAN_SETTINGS` (``schedule="1f1b"``, ``microbatches=16``, ``tp=2``, ``zero=1``, ...).

    Returns:
        the built plan: ``.plan`` is the IR (what :meth:`Simulation.write` saves as ``plan.json``), ``.topology``,
        ``.graph`` the model one device holds, ``.costs`` its cost view.

    Raises:
        SpecError: an unknown setting, or what ``sim.run`` refuses (an invalid model, topology or layout).
    """
    _unknown(settings, PLAN_SETTINGS, "plan setting")
    hints = typing.get_type_hints(PlanInputs)
    settings = {name: _plan_setting(name, value, hints[name]) for name, value in settings.items()}
    return build_plan(PlanInputs(model=model, topology=topology, **settings))


def load_plan(path: str | Path) -> Plan:
    """A ``plan.json`` written by ``sim.run``, ``sim.search`` or :meth:`Simulation.write`, read and checked.

    Raises:
        SpecError: the file cannot be read, is too large, or is not a valid plan.
    """
    return Plan.loads(read_text(path, "plan"), source=str(path))


@dataclass(frozen=True)
class Simulation:
    """One simulated iteration: what ``sim.run`` prints and writes, as data.

    Attributes:
        prediction: the prediction itself (:class:`sim.predict.Prediction`: plan, trace, metrics, peaks).
    """

    prediction: Prediction

    @property
    def plan(self) -> Plan:
        """The plan simulated."""
        return self.prediction.plan

    @property
    def trace(self) -> Trace:
        """Every op's span."""
        return self.prediction.trace

    @property
    def metrics(self) -> dict[str, Any]:
        """The ``metrics.json`` object (its fields: the docs' formats page on ``metrics.json``)."""
        return self.prediction.metrics

    @property
    def iteration_time_s(self) -> float:
        """One iteration, s."""
        return float(self.metrics["iteration_time_s"])

    @property
    def iteration_time_s_interval(self) -> tuple[float, float] | None:
        """The 90 % interval of the iteration time (low, high), s, from the published runs of the plan's regime
        (``sim.report.interval``); ``None`` where none calibrates it. :attr:`trust` says what it rests on."""
        interval = self.metrics["iteration_time_s_interval"]
        return None if interval["low"] is None else (float(interval["low"]), float(interval["high"]))

    @property
    def trust(self) -> str:
        """One line: how many published runs the interval rests on, which features of the plan's regime they share,
        and along which it lies outside the validated regimes."""
        from sim.report.outputs import calibration_text

        return calibration_text(self.metrics["iteration_time_s_interval"], self.metrics["regime"])

    @property
    def throughput_samples_per_s(self) -> float:
        """Samples per second over all replicas."""
        return float(self.metrics["throughput_samples_per_s"])

    @property
    def bubble_fraction(self) -> float:
        """The share of device-time spent in the pipeline bubble: no compute and no communication op on a device's
        streams (``sim.report.metrics``)."""
        return float(self.metrics["bubble_fraction"])

    @property
    def idle_fraction(self) -> float:
        """The share of device-time the compute streams are idle: the bubble plus the exposed communication."""
        return float(self.metrics["idle_fraction"])

    @property
    def exposed_comm_fraction(self) -> dict[str, float]:
        """Per communication kind (``tp``, ``ep``, ``pp``, ``dp``, ``host_copy``), the share of device-time it runs
        while the device computes nothing (``sim.report.metrics``)."""
        return dict(self.metrics["exposed_comm_fraction"])

    def __repr__(self) -> str:
        """A few lines: the plan (schedule, model, topology, layout, microbatches), the iteration, the fullest device
        and the size of the trace (the dataclass's own repr printed every op: hundreds of kilobytes)."""
        from sim.report.metrics import split_text
        from sim.report.outputs import plan_title

        fullest = max(self.devices(), key=lambda row: row["peak_memory_bytes"] / row["memory_capacity_bytes"])
        bounds = self.iteration_time_s_interval
        interval = "" if bounds is None else f" (90 % interval {bounds[0] * 1e3:.3f}-{bounds[1] * 1e3:.3f} ms)"
        return (f"Simulation({plan_title(self.plan)}\n"
                f"  iteration {self.iteration_time_s * 1e3:.3f} ms{interval}, {self.throughput_samples_per_s:,.1f} "
                f"samples/s, {split_text(self.metrics)}\n"
                f"  fullest device: rank {fullest['rank']}, {fullest['peak_memory_bytes'] / 1e9:.2f} of "
                f"{fullest['memory_capacity_bytes'] / 1e9:.2f} GB\n"
                f"  {len(self.metrics['devices']):,} ranks simulated, {len(self.trace.spans):,} ops)")

    def devices(self) -> list[dict[str, Any]]:
        """One row per simulated rank: ``rank``, ``device``, ``busy_s``, ``idle_fraction``, ``bubble_fraction``,
        ``exposed_comm_fraction`` (per kind), ``peak_memory_bytes``,
        ``memory_capacity_bytes`` (and ``device_rank`` under tensor or data parallelism)."""
        return [dict(row) for row in self.metrics["devices"]]

    def ops(self) -> list[dict[str, Any]]:
        """One row per op, in the trace's order: ``rank``, ``op`` (its id), ``kind``, ``stream``, ``vstage``,
        ``microbatch``, ``start_s``, ``end_s``, ``duration_s``."""
        return [{"rank": span.rank, "op": span.op, "kind": span.kind, "stream": span.stream, "vstage": span.vstage,
                 "microbatch": span.mb, "start_s": span.start, "end_s": span.end, "duration_s": span.end - span.start}
                for span in self.trace.spans]

    def devices_frame(self) -> Any:
        """:meth:`devices` as a pandas ``DataFrame`` (needs pandas)."""
        return _frame(self.devices())

    def ops_frame(self) -> Any:
        """:meth:`ops` as a pandas ``DataFrame`` (needs pandas)."""
        return _frame(self.ops())

    def gantt(self, title: str = "") -> Any:
        """The timeline as a matplotlib figure (a notebook shows it inline; ``.savefig(path)`` writes it)."""
        from sim.report.gantt import gantt_figure

        return gantt_figure(self.trace, title=title)

    def write(self, out: str | Path, *, gantt: bool = True) -> list[str]:
        """Write what ``sim.run --out`` writes into ``out`` (``plan.json``, ``schedule.csv``, ``metrics.json``,
        ``trace.json``, ``gantt.png``); returns the file names.

        Raises:
            SpecError: ``out`` cannot be made or written in.
        """
        from sim.report.outputs import plan_title, write_plan_files, write_run_outputs

        folder = prepare_output_dir(out, "out")
        return [*write_plan_files(folder, self.plan),
                *write_run_outputs(folder, self.trace, self.metrics, title=plan_title(self.plan), gantt=gantt)]


def simulate(planned: BuiltPlan | Plan | str | Path, *, profile: str | Path | None = None,
             check_memory: bool = True) -> Simulation:
    """Simulate one iteration of a plan: one :func:`plan` built, a :class:`sim.ir.plan.Plan`, or a ``plan.json``
    path; with a measured ``profile`` (a path; a built plan keeps the one it was built with).

    Raises:
        SpecError: the plan or profile is invalid.
        OutOfMemoryError: (``check_memory``) a device runs out of memory; for a built plan the message names the
            settings of :func:`plan` that would make it fit, as ``sim.run`` names its flags.
    """
    if isinstance(planned, BuiltPlan):
        if profile is not None:
            raise SpecError("a built plan is simulated with the profile it was built with; pass profile= to plan()")
        if check_memory:  # before simulating, as sim.run refuses it: the same text, the settings spelt for Python
            message = out_of_memory_message(planned.inputs, planned, _keyword, "check_memory=False")
            if message is not None:
                raise OutOfMemoryError(message)
        return Simulation(predict_built(planned, check_memory=check_memory))
    written = load_plan(planned) if isinstance(planned, (str, Path)) else planned
    measured = load_profile(str(profile)) if profile is not None else None
    try:
        return Simulation(predict(written, measured, check_memory=check_memory))
    except OutOfMemoryError as exc:  # a plan read back has no settings to change: say what can still be done
        raise OutOfMemoryError(f"{exc} (check_memory=False simulates it anyway; a plan built by plan() is told "
                               f"which settings would fit it)") from None


@dataclass(frozen=True)
class Search:
    """A finished search, as data.

    Attributes:
        result: the search itself (:class:`sim.search.search.SearchResult`).
    """

    result: SearchResult

    def __repr__(self) -> str:
        """A few lines: the problem, the strategy, how many plans were costed and feasible, and the best (the
        dataclass's own repr printed every evaluation: hundreds of kilobytes)."""
        result, problem = self.result, self.result.problem
        feasible = sum(e.feasible for e in result.evaluations)
        best = result.best
        pick = (f"best: {best.candidate.label()}, {best.iteration_time_s * 1e3:.3f} ms, "
                f"{best.throughput_samples_per_s:,.1f} samples/s" if best is not None else "no feasible plan")
        return (f"Search({problem.model} on {problem.topology}, global batch {problem.global_batch}\n"
                f"  strategy {result.strategy}: {len(result.evaluations):,} of {result.space_size:,} plans costed, "
                f"{feasible:,} feasible, {result.elapsed_s:.1f} s{', stopped by its budget' * result.stopped_by_budget}"
                f"\n  {pick})")

    def rows(self, *, feasible_only: bool = True) -> list[dict[str, Any]]:
        """One row per plan costed, fastest first (the infeasible ones after, in the space's order, each with its
        ``reason``): the plan's choices (``tp``, ``dp``, ``pp``, ``schedule``, ...), ``iteration_time_s``,
        ``throughput_samples_per_s``, ``peak_memory_bytes`` (the fullest rank's) and ``feasible``."""
        ranked = list(self.result.ranked)
        others = [] if feasible_only else [e for e in self.result.evaluations if not e.feasible]
        rows = []
        for evaluation in ranked + others:
            row = {key: list(value) if isinstance(value, tuple) else value
                   for key, value in dataclasses.asdict(evaluation.candidate).items()}
            peaks = evaluation.peak_memory_bytes
            row.update({"label": evaluation.candidate.label(), "feasible": evaluation.feasible,
                        "iteration_time_s": evaluation.iteration_time_s,
                        "throughput_samples_per_s": evaluation.throughput_samples_per_s,
                        "peak_memory_bytes": max(peaks) if peaks else None, "reason": evaluation.reason})
            rows.append(row)
        return rows

    def frame(self, *, feasible_only: bool = True) -> Any:
        """:meth:`rows` as a pandas ``DataFrame`` (needs pandas)."""
        return _frame(self.rows(feasible_only=feasible_only))

    def best_plan(self) -> BuiltPlan:
        """The fastest feasible plan, built as :func:`plan` builds it (simulate it, write it, run it).

        Raises:
            SpecError: no plan was feasible (the message says why, as ``sim.search`` does).
        """
        best = self.result.best
        if best is None:
            from sim.search.search_outputs import why_no_plan

            raise SpecError(why_no_plan(self.result))
        return build_plan(best.candidate.plan_inputs(self.result.problem))


def search(model: str, topology: str, global_batch: int, *, strategy: str = "exhaustive", workers: int = 1,
           time_budget_s: float | None = None, seed: int = 0, memory_limit_bytes: int | None = None,
           profile: str | None = None, **space: Any) -> Search:
    """Search the plans of ``model`` on ``topology`` at ``global_batch`` samples per iteration, as ``sim.search``
    does: ``strategy`` one of :data:`sim.search.search.STRATEGIES` (``sim.search``'s default, ``exhaustive``; ``screen``
    sees spaces of any size and proves its pick), over
    the space that :data:`SPACE_SETTINGS` choices given as tuples narrow or widen (``cp=(1, 2)``,
    ``zero=(0, 1, 3)``, ``precisions=("bf16", "fp8")``), in ``workers`` processes.

    Raises:
        SpecError: an unknown strategy or space setting, or a problem ``sim.search`` refuses.
    """
    _unknown(space, SPACE_SETTINGS, "search space setting")
    hints = typing.get_type_hints(SearchSpace)
    choices = {name: _space_setting(name, value, hints[name]) for name, value in space.items()}
    problem = SearchProblem(model, topology, global_batch, memory_limit_bytes=memory_limit_bytes,
                            space=SearchSpace(**choices), profile=profile)
    return Search(run_search(problem, strategy=strategy, workers=workers, time_budget_s=time_budget_s, seed=seed))


def _frame(rows: list[dict[str, Any]]) -> Any:
    """``rows`` as a pandas ``DataFrame``; pandas is optional.

    Raises:
        SpecError: pandas is not installed (the rows themselves need nothing).
    """
    try:
        import pandas
    except ImportError:
        raise SpecError("a DataFrame needs pandas (pip install -e '.[frames]', or pip install pandas); the same rows "
                        "are plain lists of dicts without it") from None
    return pandas.DataFrame(rows)
