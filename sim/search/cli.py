"""``python -m sim.search``: find the fastest plan that fits a model on a cluster, with the simulator in the loop.

(The entry point is ``sim/search/__main__.py``; this module is the command's body.)

Example::

    python -m sim.search --topology 8xA100 --model gpt:layers=24,hidden=2048,heads=16,seq=1024 \\
        --global-batch 64 --out runs/search

prints the best plans as a table and writes ``runs/search/plan.json`` (the best plan, which ``executor.run`` runs as
is), ``candidates.csv``, ``search.json`` and ``pareto.png``. A progress bar on stderr (on a terminal) shows the
plans costed, the best so far and the time left. Bad input prints one ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence

from sim.core.cli import CliParser, argument_type, parse_byte_size
from sim.core.errors import SpecError, did_you_mean, run_cli
from sim.core.fileio import prepare_output_dir, write_text_chunks_atomic
from sim.cost.allocator import FRAGMENTATION
from sim.cost.precision import PRECISIONS
from sim.engine.perturbation import Perturbation, SlowLink, Straggler, parse_straggler
from sim.hw.topology import Topology
from sim.ir.parallel import RANK_ORDERS
from sim.models import build_model
from sim.models.blocks import BLOCKS
from sim.models.loss import LOSSES
from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, parse_recompute_modules
from sim.models.routing import CAPACITY_FACTOR_HELP, ROUTING_HELP
from sim.models.sharding import Sharding
from sim.plan.inputs import format_builtin_lists
from sim.plan.partition import PARTITION_RULES
from sim.report.png import load_matplotlib_in_background
from sim.schedules import SCHEDULES
from sim.search.evaluate import Evaluation, build_candidate_plan
from sim.search.search import STRATEGIES, SearchResult, run_search
from sim.search.search_outputs import format_table, why_no_plan, write_search_outputs
from sim.search.settings import load_settings
from sim.search.space import DEFAULT_SCHEDULES, MODEL_PRECISION, RECOMPUTE_MODES, SearchProblem, SearchSpace
from sim.search.stopping import stop_on_interrupt

__all__ = ["main", "make_parser", "FLAGS"]

#: The library arguments this command sets from its flags, each with its flag (:func:`sim.core.errors.run_cli` prints
#: a library error about one as the flag the user typed).
FLAGS = {"global_batch": "--global-batch", "memory_limit_bytes": "--memory-limit",
         "memory_headroom": "--memory-headroom", "time_budget_s": "--time-budget",
         "strategy": "--strategy", "evaluations": "--evaluations", "chains": "--chains", "workers": "--workers",
         "ray": "--ray", "routing": "--routing", "capacity_factor": "--capacity-factor",
         "loss": "--loss", "blocks": "--blocks", "deallocate_pipeline_outputs": "--deallocate-pipeline-outputs",
         "recompute_modules": "--recompute-modules"}


def _listed(kind, allowed=None, name=""):
    """An argparse type for a comma-separated list of ``kind`` values (each in ``allowed`` when given)."""
    def parse(text: str) -> tuple:
        values = []
        for item in text.split(","):
            item = item.strip()
            try:
                value = kind(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a {name}: {item!r} in {text!r}") from None
            if allowed is not None and value not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(map(str, allowed))}"
                                                 f"{did_you_mean(item, [str(a) for a in allowed])}")
            values.append(value)
        if not values or any(v in ("", None) for v in values):
            raise argparse.ArgumentTypeError(f"an empty list: {text!r}")
        return tuple(dict.fromkeys(values))
    return parse


def _switch(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(text)
    return text == "on"


def _perturbation(flags: Sequence[str], topology: str) -> Perturbation:
    """``--straggler`` entries as the perturbation every candidate is simulated under, checked on the topology."""
    parsed = Topology.parse(topology)
    entries = [parse_straggler(entry, parsed.num_ranks) for flag in flags for entry in flag.split(",") if entry.strip()]
    perturbation = Perturbation(tuple(e for e in entries if isinstance(e, Straggler)),
                                links=tuple(e for e in entries if isinstance(e, SlowLink)))
    perturbation.topology(parsed)  # a link name that is not there: refused before the search
    return perturbation


def make_parser() -> argparse.ArgumentParser:
    """The ``sim.search`` argument parser."""
    parser = CliParser(prog="python -m sim.search", description=__doc__.split("\n\n")[0])
    # Required, but checked after parsing (_run) so that '--model list' and '--topology list' work alone.
    parser.add_argument("--topology", help="e.g. 8xA100, 2x8xA100, 4xV100+4xA100, a YAML file, or 'list' (required)")
    parser.add_argument("--model", help="e.g. gpt:layers=24,hidden=2048,heads=16,seq=1024, or 'list' (required)")
    parser.add_argument("--global-batch", type=int, metavar="G", help="samples per iteration (required)")
    parser.add_argument("--out", help="output directory (required)")
    parser.add_argument("--memory-limit", type=parse_byte_size, metavar="BYTES",
                        help="cap on each device's memory, e.g. 40GB (default: each device's own)")
    parser.add_argument("--memory-headroom", type=float, default=FRAGMENTATION, metavar="FRACTION",
                        help="a pick's allocated peak times 1 + FRACTION must fit each device's memory (or "
                        f"--memory-limit) (default {FRAGMENTATION:g}: the caching allocator's fragmentation fitted on "
                        "torchtitan's published peaks, so that what the GPU reserves for the pick fits; 0: the "
                        "allocated peak may fill the device)")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="answer within this many seconds of the command's start (plus at most about 2 s): "
                        "the best plan found by then, ranked and written (default: no limit)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto",
                        help="search strategy (auto, the default: exhaustive where simulating the whole space takes "
                        "seconds, the screen otherwise, saying which; screen: every plan bounded, the best layouts' "
                        "partition and "
                        "placement refined, the best simulated until the pick is proven within 1 %%; for large spaces. "
                        "relaxed: the same with the differentiable relaxation's partition and placement)")
    parser.add_argument("--evaluations", type=int, metavar="N",
                        help="--strategy anneal: candidates to cost in all (default: a quarter of the space, >= 50)")
    parser.add_argument("--chains", type=int, default=4, metavar="C",
                        help="--strategy anneal: independent chains, spread over the workers (default 4)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="plans in the printed table (default 10)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="evaluation processes (default 1); "
                        "--strategy screen and relaxed also bound the plans in them")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="evaluate on a Ray cluster (auto, host:port, ray://host:10001; 'local' starts one here), "
                        "the optional extra pip install -e '.[ray]'; --workers is then unused")
    parser.add_argument("--seed", type=int, default=0, help="seed of the search's random choices (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    space = parser.add_argument_group("the space")
    space.add_argument("--schedules", type=_listed(str, sorted(SCHEDULES), "schedule"),
                       default=DEFAULT_SCHEDULES, help=f"default {','.join(DEFAULT_SCHEDULES)}")
    space.add_argument("--chunks", type=_listed(int, name="chunk count"), default=(2, 4),
                       help="model chunks per rank for interleaved (default 2,4)")
    space.add_argument("--recompute", type=_listed(str, RECOMPUTE_MODES, "recompute mode"), default=RECOMPUTE_MODES,
                       help="default none,selective,full")
    space.add_argument("--microbatch-sizes", type=_listed(int, name="microbatch size"), default=(),
                       help="default: powers of two up to the global batch per replica")
    space.add_argument("--sequence-parallel", type=_listed(_switch, (False, True), "on/off"), default=(False, True),
                       help="off, on or off,on (default; applies where TP > 1)")
    space.add_argument("--zero", type=_listed(int, (0, 1, 2, 3), "ZeRO stage"), default=(0, 1),
                       help="ZeRO stages among 0,1,2,3 (default 0,1; 1 to 3 apply where DP > 1; 3 is FSDP)")
    space.add_argument("--cp", type=_listed(int, name="context-parallel degree"), default=(1,),
                       help="context-parallel degrees, e.g. 1,2,4 (default 1; llama and moe families on GPUs)")
    space.add_argument("--cp-comm", type=_listed(str, ("ring", "allgather"), "exchange"), default=("ring",),
                       help="how context-parallel ranks exchange keys and values: ring and/or allgather (default ring)")
    space.add_argument("--dp-replicate", type=_listed(int, name="HSDP replicate degree"), default=(1,),
                       help="HSDP replicate degrees under ZeRO-3, e.g. 1,2,4 (default 1: plain FSDP)")
    space.add_argument("--precision", type=_listed(str, (MODEL_PRECISION, *PRECISIONS), "precision"),
                       default=(MODEL_PRECISION,), help=f"precisions among {MODEL_PRECISION} (the model's own), "
                       f"{', '.join(PRECISIONS)} (default {MODEL_PRECISION}; fp8 where the devices have it)")
    space.add_argument("--compile", type=_listed(_switch, (False, True), "on/off"), default=(False,),
                       help="torch.compile: off (default), on or off,on (llama and moe families on GPUs)")
    space.add_argument("--ep", type=_listed(int, name="expert-parallel degree"), default=(1,),
                       help="expert-parallel degrees, e.g. 1,4,8 (default 1; moe family), each tried where it "
                       "divides a layout's tp x cp x dp devices")
    space.add_argument("--etp", type=_listed(int, name="expert-tensor-parallel degree"), default=(1,),
                       help="expert-tensor-parallel degrees (default 1)")
    space.add_argument("--rank-orders", type=_listed(str, (*RANK_ORDERS, "all"), "rank order"), default=("tp-dp-pp",),
                       help="how ranks nest over the devices, innermost first (default tp-dp-pp, Megatron's; 'all')")
    space.add_argument("--partitions", type=_listed(str, PARTITION_RULES, "partition rule"),
                       default=("balanced",), help="balanced (exact DP, default), uniform and/or blocks (Megatron-"
                       "DeepSpeed's type:transformer)")
    space.add_argument("--candidates", metavar="FILE",
                       help="CSV of tp,dp,pp,microbatch_size settings: search only these (each with the rest of the "
                       "space); see sim/search/settings.py")
    parser.add_argument("--straggler", action="append", metavar="DEVICE:FACTOR[@START-END] or LINK:FACTOR",
                        help="rank the plans with this slow device or slow links, as sim.run --straggler simulates "
                        "them (repeatable): which plan hides it best")
    parser.add_argument("--profile", help="measured profile JSON replacing the catalog's costs")
    parser.add_argument("--routing", default="balanced", metavar="ROUTING", help=ROUTING_HELP + "; every plan")
    parser.add_argument("--capacity-factor", type=float, default=0.0, metavar="C", help=CAPACITY_FACTOR_HELP)
    parser.add_argument("--loss", choices=list(LOSSES), default=LOSSES[0],
                        help="how the framework computes the loss in every plan (as sim.run --loss): fused "
                        "(default; Megatron-LM's), eager or compiled (torchtitan's without and with torch.compile)")
    parser.add_argument("--blocks", choices=list(BLOCKS), default=BLOCKS[0],
                        help="the modules every plan's blocks are built from (as sim.run --blocks): eager (default; "
                        "torchtitan's PyTorch modules) or transformer-engine (Megatron-Core's)")
    parser.add_argument("--deallocate-pipeline-outputs", action="store_true",
                        help="every plan with pipeline stages frees each stage's output once sent (as sim.run "
                        "--deallocate-pipeline-outputs: Megatron-Core's)")
    parser.add_argument("--recompute-modules", type=argument_type(parse_recompute_modules),
                        default=DEFAULT_RECOMPUTE_MODULES, metavar="M[,M...]",
                        help="what a plan's selective recomputation drops in a mixture's blocks (as sim.run "
                        f"--recompute-modules: {', '.join(RECOMPUTE_MODULES)}; default all)")
    return parser


def _check_recompute_modules(problem: SearchProblem) -> None:
    """Refuse ``--recompute-modules`` for a model that is not a mixture, once, before the search (each selective plan
    would be refused by it otherwise)."""
    if problem.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
        build_model(problem.model, Sharding(selective_recompute=True, recompute_modules=problem.recompute_modules))


class _Progress:
    """tqdm on stderr: plans costed of the space, the best time so far, the time left of the budget."""

    def __init__(self, enabled: bool, budget: float | None) -> None:
        self.enabled, self.budget, self.bar, self.best = enabled, budget, None, None

    def start(self, total: int) -> None:
        if self.enabled:
            from tqdm import tqdm

            class Bar(tqdm):
                """tqdm without its monitor thread, which outlives the bar and would keep the search's files from
                being made on two cores at once (:func:`sim.core.parallel_outputs.can_fork_safely`); the bar is
                redrawn at every plan costed, so the monitor's forced refresh of a stale bar is not needed."""
                monitor_interval = 0

            self.bar = Bar(total=total, file=sys.stderr, unit="plan", dynamic_ncols=True, leave=False)

    def __call__(self, evaluation: Evaluation) -> None:
        if self.bar is None:
            return
        if evaluation.feasible and (self.best is None or evaluation.iteration_time_s < self.best):
            self.best = evaluation.iteration_time_s
        postfix = {"best": "-" if self.best is None else f"{self.best:.4f}s"}
        if self.budget is not None:
            postfix["left"] = f"{max(0.0, self.budget - self.bar.format_dict['elapsed']):.0f}s"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run(argv: list[str] | None, started: float) -> int:
    args = make_parser().parse_args(argv)
    lists = format_builtin_lists(args.model, args.topology)
    if lists is not None:
        print(lists)
        return 0
    missing = [flag for flag, value in (("--topology", args.topology), ("--model", args.model),
                                        ("--global-batch", args.global_batch), ("--out", args.out)) if value is None]
    if missing:
        named = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise SpecError(f"{named} {'is' if len(missing) == 1 else 'are'} required (e.g. --topology 8xA100 "
                        "--model gpt:layers=24 --global-batch 64 --out runs/search; --model list and --topology list "
                        "show what is built in)")
    if args.top < 1:
        raise SpecError(f"--top must be >= 1, got {args.top}")
    orders = RANK_ORDERS if "all" in args.rank_orders else args.rank_orders
    settings = load_settings(args.candidates) if args.candidates else ()
    problem = SearchProblem(
        model=args.model, topology=args.topology, global_batch=args.global_batch,
        memory_limit_bytes=args.memory_limit, memory_headroom=args.memory_headroom, profile=args.profile,
        space=SearchSpace(schedules=args.schedules, chunks=args.chunks, recompute=args.recompute,
                          microbatch_sizes=args.microbatch_sizes, sequence_parallel=args.sequence_parallel,
                          zero=args.zero, rank_orders=orders, partitions=args.partitions,
                          settings=settings, cp=args.cp, cp_comms=args.cp_comm, dp_replicate=args.dp_replicate,
                          precisions=args.precision, compile=args.compile, ep=args.ep, etp=args.etp),
        perturbation=_perturbation(args.straggler or (), args.topology), routing=args.routing,
        capacity_factor=args.capacity_factor, loss=args.loss, blocks=args.blocks,
        deallocate_pipeline_outputs=args.deallocate_pipeline_outputs, recompute_modules=args.recompute_modules)
    _check_recompute_modules(problem)
    out = prepare_output_dir(args.out, "--out", create=False)  # a bad --out is refused before the search, not after
    progress = _Progress(not args.no_progress and sys.stderr.isatty(), args.time_budget)
    load_matplotlib_in_background()  # the chart at the end waits for nothing, even right after a Ctrl-C
    try:
        with stop_on_interrupt("stopping: ranking and writing what was found (Ctrl-C again to abandon it)"):
            result = run_search(problem, strategy=args.strategy, workers=args.workers,
                                time_budget_s=_search_budget(args.time_budget, started), seed=args.seed,
                                progress=progress, on_space=progress.start, evaluations=args.evaluations,
                                chains=args.chains, ray_address=args.ray)
    finally:
        progress.close()
    prepare_output_dir(out, "--out")
    names = write_search_outputs(out, result)
    print(_summary(result, args.top))
    best = result.best
    if best is not None:
        write_text_chunks_atomic(build_candidate_plan(problem, best.candidate).iter_dumps(), out / "plan.json")
        names.insert(0, "plan.json")
        slowed = [f"--straggler={flag}" for flag in args.straggler or ()]
        print("the best plan again: python -m sim.run " + shlex.join([*best.candidate.run_flags(problem), *slowed])
              + " --out DIR")
    print(f"wrote {out}/{{{', '.join(names)}}}")
    if result.interrupted:  # the files hold what was found; the status says it was cut short (128 + SIGINT)
        return 130
    if best is None:  # a result, not bad input: status 1, the files kept; the line says why and how near it came
        print(f"error: {why_no_plan(result)}", file=sys.stderr)
        return 1
    return 0


