"""torchtitan's published Llama 3.1 throughput, predicted: every current row of ``experiments/data/torchtitan/
benchmarks.csv`` through the one prediction path (``build_plan`` and ``predict``), beside the published tokens per
second per GPU.

Each row becomes the ``sim.run`` inputs torchtitan's configuration means (:func:`plan_inputs`): the model preset at
the row's sequence length; ``N/8 × 8`` of the row's GPU (``H100-HBM2E``, the Grand Teton H100 the files describe, or
``H200``); FSDP as ``--dp F --zero 3``, resharding after forward as torchtitan's ``apply_fsdp`` does (not under
pipeline parallelism); ``--tp`` with ``--sequence-parallel`` (torchtitan's TP plan), ``--pp``, ``--cp`` with
``--cp-comm allgather`` (torchtitan's default rotate method); one microbatch of the local batch without pipeline
parallelism, and with it torchtitan's default of one microbatch per pipeline stage (two stages per rank assumed for
the interleaved rows, whose split is not stated); ``--recompute selective`` (torchtitan's per-op policy) or
``full``; ``--precision fp8`` for Float8 rows (``fp8-rowwise`` for the rows that name the rowwise recipe) and
``--compile`` for compiled ones, ``--fsdp-float8-all-gather`` for the Float8 rows under FSDP that gather in FP8
(the 405B preset's and the H200 file's); ``--loss eager``, or ``compiled`` for compiled rows of a torchtitan that
compiles the loss with the model (2025 on; :data:`_COMPILES_LOSS`). What the simulator does not model is named per
row in its ``unmodelled`` column: async TP's transfers competing with the GEMMs (``--async-tp`` is modelled, the rows
that name it run with it) and the rowwise GEMM's speed on small shapes (its casts and its bulk speed are modelled);
those rows stay out of the fit half.
The device figures come from the catalog; the kernel model's constants from vTrain's A100 fit half. Three figures of
the Grand Teton H100 no source publishes (its bf16 and FP8 GEMM ceilings and its attention kernel's, under the 500 W
cap) were fitted on a seeded half of these rows (``--fit``, :mod:`experiments.torchtitan_fit`): the table marks each
row's half, and the held-out half is what the figures are judged on.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.harness import write_csv_png
from experiments.published_rows import RowResult, device_peaks
from experiments.scatter import accuracy_scatter_png, error_stats, target_line
from experiments.torchtitan_fit import DEVICE, FIGURES, fit_figures, log_error, split_rows, with_figures
from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.cost.allocator import FRAGMENTATION, reserved_bytes
from sim.hw.catalog import get_device
from sim.hw.topology import Topology
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.predict import predict_built

__all__ = ["DATA", "Row", "Result", "load_rows", "plan_inputs", "predict_row", "evaluate", "halves",
           "summary", "memory_error", "memory_halves", "fit_fragmentation", "parser", "run", "report", "write", "SEED"]

DATA = Path(__file__).parent / "data" / "torchtitan" / "benchmarks.csv"

#: The preset of each published model name.
_MODELS = {"Llama 3.1 8B": "llama3.1-8b", "Llama 3.1 70B": "llama3.1-70b", "Llama 3.1 405B": "llama3.1-405b"}
#: The catalog device of each published GPU name.
_DEVICES = {"H100 SXM HBM2e (Grand Teton)": "H100-HBM2E", "H200 (WhiteFiber)": "H200"}
#: The torchtitan commit each benchmark file ran (the data README's software versions) and whether it compiles the
#: loss with the model (``build_cross_entropy_loss``, pull request #1033, bbb1b616e, 2025-04-02: an ancestor of
#: 820504e and e7c0cae, not of 9dec370, whose ``train.py`` keeps the loss eager behind a TODO).
_COMPILES_LOSS = {"benchmarks/llama3_h100_202412_torchtitan.md": False,  # torchtitan 9dec370
                  "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md": True,  # 820504e
                  "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md": True}  # e7c0cae
#: Stages per pipeline rank assumed for the interleaved rows (not stated in the file).
INTERLEAVED_CHUNKS = 2
#: What every pipeline row leaves unstated: not a gap in the model.
UNSTATED_PP = "microbatches and stages per rank not published"
#: The seed of the fit / held-out split the catalog's fitted figures were fitted with.
SEED = 0


@dataclass(frozen=True)
class Row:
    """One published row (the CSV's columns the experiment reads; :mod:`experiments.data.torchtitan` README)."""

    row_id: str
    model: str
    gpus: int
    gpu: str
    fsdp: int
    tp: int
    pp: int
    cp: int
    schedule: str
    local_batch: int
    seq: int
    float8: bool
    recipe: str
    compiled: bool
    async_tp: bool
    recompute: str
    fsdp_float8_gather: bool
    tokens_per_s_per_gpu: float
    memory_gib: float | None = None
    loss: str = "eager"


def load_rows(path: Path = DATA) -> list[Row]:
    """The rows of ``path`` whose status is ``current``."""
    rows = []
    with path.open(newline="", encoding="utf-8") as handle:
        for entry in csv.DictReader(handle):
            if entry["status"] != "current":
                continue
            gpus = int(entry["n_gpus"])
            ac = entry["ac_mode"] or "selective"  # the trainy rows: the 8B preset's selective (op) mode
            rows.append(Row(
                row_id=entry["row_id"], model=_MODELS[entry["model"]], gpus=gpus, gpu=_DEVICES[entry["gpu"]],
                fsdp=int(entry["fsdp"] or gpus), tp=int(entry["tp"] or 1), pp=int(entry["pp"] or 1),
                cp=int(entry["cp"] or 1), schedule=entry["pp_schedule"], local_batch=int(entry["local_batch_size"]),
                seq=int(entry["seq_len"] or entry["seq_len_config_default"]), float8=entry["float8"] == "yes",
                recipe=entry["float8_recipe"], compiled=entry["torch_compile"] == "yes",
                async_tp=entry["async_tp"] == "yes", recompute="full" if ac.startswith("full") else "selective",
                fsdp_float8_gather="float8 FSDP all-gather" in entry["notes"] or entry["model"].endswith("405B"),
                tokens_per_s_per_gpu=float(entry["tps_per_gpu"]),
                memory_gib=float(entry["memory_gib"]) if entry["memory_gib"].strip() else None,
                loss="compiled" if entry["torch_compile"] == "yes" and _COMPILES_LOSS[entry["source_file"]]
                else "eager"))
    return rows


def plan_inputs(row: Row) -> PlanInputs:
    """The ``sim.run`` inputs of ``row`` (module docstring)."""
    schedule, chunks, microbatches = "1f1b", 1, 1
    if row.pp > 1:
        interleaved = row.schedule.lower().startswith("interleaved")
        schedule, chunks = ("interleaved", INTERLEAVED_CHUNKS) if interleaved else ("1f1b", 1)
        microbatches = row.pp * chunks  # torchtitan's default: one microbatch per pipeline stage
    if row.local_batch % microbatches:
        raise SpecError(f"row {row.row_id}: local batch {row.local_batch} is not {microbatches} microbatches")
    nodes, per_node = (row.gpus // 8, 8) if row.gpus >= 8 else (1, row.gpus)
    return PlanInputs(
        model=f"{row.model},seq={row.seq}", topology=f"{nodes}x{per_node}x{row.gpu}", schedule=schedule,
        microbatch_size=row.local_batch // microbatches, chunks=chunks, recompute=row.recompute, tp=row.tp,
        dp=row.fsdp, pp=row.pp, cp=row.cp, sequence_parallel=row.tp > 1,
        cp_comm="allgather" if row.cp > 1 else "ring",
        global_batch=row.local_batch * row.fsdp, zero=3 if row.fsdp * row.cp > 1 else 0,
        reshard_after_forward=row.pp == 1 or row.fsdp * row.cp == 1,
        precision=("fp8-rowwise" if row.recipe == "rowwise" else "fp8") if row.float8 else None,
        compiled=row.compiled,
        fsdp_float8_gather=row.float8 and row.fsdp_float8_gather and row.fsdp * row.cp > 1,
        async_tp=row.async_tp and row.tp > 1, loss=row.loss)


def unmodelled(row: Row) -> tuple[str, ...]:
    """What of ``row``'s configuration the prediction leaves out."""
    missing = []
    if row.async_tp:
        # Modelled (--async-tp), the decomposed GEMMs by the kernel model, but not the chunks' transfers competing
        # with the GEMMs for memory bandwidth: an optimistic bias, so these rows are judged, not fitted on.
        missing.append("async TP's transfers' contention with the GEMMs")
    if row.float8 and row.recipe == "rowwise":
        # The recipe's casts are modelled; its GEMM's speed only in bulk (sim.cost.kernels.record.ROWWISE_GEMM_SHARE,
        # an assumption): the small linears' tail that torchtitan issue 1207 found (k and v ~40 % slower) is not.
        missing.append("Float8 rowwise GEMM's small-shape tail")
    if row.pp > 1:
        missing.append(UNSTATED_PP)
    return tuple(missing)


def predict_row(row: Row, topology: Topology | None = None) -> RowResult[Row]:
    """``row``'s prediction through ``build_plan`` and ``predict`` (memory not enforced: a published run that the
    ledger says does not fit is still timed, and its predicted peak reported), on ``topology`` where given (the
    row's topology with trial device figures, :mod:`experiments.torchtitan_fit`)."""
    built = build_plan(plan_inputs(row), topology)
    prediction = predict_built(built, check_memory=False)
    metrics = prediction.metrics
    peak, fits, reserved = device_peaks(metrics)
    return RowResult(row, metrics["tokens_per_s_per_device"], peak, unmodelled(row), fits, reserved,
                     metrics["regime"])


def evaluate(path: Path = DATA) -> list[RowResult[Row]]:
    """Every current row of ``path`` predicted, in file order."""
    return [predict_row(row) for row in load_rows(path)]


def _fully_modelled(result: RowResult[Row]) -> bool:
    return not set(result.unmodelled) - {UNSTATED_PP}


def halves(rows: list[Row], seed: int = SEED) -> list[str]:
    """Each row's half: the fully modelled rows on the fitted device split by ``seed``, every other row held out."""
    fittable = [row.gpu == "H100-HBM2E" and not set(unmodelled(row)) - {UNSTATED_PP} for row in rows]
    return split_rows([row.row_id for row in rows], fittable, seed)


def fit(rows: list[Row], split: list[str],
        progress: Callable[[str], None] | None = None) -> tuple[dict[str, float], float]:
    """The device's figures fitted on the ``"fit"`` rows (:func:`experiments.torchtitan_fit.fit_figures`), starting
    from the catalog's, and the fit half's mean |log error|; ``progress`` is given a line per trial."""
    chosen = [row for row, half in zip(rows, split, strict=True) if half == "fit"]
    parsed = {row.row_id: Topology.parse(plan_inputs(row).topology) for row in chosen}
    device = get_device(DEVICE)

    def objective(figures: dict[str, float]) -> float:
        errors = [log_error(predict_row(row, with_figures(parsed[row.row_id], figures)).predicted,
                            row.tokens_per_s_per_gpu) for row in chosen]
        return sum(errors) / len(errors)

    def trial(figures: dict[str, float], value: float) -> None:
        if progress is not None:
            progress(f"  fit: {', '.join(f'{k} {v:.4f}' for k, v in figures.items())}: {value:.4f}")

    return fit_figures(objective, {name: getattr(device, name) for name in FIGURES}, trial)


def summary(results: list[RowResult[Row]], split: list[str]) -> dict[str, dict[str, float]]:
    """Median and max |error| and the row count of: every row, the held-out half's fully modelled rows (what the
    fitted figures are judged on), the fit half, and every held-out row."""
    pairs = list(zip(results, split, strict=True))
    return {
        "all": error_stats([abs(r.error) for r in results]),
        "held_out_fully_modelled": error_stats([abs(r.error) for r, h in pairs
                                                if h == "held-out" and _fully_modelled(r)]),
        "fit": error_stats([abs(r.error) for r, h in pairs if h == "fit"]),
        "held_out": error_stats([abs(r.error) for r, h in pairs if h == "held-out"]),
    }


def _table(results: list[RowResult[Row]], split: list[str]) -> list[str]:
    lines = [f"{'row':<13} {'half':<8} {'model':<14} {'GPUs':>5} {'FSDP×TP×PP×CP':<14} {'seq':>6} {'f8':<3} "
             f"{'cmp':<3} {'AC':<4} {'published':>9} {'predicted':>9} {'error':>7} {'peak GB':>7}  unmodelled"]
    for r, half in zip(results, split, strict=True):
        row = r.row
        degrees = f"{row.fsdp}×{row.tp}×{row.pp}×{row.cp}"
        lines.append(f"{row.row_id:<13} {half:<8} {row.model:<14} {row.gpus:>5} {degrees:<14} {row.seq:>6} "
                     f"{'y' if row.float8 else '-':<3} {'y' if row.compiled else '-':<3} {row.recompute[:4]:<4} "
                     f"{row.tokens_per_s_per_gpu:>9,.0f} {r.predicted:>9,.0f} {r.error:>+7.1%} "
                     f"{r.peak_memory_bytes / 1e9:>7.1f}  {'; '.join(r.unmodelled) or '-'}")
    return lines


def _plot(results: list[RowResult[Row]], split: list[str]) -> bytes:
    xs = [r.row.tokens_per_s_per_gpu for r in results]
    ys = [r.predicted for r in results]
    groups = (("fit", True, "#88CCEE", "fit half"), ("held-out", True, "#117733", "held out, fully modelled"),
              ("held-out", False, "#CC6677", "held out, something unmodelled"))
    series = []
    for half, clean, color, label in groups:
        pick = [r for r, h in zip(results, split, strict=True) if h == half and _fully_modelled(r) == clean]
        series.append(([r.row.tokens_per_s_per_gpu for r in pick], [r.predicted for r in pick], color,
                       f"{label} ({len(pick)})"))
    return accuracy_scatter_png(series, low=min(xs + ys) * 0.7, high=max(xs + ys) * 1.4,
                                xlabel="published tokens/s per GPU (torchtitan)", ylabel="predicted tokens/s per GPU",
                                title="torchtitan Llama 3.1 on H100 / H200", size=14)


@dataclass(frozen=True)
class Result:
    """Every current row predicted, in file order, with its half of the split by ``seed``; with ``--fit`` the
    figures fitted (name → value, the catalog's units) and the fit half's mean |log error| (else ``None``)."""

    seed: int
    results: tuple[RowResult[Row], ...]
    split: tuple[str, ...]
    fitted: dict[str, float] | None = None
    fit_error: float | None = None


def parser() -> CliParser:
    """``python -m experiments.run torchtitan [--seed S] [--fit] [--out DIR]``."""
    parser = CliParser(prog="python -m experiments.run torchtitan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/torchtitan", help="output directory (default runs/torchtitan)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"seed of the fit / held-out split (default {SEED}, "
                        "the split the catalog's figures were fitted on)")
    parser.add_argument("--fit", action="store_true", help=f"fit {DEVICE}'s three unpublished figures on the fit "
                        "half first (a few minutes), print them, and predict with them instead of the catalog's")
    return parser


def run(*, seed: int = SEED, fit: bool = False, progress: Callable[[str], None] | None = None) -> Result:
    """Every current row predicted, split by ``seed``; with ``fit``, on the figures fitted on the fit half first
    (``progress`` given a line per trial)."""
    rows = load_rows()
    split = halves(rows, seed)
    topologies: dict[str, Topology] = {}
    figures, value = None, None
    if fit:
        figures, value = _fit(rows, split, progress)
        for spec in sorted({plan_inputs(row).topology for row in rows}):  # each topology parsed once
            topologies[spec] = with_figures(Topology.parse(spec), figures)
    results = [predict_row(row, topologies.get(plan_inputs(row).topology)) for row in rows]
    return Result(seed, tuple(results), tuple(split), figures, value)


_fit = fit  # run's keyword ``fit`` (the flag) shadows the function there


def report(result: Result) -> str:
    """The fitted figures (with ``--fit``), the table, and the error summary by half beside the targets."""
    results, split = list(result.results), list(result.split)
    lines = []
    if result.fitted is not None:
        lines.append(f"fitted on {split.count('fit')} rows (seed {result.seed}): "
                     f"{', '.join(f'{name}: {value:.3f}' for name, value in result.fitted.items())} "
                     f"(mean |log error| {result.fit_error:.4f}); put them in profiles/hardware/devices.yaml to make "
                     f"them the catalog's")
    lines.append(f"{len(results)} torchtitan rows (experiments/data/torchtitan), error = predicted / published − 1; "
                 f"{DEVICE}'s {', '.join(FIGURES)} fitted on the 'fit' half (seed {result.seed})")
    lines += _table(results, split)
    stats = summary(results, split)
    for key, label in (("held_out_fully_modelled", "held out, fully modelled"), ("held_out", "held out, all"),
                       ("fit", "fit half"), ("all", "all rows")):
        entry = stats[key]
        lines.append(f"{label}: {entry['rows']} rows, median |error| {entry['median_abs_error']:.1%}, max "
                     f"{entry['max_abs_error']:.1%}")
    lines.append(target_line("held out, fully modelled", stats["held_out_fully_modelled"], 0.05, 0.12))
    lines.append(target_line("all rows (issue #39)", stats["all"], 0.05, 0.15))
    return "\n".join(lines + _memory_lines(results, result.seed))


def memory_error(result: RowResult[Row], fragmentation: float = FRAGMENTATION) -> float:
    """The predicted reserved peak (the ledger's allocated peak through the caching allocator's model with
    ``fragmentation``, :func:`sim.cost.allocator.reserved_bytes`) over the published one (``memory_gib``: PyTorch's
    max reserved, GiB), − 1."""
    if result.row.memory_gib is None:
        raise ValueError(f"row {result.row.row_id} publishes no memory")
    return _reserved(result, fragmentation) / (result.row.memory_gib * 2**30) - 1


def _reserved(result: RowResult[Row], fragmentation: float) -> int:
    reserved = reserved_bytes(int(result.peak_memory_bytes), get_device(result.row.gpu), fragmentation)
    assert reserved is not None, "every torchtitan row runs on GPUs"
    return reserved


def memory_halves(results: list[RowResult[Row]], seed: int = SEED) -> list[str]:
    """Each memory row's half (the rows that publish a peak, in order): split by ``seed``, every other one fit."""
    ids = [r.row.row_id for r in results if r.row.memory_gib is not None]
    return split_rows(ids, [True] * len(ids), seed)


def fit_fragmentation(results: list[RowResult[Row]], split: list[str]) -> float:
    """The allocator's fragmentation (:data:`sim.cost.allocator.FRAGMENTATION`) that minimises the median |log error|
    of the reserved peak over the ``"fit"`` rows of ``split`` (one per memory row), on a grid of 0.005 from 0 to 1
    (the first best kept)."""
    chosen = [r for r, half in zip([r for r in results if r.row.memory_gib is not None], split, strict=True)
              if half == "fit"]
    best, best_value = 0.0, math.inf
    for step in range(201):
        fragmentation = step / 200
        value = statistics.median(abs(math.log1p(memory_error(r, fragmentation))) for r in chosen)
        if value < best_value - 1e-12:
            best, best_value = fragmentation, value
    return best


def _memory_lines(results: list[RowResult[Row]], seed: int = SEED) -> list[str]:
    """Memory beside throughput (issue #40): each row that publishes its peak with its half, the allocator constant
    refitted on the fit half beside the one the tool uses, the error summary of each half and its target, and the fit
    verdict over every row (each ran, so each should fit)."""
    published = [(r, memory_error(r)) for r in results if r.row.memory_gib is not None]
    split = memory_halves(results, seed)
    lines = [f"memory: {len(published)} rows publish their peak (memory_gib: PyTorch's max reserved, GiB); predicted: "
             "the ledger's allocated peak and the caching allocator's reserve (sim.cost.allocator), GiB, max over "
             "the devices"]
    lines += [f"  {r.row.row_id:<13} {half:<9} published {r.row.memory_gib:6.1f}  allocated "
              f"{r.peak_memory_bytes / 2**30:6.1f}  reserved {_reserved(r, FRAGMENTATION) / 2**30:6.1f}  {error:+7.1%}"
              for (r, error), half in zip(published, split, strict=True)]
    refit = fit_fragmentation(results, split)
    lines.append(f"allocator fragmentation fitted on the fit half (seed {seed}, {split.count('fit')} rows): "
                 f"{refit:.3f}; the tool's (sim.cost.allocator.FRAGMENTATION): {FRAGMENTATION:.3f}")
    for label, wanted in (("held-out half", "held-out"), ("fit half", "fit"), ("all", None)):
        chosen = [error for (_, error), half in zip(published, split, strict=True) if wanted in (None, half)]
        stats = error_stats([abs(error) for error in chosen])
        lines.append(f"memory, {label}, {stats['rows']} rows: median |error| {stats['median_abs_error']:.1%}, max "
                     f"{stats['max_abs_error']:.1%} ({sum(error < 0 for error in chosen)} predicted below)")
    held_out = error_stats([abs(error) for (_, error), half in zip(published, split, strict=True)
                            if half == "held-out"])
    lines.append(target_line("memory, held-out half (issue #40)", held_out, 0.08, 0.15))
    refused = [r.row.row_id for r in results if not r.fits]
    lines.append(f"fit verdict: {len(refused)} of {len(results)} published runs predicted not to fit (target 0, "
                 f"issue #40){': ' + ', '.join(refused) if refused else ''}")
    return lines


def write(result: Result, out: Path) -> list[Path]:
    """``out/torchtitan.csv`` (a row per published row) and ``out/torchtitan.png`` (the scatter)."""
    results, split = list(result.results), list(result.split)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["row_id", "half", "model", "gpus", "fsdp", "tp", "pp", "cp", "seq", "float8", "compile", "ac",
                     "published_tps_per_gpu", "predicted_tps_per_gpu", "error", "predicted_peak_gb",
                     "predicted_reserved_gib", "published_memory_gib", "predicted_fits", "loss", "unmodelled"])
    for r, half in zip(results, split, strict=True):
        row = r.row
        writer.writerow([row.row_id, half, row.model, row.gpus, row.fsdp, row.tp, row.pp, row.cp, row.seq,
                         int(row.float8), int(row.compiled), row.recompute, repr(row.tokens_per_s_per_gpu),
                         f"{r.predicted:.3f}", f"{r.error:.6f}", f"{r.peak_memory_bytes / 1e9:.3f}",
                         f"{_reserved(r, FRAGMENTATION) / 2**30:.3f}",
                         "" if row.memory_gib is None else repr(row.memory_gib), int(r.fits), row.loss,
                         "; ".join(r.unmodelled)])
    return write_csv_png(out, "torchtitan", text.getvalue(), _plot(results, split))
