"""``python -m sim.bench_memory``: peak memory and time per op of ``sim.run`` as the microbatches grow.

Each size runs ``python -m sim.run`` (``--no-gantt``, into a temporary directory) in a child process of its own, so
its peak resident set size (``ru_maxrss`` of that child, from ``os.wait4``) and wall time are its own. A run with one
microbatch gives the fixed cost (interpreter, imports, the model and topology); what grows with the plan is the rest,
divided by the plan's ops (counted from the run's ``metrics.json``). On this project's 2-core machine::

            m         ops   wall s  peak MB  bytes/op   µs/op
        1,000      20,004     2.22       75      1013    74.1
       10,000     200,004    13.55      251       982    64.1
      100,000   2,000,004   140.53     2045       995    69.9
    per-op growth, m=1,000 → 100,000: memory x0.98, time x0.94 (1.00 = linear)

(before the engine, checks and trace writer were made lean: 2,630 bytes and 115–170 µs per op, 5.0 GB at m=100,000).
Linear memory and time show as per-op figures that stay put: ratios near 1 from the smallest size to the largest.
The last lines are ``memory ratio: X`` and ``time ratio: Y`` (largest size's per-op figure ÷ smallest's).
"""

from __future__ import annotations

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sim.core.errors import SpecError, run_cli

__all__ = ["Measurement", "measure", "main"]


@dataclass(frozen=True)
class Measurement:
    """One ``sim.run`` in a child process.

    Attributes:
        microbatches: ``--microbatches``.
        ops: ops of the plan (the per-kind counts of ``metrics.json`` summed).
        wall_s: wall time of the child, s.
        peak_rss_bytes: the child's peak resident set size, bytes.
    """

    microbatches: int
    ops: int
    wall_s: float
    peak_rss_bytes: int


def measure(args: list[str], microbatches: int) -> Measurement:
    """Run ``python -m sim.run <args> --microbatches <m> --no-gantt`` once and measure it.

    Raises:
        SpecError: the run failed (its last output line is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as out:
        command = [sys.executable, "-m", "sim.run", *args, "--microbatches", str(microbatches), "--no-gantt",
                   "--out", out]
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # wait4 reports this child's own usage; RUSAGE_CHILDREN would fold every earlier child into the peak.
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        error = child.stderr.read().decode(errors="replace").strip() if child.stderr else ""
        if child.returncode != 0:
            raise SpecError(f"sim.run failed (status {child.returncode}): {error.splitlines()[-1] if error else ''}")
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    ops = sum(entry["count"] for entry in metrics["ops"].values())
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return Measurement(microbatches, ops, wall, usage.ru_maxrss * scale)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"microbatch counts must be >= 1, got {text!r}")
    return sorted(set(sizes))


def make_parser() -> argparse.ArgumentParser:
    """The ``sim.bench_memory`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m sim.bench_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="4xV100", help="topology of every run (default 4xV100)")
    parser.add_argument("--model", default="uniform:layers=4", help="model of every run (default uniform:layers=4)")
    parser.add_argument("--schedule", default="1f1b", help="schedule of every run (default 1f1b)")
    parser.add_argument("--microbatches", type=_sizes, default=[1000, 10000, 100000],
                        help="comma-separated sizes (default 1000,10000,100000)")
    return parser


def _run(argv: list[str] | None) -> int:
    args = make_parser().parse_args(argv)
    common = ["--topology", args.topology, "--model", args.model, "--schedule", args.schedule]
    base = measure(common, 1)
    print(f"sim.run --topology {args.topology} --model {args.model} --schedule {args.schedule}, one child per size")
    print(f"fixed cost (m=1, {base.ops} ops): {base.wall_s:.2f} s, {base.peak_rss_bytes / 1e6:.0f} MB peak RSS")
    print(f"{'m':>9} {'ops':>11} {'wall s':>8} {'peak MB':>8} {'bytes/op':>9} {'µs/op':>7}")
    rows = []
    for m in args.microbatches:
        run = measure(common, m)
        grown = max(run.ops - base.ops, 1)
        per_op_bytes = (run.peak_rss_bytes - base.peak_rss_bytes) / grown
        per_op_s = (run.wall_s - base.wall_s) / grown
        rows.append((m, per_op_bytes, per_op_s))
        print(f"{m:>9,} {run.ops:>11,} {run.wall_s:>8.2f} {run.peak_rss_bytes / 1e6:>8.0f} {per_op_bytes:>9.0f} "
              f"{per_op_s * 1e6:>7.1f}", flush=True)
    if len(rows) > 1:
        (m0, bytes0, s0), (m1, bytes1, s1) = rows[0], rows[-1]
        memory, elapsed = _ratio(bytes1, bytes0), _ratio(s1, s0)
        print(f"per-op growth, m={m0:,} → {m1:,}: memory x{memory}, time x{elapsed} (1.00 = linear)")
        print(f"memory ratio: {memory}")
        print(f"time ratio: {elapsed}")
    return 0


def _ratio(larger: float, smaller: float) -> str:
    """``larger / smaller`` to two places, or ``n/a`` when the smallest size grew nothing measurable (tiny m)."""
    return f"{larger / smaller:.2f}" if smaller > 0 else "n/a"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
