"""``python -m sim.bench``: how fast the engine simulates, against a bare SimPy replay of the same ops.

The workload is the README's headline plan at m = 64: ``16xV100``, ``gpt:layers=48,hidden=2048``, 1F1B (5,904
ops). Both contenders replay every op of the plan once, in the same process, alternately; the median of several
repeats is reported, in CPU seconds of the process (the wall time, which on a shared machine includes waiting for a
core, is printed beside it):

* **engine** — ``sim.engine.simpy_engine.simulate``: walkers, link resources, memory accounting, trace.
* **bare SimPy** — one SimPy process per op that waits for the previous op on its rank and stream and for its
  deps, then for a timeout of the op's duration (taken from the engine's own trace), then fires its done event.
  No resources, no memory, no trace. Its makespan is a little shorter than the engine's because nothing contends
  for links. It schedules 4 SimPy events per op (its process's start and end, the timeout, the done event, 23,616
  in all); the engine, one walker per rank and one process per message, schedules 19,520 (3.3 per op), so the
  ratio compares the cost per op of the two replays, not event for event.

The last line is ``ratio: X`` = engine ops/s ÷ bare ops/s (CPU time); the target is X ≥ 0.9, i.e. the engine's
walkers, links, memory ledger and trace cost no more than a tenth more than a bare replay. Measured on the project's
2-core machine while other jobs ran (load average 11; two runs): 1.02 / 1.06 (engine 68.6 / 62.3 ms, bare 70.0 /
66.2 ms CPU); the engine before issue #38's pass over it, timed the same way in the same minutes, 0.82 / 0.82
(engine 79.4 / 75.0 ms).

``python -m sim.bench --partition`` times ``--partition balanced`` instead
(:func:`sim.plan.partition.balanced_counts`):

* **10,000 layers on 64 stages** — ``uniform:layers=10000`` on ``64xideal`` and ``gpt:layers=10000`` on
  ``8x8xA100``, each with the time to build the model graph and the oracle's per-device layer costs (which any
  partitioner needs) reported apart from the partition itself. Target: under 1 s for the partition.
* **baseline** — the dynamic program it used to be (O(p·n²) steps of Python,
  :func:`sim.bench.reference_partition.reference_balanced_counts`) against the current one on
  ``uniform:layers=400`` over ``8xideal``, in the same run, checking that they return the same partition (exit
  status 1 if not). The last line ``ratio: X`` is the old time ÷ the new. (The old DP
  takes 85 s at 1,000 layers on 16 stages here, about 10 µs a step; 10,000 layers on 64 stages are 3.2·10⁹
  steps, about 9 hours.)

``python -m sim.bench --3d`` times the issue's 512-GPU plan, ``64x8xA100``,
``gpt:layers=96,hidden=12288,heads=96,seq=2048``, TP 2 × DP 8 × PP 32, global batch 1536 of microbatch size 2, 1F1B
with recomputation: the seconds to build it (``sim.plan.build``) and to predict it (``sim.predict``: routes,
collective costs, the engine), target under 5 s on one core (the process's CPU time is printed too, the figure to
read on a shared machine, where wall time includes waiting for a core); then, once, the same prediction with every
replica simulated (``simulate_all``), and whether the two iteration times agree (the symmetry argument of
``sim.cost.cost_view.replica_views``). Last line ``ratio: X`` = the full simulation's time ÷ the symmetric one's.

``python -m sim.bench --cluster`` times Llama 3's scale: ``2048x8xH100`` (16,384 GPUs), ``llama3.1-405b`` at 8,192
tokens, TP 8 × DP 128 × PP 16 with ZeRO-3, interleaved 1F1B with 2 stages per rank, global batch 2,048: building
and predicting it (target under 10 s on one core). The cost there was routing: every GPU searched the whole cluster
for its paths (:meth:`sim.hw.topology.Topology._route` now joins a search inside the server with one search from the
fabric). Baseline, in the same run, on fresh topologies: the joined routes of every pair the plan's costs routed,
against the whole-cluster search timed from 16 GPUs and scaled to the plan's source GPUs (every route from those 16
compared with the search's); last line ``ratio: X`` = the scaled whole-cluster searches' time ÷ the joined routes'.

``python -m sim.bench --search`` prints the search's figures of issue #27 (about 8 minutes): the evaluators'
candidates per second at 64 GPUs (:mod:`sim.bench.rate`: the engine, the fast evaluator per candidate, and the
longest path over a batch of cost vectors); joint partition and placement on small mixed clusters beside brute force
over every partition and placement (:mod:`sim.bench.joint_check`, target within 1 %); then what ``--screen`` prints.
Last line ``ratio: X`` as ``--screen``'s.

``python -m sim.bench --screen`` runs the screen strategy on issue #27's cluster-scale spaces (:mod:`sim.bench.scale`:
GPT 175B-class on 512 A100s, Llama 3.1 70B with CP, ZeRO and FP8 on 512 H100s, Llama 3.1 405B on 16,384 H100s): the
screen alone on one core, the whole search with two workers, the proven gap and the pick; last line ``ratio: X`` =
(the engine on every buildable plan at the proof's pace) ÷ (the whole screened search), the smallest of the three.

``--3d`` on the same machine, idle (two runs, medians of 3): build 0.36 / 0.39 s, predict 1.30 / 1.55 s, total 1.65 /
1.94 s; every replica simulated 5.6 / 5.8 s, the same iteration time (ratio 4.3 / 3.7).

``--partition`` measured on the project's 2-core development machine while other jobs ran (load average 5; medians
of 3)::

    uniform:layers=10000 on 64xideal, 64 stages: model 0.5 s, layer costs 0.0021 s, balanced 0.23 s
    gpt:layers=10000 on 8x8xA100, 64 stages: model 0.34 s, layer costs 0.2 s, balanced 0.34 s
    baseline uniform:layers=400 on 8xideal, 8 stages: reference DP 7.78 s, balanced 0.0102 s, same partition: yes
    ratio: 761
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import simpy

from sim.bench.reference_partition import reference_balanced_counts
from sim.core.cli import CliParser
from sim.core.errors import SpecError, run_cli
from sim.cost.oracle import CostOracle
from sim.engine.simpy_engine import simulate
from sim.hw.topology import Topology
from sim.ir.plan import Plan
from sim.ir.trace import Trace
from sim.models import build_model
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.partition import balanced_counts

__all__ = ["bare_replay", "main", "make_parser"]


def bare_replay(plan: Plan, durations: dict[str, float], streams: dict[str, str]) -> float:
    """Replay the plan's ops and deps in plain SimPy; returns the simulated makespan in s."""
    env = simpy.Environment()
    done = {op.id: env.event() for program in plan.programs for op in program}

    def run(op_id: str, waits: list[simpy.Event], duration: float):
        yield from waits
        yield env.timeout(duration)
        done[op_id].succeed()

    for program in plan.programs:
        last_on_stream: dict[str, str] = {}
        for op in program:
            stream = streams[op.id]
            waits = [done[d] for d in op.deps]
            if stream in last_on_stream:
                waits.append(done[last_on_stream[stream]])
            last_on_stream[stream] = op.id
            env.process(run(op.id, waits, durations[op.id]))
    env.run()
    return env.now