#: What a budget keeps back for ranking the plans, writing the files and exiting: this many seconds and this share
#: of what is left (measured on the 2-core machine, 2026-12-07: ranking and writing a screened search's 23,700
#: records and chart take 0.4-0.7 s on two cores; a worker's candidate in progress when the screen's deadline passes,
#: up to 2 s. With 1 s and 15 % the README's search answered budgets of 10 and 15 s in 8.9 and 13.2 s).
OUTPUT_RESERVE_S = 0.5
OUTPUT_RESERVE_SHARE = 0.10


def _search_budget(budget_s: float | None, started: float) -> float | None:
    """The search's share of ``--time-budget``: the budget counts from the command's start (imports, parsing,
    listing the space and writing the files included), so the search gets what is left less
    :data:`OUTPUT_RESERVE_SHARE` of it and :data:`OUTPUT_RESERVE_S`.

    Raises:
        SpecError: a budget that is not a positive number of seconds.
    """
    if budget_s is None:
        return None
    if not budget_s > 0 or budget_s == float("inf"):
        raise SpecError(f"--time-budget must be a positive number of seconds, got {budget_s}")
    left = budget_s - (time.monotonic() - started)
    return max(left * (1 - OUTPUT_RESERVE_SHARE) - OUTPUT_RESERVE_S, 0.05)


