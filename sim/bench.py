"""``python -m sim.bench``: how fast the engine simulates, against a bare SimPy replay of the same ops.

The workload is the README's headline plan at m = 64: ``16xV100``, ``gpt:layers=48,hidden=2048``, 1F1B. Both
contenders are timed in the same process, alternately, and the median of several repeats is reported:

* **engine** — ``sim.engine.simpy_engine.simulate``: walkers, link resources, memory accounting, trace.
* **bare SimPy** — one SimPy process per op that waits for the previous op on its rank and stream and for its
  deps, then for a timeout of the op's duration (taken from the engine's own trace), then fires its done event.
  No resources, no memory, no trace: the least any SimPy replay of this op graph must do. Its makespan is a little
  shorter than the engine's because nothing contends for links.

The last line is ``ratio: X`` = engine ops/s ÷ bare ops/s; the target is X ≥ 0.5, i.e. the engine's bookkeeping
costs at most as much again as SimPy itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import simpy

from sim.core.errors import run_cli
from sim.engine.simpy_engine import simulate
from sim.ir.plan import Plan
from sim.ir.trace import Trace
from sim.plan.build import PlanInputs, build_plan

__all__ = ["bare_replay", "main"]


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


def _seconds(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="16xV100")
    parser.add_argument("--model", default="gpt:layers=48,hidden=2048")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per contender (median reported)")
    args = parser.parse_args(argv)
    built = build_plan(PlanInputs(args.model, args.topology, args.schedule, args.microbatches))
    plan = built.plan
    trace: Trace = simulate(plan, built.costs, built.topology, check_memory=False).trace
    # The transfer is charged once, to the SEND; its RECV completes with it (as in the engine's rendezvous).
    durations = {span.op: 0.0 if span.stream == "recv" else span.duration for span in trace.spans}
    streams = {span.op: span.stream for span in trace.spans}
    num_ops = len(trace.spans)
    engine_samples, bare_samples = [], []
    makespan: object = 0.0
    for _ in range(args.repeats):  # alternate so both see the same machine load
        engine_samples.append(_seconds(lambda: simulate(plan, built.costs, built.topology, check_memory=False))[0])
        seconds, makespan = _seconds(lambda: bare_replay(plan, durations, streams))
        bare_samples.append(seconds)
    engine_s, bare_s = statistics.median(engine_samples), statistics.median(bare_samples)
    print(f"plan: {args.schedule} on {args.topology}, {plan.model}, m={args.microbatches}: {num_ops} ops")
    print(f"engine       {engine_s * 1e3:8.1f} ms   {num_ops / engine_s:10.0f} ops/s   "
          f"makespan {trace.makespan * 1e3:.3f} ms")
    print(f"bare SimPy   {bare_s * 1e3:8.1f} ms   {num_ops / bare_s:10.0f} ops/s   "
          f"makespan {float(makespan) * 1e3:.3f} ms (no link contention)")  # type: ignore[arg-type]
    print(f"ratio: {(num_ops / engine_s) / (num_ops / bare_s):.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