class _Samples:
    """CPU and wall seconds of repeated calls; :attr:`cpu_s` and :attr:`wall_s` are their medians.

    Each call starts after a full garbage collection, untimed, so that it pays for collecting what it allocates
    itself and not for what the other contender left: a full collection of this process takes about as long as a
    bare replay, and which contender it fell on decided the ratio (0.85 to 1.6 for the same code, CPU time).
    """

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def time(self, fn: Callable[[], object]) -> object:
        """Call ``fn`` once, keep its CPU and wall seconds; returns what it returned."""
        gc.collect()
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        return result

    @property
    def cpu_s(self) -> float:
        return statistics.median(self.cpu)

    @property
    def wall_s(self) -> float:
        return statistics.median(self.wall)


def _seconds(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _time_partition(model: str, topology: str, stages: int, repeats: int) -> tuple[float, float, float, tuple]:
    """Median seconds to build the model, to cost its layers on every device, and to partition it; the counts.

    Every repeat starts from a fresh topology and oracle, so no route or prefix sum is reused across repeats."""
    model_s, graph = _seconds(lambda: build_model(model))
    costs_s, partition_s, counts = [], [], ()
    for _ in range(repeats):
        topo = Topology.parse(topology)
        oracle = CostOracle(graph, 1, None, topo)  # type: ignore[arg-type]
        costs_s.append(_seconds(lambda o=oracle, t=topo: [o.layer_costs(d) for d in set(t.devices)])[0])
        seconds, counts = _seconds(lambda o=oracle: balanced_counts(o, stages))  # type: ignore[misc]
        partition_s.append(seconds)
    return model_s, statistics.median(costs_s), statistics.median(partition_s), counts


def _run_partition(args: argparse.Namespace) -> int:
    for name in ("baseline_layers", "baseline_stages", "partition_layers", "partition_stages"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    layers, stages = args.partition_layers, args.partition_stages
    for model, topology in ((f"uniform:layers={layers}", f"{stages}xideal"),
                            (f"gpt:layers={layers}", args.partition_topology)):
        model_s, costs_s, partition_s, _ = _time_partition(model, topology, stages, args.repeats)
        print(f"{model} on {topology}, {stages} stages: model {model_s:.2g} s, layer costs {costs_s:.2g} s, "
              f"balanced {partition_s:.2g} s")
    layers, stages = args.baseline_layers, args.baseline_stages
    model, topology = f"uniform:layers={layers}", f"{stages}xideal"
    oracle = CostOracle(build_model(model), 1, None, Topology.parse(topology))
    old_s, old = _seconds(lambda: reference_balanced_counts(oracle, stages))
    _, _, new_s, new = _time_partition(model, topology, stages, args.repeats)
    print(f"baseline {model} on {topology}, {stages} stages: reference DP {old_s:.3g} s, balanced {new_s:.3g} s, "
          f"same partition: {'yes' if old == new else 'NO'}")
    print(f"ratio: {old_s / new_s:.0f}")
    return 0 if old == new else 1


#: The issue's 512-GPU plan (``--3d``).
PLAN_512 = PlanInputs(model="gpt:layers=96,hidden=12288,heads=96,seq=2048", topology="64x8xA100", schedule="1f1b",
                      microbatch_size=2, recompute=True, tp=2, dp=8, pp=32, global_batch=1536)


def _run_3d(args: argparse.Namespace, inputs: PlanInputs = PLAN_512) -> int:
    """Time building and predicting ``inputs`` (the 512-GPU plan); then once with every replica simulated."""
    from sim.predict import predict

    build_s, predict_s, cpu_s, times = [], [], [], []
    for _ in range(args.repeats):
        cpu = time.process_time()
        seconds, built = _seconds(lambda: build_plan(inputs))
        build_s.append(seconds)
        seconds, prediction = _seconds(lambda b=built: predict(b.plan, None, topology=b.topology,
                                                              oracle=b.costs.oracle))
        predict_s.append(seconds)
        cpu_s.append(time.process_time() - cpu)
        times.append(prediction.metrics["iteration_time_s"])
    plan = built.plan
    ops = sum(len(program) for program in plan.programs)
    build, pred = statistics.median(build_s), statistics.median(predict_s)
    print(f"{plan.layout.describe()}, {plan.model} on {plan.topology}, {plan.num_microbatches} microbatches: "
          f"{ops:,} ops per replica")
    print(f"build {build:.2f} s, predict {pred:.2f} s, total {build + pred:.2f} s (median of {args.repeats}; "
          f"spread {min(build_s) + min(predict_s):.2f}-{max(build_s) + max(predict_s):.2f} s; CPU time "
          f"{statistics.median(cpu_s):.2f} s); iteration {times[0]:.3f} s")
    full_s, full = _seconds(lambda: predict(plan, None, topology=built.topology, oracle=built.costs.oracle,
                                            simulate_all=True))
    same = full.metrics["iteration_time_s"] == times[0]
    print(f"every replica simulated: predict {full_s:.2f} s, iteration {full.metrics['iteration_time_s']:.3f} s, "
          f"same as by symmetry: {'yes' if same else 'NO'}")
    print(f"ratio: {full_s / pred:.1f}")
    return 0 if same and len(set(times)) == 1 else 1


#: Llama 3's scale (``--cluster``).
PLAN_16K = PlanInputs(model="llama3.1-405b", topology="2048x8xH100", schedule="interleaved", chunks=2,
                      microbatch_size=1, tp=8, dp=128, pp=16, zero=3, global_batch=2048)


def _run_cluster(inputs: PlanInputs = PLAN_16K, sources: int = 16) -> int:
    """Time building and predicting ``inputs`` (16,384 GPUs); then the routes against whole-cluster searches."""
    from sim.predict import predict

    cpu = time.process_time()
    build_s, built = _seconds(lambda: build_plan(inputs))
    predict_s, prediction = _seconds(lambda: predict(built.plan, None, topology=built.topology,
                                                     oracle=built.costs.oracle, check_memory=False))
    cpu_s = time.process_time() - cpu
    plan = built.plan
    print(f"{plan.layout.describe()}, {plan.model} on {plan.topology}: build {build_s:.2f} s, predict "
          f"{predict_s:.2f} s, total {build_s + predict_s:.2f} s (CPU {cpu_s:.2f} s; target under 10 s); iteration "
          f"{prediction.metrics['iteration_time_s']:.3f} s")
    ranks = built.topology.num_ranks
    needed = sorted(built.topology._paths)  # the (source, destination) pairs the plan's costs routed
    sources_needed = len({src for src, _ in needed})
    chosen = [r * (ranks // sources) for r in range(sources)]
    whole = Topology.parse(inputs.topology)
    whole_s, trees = _seconds(lambda: {r: whole._tree(f"gpu{r}") for r in chosen})
    joined = Topology.parse(inputs.topology)
    joined_s, _ = _seconds(lambda: [joined.path(src, dst) for src, dst in needed])
    same = all(joined.path(r, d) == (trees[r][f"gpu{d}"].links if d != r else ()) for r in chosen for d in range(ranks))
    estimate = whole_s / sources * sources_needed
    print(f"the plan routes {len(needed):,} pairs from {sources_needed:,} GPUs: joined routes {joined_s:.2f} s; the "
          f"whole-cluster search {whole_s / sources * 1e3:.0f} ms per GPU (measured from {sources}), "
          f"{estimate:.0f} s for them all; every route from the {sources} equal to the search's: "
          f"{'yes' if same else 'NO'}")
    print(f"ratio: {estimate / joined_s:.0f}")
    return 0 if same else 1


def _run_search() -> int:
    """Candidates per second of the search's evaluators (``sim.bench.rate``); ratio = fast per candidate ÷ engine."""
    from sim.bench.rate import RATE_LAYOUT, RATE_PROBLEM, measure_rates

    report = measure_rates()
    print(f"{RATE_LAYOUT.label()} of {RATE_PROBLEM.model} on {RATE_PROBLEM.topology}, partitions varied: "
          f"{report.ops:,} ops per replica")
    print(f"engine (build + SimPy)       {report.engine_per_s:10.1f} candidates/s ({report.engine_candidates} costed)")
    print(f"fast, per candidate          {report.fast_per_s:10.1f} candidates/s ({report.fast_candidates} costed)")
    print(f"fast, batched cost vectors   {report.batched_per_s:10.1f} candidates/s ({report.batched_candidates} at "
          f"once; target >= 1,000)")
    print(f"fast results agree with the engine: {'yes' if report.agreed else 'NO'}")
    print(f"fast per candidate / engine: {report.fast_per_s / report.engine_per_s:.1f}")
    joint_met = _run_joint_check()
    _run_screen()
    return 0 if report.agreed and joint_met else 1


def _run_joint_check() -> bool:
    """The screened search beside brute force over every partition and placement on small mixed clusters
    (``sim.bench.joint_check``); whether every case is within the target."""
    from sim.bench.joint_check import TARGET, check_joint, joint_suite

    print(f"joint partition and placement on mixed clusters, the screened pick beside brute force over every "
          f"partition and placement (target: within {TARGET:.0%}):")
    gaps = []
    for problem in joint_suite():
        check = check_joint(problem)
        gaps.append(check.gap)
        print(f"  {problem.model.split(',')[0]},{problem.model.split(',')[1]} on {problem.topology}, global batch "
              f"{problem.global_batch}: brute force {check.brute_force_s:.4g} s ({check.brute_force_plans:,} plans), "
              f"listed space {check.listed_s / check.brute_force_s - 1:+.2%}, screened {check.gap:+.2%} "
              f"({check.screened.label()})")
    met = max(gaps) <= TARGET
    print(f"  largest gap {max(gaps):+.2%}: {'met' if met else 'NOT met'}")
    return met


def _run_screen() -> int:
    """The screen strategy on the cluster-scale spaces (``sim.bench.scale``); ratio = the engine on every buildable
    plan at the proof's pace ÷ the whole screened search."""
    from sim.bench.scale import SCALE_PROBLEMS, measure_scale

    ratios = []
    for name, (problem, target) in SCALE_PROBLEMS.items():
        report = measure_scale(problem)
        result, summary = report.result, report.result.screen
        assert summary is not None
        best = result.best
        exhaustive_s = report.engine_per_plan_s * report.buildable
        ratios.append(exhaustive_s / result.elapsed_s)
        print(f"{name}: {problem.model} on {problem.topology}, global batch {problem.global_batch}: "
              f"{report.space_size:,} plans ({report.buildable:,} buildable); target: {target}")
        print(f"  screen, one core        {report.screen_one_core_s:8.1f} s")
        print(f"  whole search, 2 workers {result.elapsed_s:8.1f} s (screen {summary.screen_s:.1f} s, "
              f"{summary.simulated} simulated); proven gap {summary.gap:.2%}"
              + (f"; pick {best.iteration_time_s:.4g} s: {best.candidate.label()}" if best is not None else
                 "; no feasible plan"))
        print(f"  the engine on every buildable plan at the proof's pace: ~{exhaustive_s / 3600:.1f} h")
    print(f"ratio: {min(ratios):.0f}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    """The ``sim.bench`` argument parser."""
    parser = CliParser(prog="python -m sim.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--partition", action="store_true",
                        help="time --partition balanced instead of the engine (module docstring)")
    parser.add_argument("--3d", dest="three_d", action="store_true",
                        help="time the 512-GPU tensor x data x pipeline plan (module docstring)")
    parser.add_argument("--search", action="store_true",
                        help="issue #27's search figures: evaluator rates, joint placement vs brute force, the screen "
                        "(module docstring; about 8 minutes)")
    parser.add_argument("--screen", action="store_true",
                        help="the screen strategy on 512- and 16,384-GPU spaces (sim.bench.scale; about 5 minutes)")
    parser.add_argument("--cluster", action="store_true",
                        help="time a 16,384-GPU Llama 3.1 405B plan and its routes (module docstring)")
    parser.add_argument("--baseline-layers", type=int, default=400, help="--partition: the baseline's layers")
    parser.add_argument("--baseline-stages", type=int, default=8, help="--partition: the baseline's stages")
    parser.add_argument("--partition-layers", type=int, default=10_000, help="--partition: the large case's layers")
    parser.add_argument("--partition-stages", type=int, default=64, help="--partition: the large case's stages")
    parser.add_argument("--partition-topology", default="8x8xA100",
                        help="--partition: the real topology the gpt model is partitioned on")
    parser.add_argument("--topology", default="16xV100", help="the engine benchmark's topology (default 16xV100)")
    parser.add_argument("--model", default="gpt:layers=48,hidden=2048",
                        help="the engine benchmark's model (default gpt:layers=48,hidden=2048)")
    parser.add_argument("--schedule", default="1f1b", help="the engine benchmark's schedule (default 1f1b)")
    parser.add_argument("--microbatches", type=int, default=64,
                        help="the engine benchmark's microbatches (default 64)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per contender, median reported (default 7; 3 with --partition)")
    return parser


def _run(argv: list[str] | None) -> int:
    args = make_parser().parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        raise SpecError(f"--repeats must be >= 1, got {args.repeats}")
    if args.partition:
        args.repeats = 3 if args.repeats is None else args.repeats
        return _run_partition(args)
    if args.three_d:
        args.repeats = 3 if args.repeats is None else args.repeats
        return _run_3d(args)
    if args.search:
        return _run_search()
    if args.screen:
        return _run_screen()
    if args.cluster:
        return _run_cluster()
    args.repeats = 7 if args.repeats is None else args.repeats
    built = build_plan(PlanInputs(args.model, args.topology, args.schedule, args.microbatches))
    plan = built.plan
    trace: Trace = simulate(plan, built.costs, built.topology, check_memory=False).trace
    # The transfer is charged once, to the SEND; its RECV completes with it (as in the engine's rendezvous).
    durations = {span.op: 0.0 if span.stream == "recv" else span.duration for span in trace.spans}
    streams = {span.op: span.stream for span in trace.spans}
    num_ops = len(trace.spans)
    engine, bare = _Samples(), _Samples()
    makespan: object = 0.0
    for _ in range(args.repeats):  # alternate so both see the same machine load
        engine.time(lambda: simulate(plan, built.costs, built.topology, check_memory=False))
        makespan = bare.time(lambda: bare_replay(plan, durations, streams))
    print(f"plan: {args.schedule} on {args.topology}, {plan.model}, m={args.microbatches}: {num_ops} ops")
    print(f"engine       {engine.cpu_s * 1e3:8.1f} ms CPU ({engine.wall_s * 1e3:.1f} ms wall)   "
          f"{num_ops / engine.cpu_s:10.0f} ops/s   makespan {trace.makespan * 1e3:.3f} ms")
    print(f"bare SimPy   {bare.cpu_s * 1e3:8.1f} ms CPU ({bare.wall_s * 1e3:.1f} ms wall)   "
          f"{num_ops / bare.cpu_s:10.0f} ops/s   makespan {float(makespan) * 1e3:.3f} ms (no link contention)")  # type: ignore[arg-type]
    print(f"wall-time ratio: {bare.wall_s / engine.wall_s:.2f} (on a shared machine, read the CPU time's)")
    print(f"ratio: {bare.cpu_s / engine.cpu_s:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv))