def _summary(result: SearchResult, top: int) -> str:
    problem = result.problem
    budget = (', stopped by Ctrl-C' if result.interrupted
              else ', stopped by --time-budget' if result.stopped_by_budget else '')
    covered = (f"{len(result.evaluations):,} of {result.space_size:,} plans costed ({result.coverage:.1%} of the "
               f"space{budget})")
    if result.screen is not None:  # its evaluations include the plans the screen alone proved infeasible
        covered = f"{result.screen.simulated:,} of {result.space_size:,} plans simulated{budget}"
    head = (f"search ({result.strategy}, seed {result.seed}): {problem.model} on {problem.topology}, global batch "
            f"{problem.global_batch}; {covered} in {result.elapsed_s:.1f} s; {len(result.ranked):,} feasible")
    if result.chosen_by_auto:
        head += f"\n--strategy auto chose {result.strategy}: {result.chosen_by_auto}"
    if problem.perturbation:
        head += f"\nevery plan simulated with {problem.perturbation.describe()}"
    if problem.routing != "balanced" or problem.capacity_factor:
        head += f"\nevery plan routed {problem.routing}" + (
            f", capacity factor {problem.capacity_factor:g}" if problem.capacity_factor else "")
    if result.screen is not None:
        head += "\n" + _screen_line(result)
    if result.best is None and (result.interrupted or result.stopped_by_budget):  # what stopped it, not a verdict
        return head + f"\nno feasible plan yet: {why_no_plan(result)}"
    if result.best is None:
        return head + "\nno feasible plan: see search.json for why each failed"
    return head + "\n" + format_table(result, top)


def _screen_line(result: SearchResult) -> str:
    """What the screen bounded and what the engine's proof covered (``--strategy screen``)."""
    screen = result.screen
    assert screen is not None
    line = (f"screen: {screen.screened:,} of {result.space_size:,} plans bounded in {screen.screen_s:.1f} s "
            f"({screen.infeasible:,} break a rule, {screen.over_memory:,} cannot fit)"
            + (f", {screen.refined:,} more partitions and placements of the best layouts" if screen.refined else "")
            + "; the engine simulated "
            f"{screen.simulated:,} in order of their bound; ")
    if screen.gap == float("inf"):
        cause = ("Ctrl-C stopped it first" if result.interrupted else "the time budget ended it first"
                 if result.stopped_by_budget else "no simulated plan fits")
        return line + f"nothing proven ({cause})"
    if screen.lowest_unsimulated_s == float("inf"):
        return line + "every plan that could fit was simulated: the pick is exact"
    left = f"(lowest bound left {screen.lowest_unsimulated_s:.4g} s)"
    if screen.gap == 0:
        return line + f"no plan left can be faster than the pick {left}"
    return line + f"no plan left can be more than {screen.gap:.2%} faster than the pick {left}"


def main(argv: list[str] | None = None, *, started: float | None = None) -> int:
    """Entry point; returns the exit status (1 when no plan is feasible, 130 after Ctrl-C). ``started``: when the
    command started (``time.monotonic()``; default now), from which ``--time-budget`` counts."""
    started = time.monotonic() if started is None else started
    return run_cli(lambda: _run(argv, started), FLAGS)
