"""NASPipe (ASPLOS'22) in simulation: CSP throughput against its ablations on the three search spaces (issue #5).

For each space (``c1``–``c3``, NASPipe's naming: c1 the largest) on ``8xV100``, the same seeded subnet sequence runs
under ``sim.run --schedule csp`` as

* ``csp`` — CSP with every layer resident;
* ``csp+predict`` / ``csp+on_demand`` — CSP with the supernet in host memory and a device parameter budget of
  ``--budget-factor`` × the largest subnet's parameters on any stage, with and without the predictor;
* ``one-at-a-time`` — the ablation without CSP: a subnet enters the pipeline when the previous one has left.

It prints subnets/s per case, CSP's speedup over one-at-a-time beside the paper's NASPipe/GPipe speedups
(``../shared/reference/hardware.md`` §4.1: c1 8.0×, c2 4.3×, c3 2.8×, from the artifact's sample output), and the
device parameter bytes against the whole supernet's. The comparison is not like for like, and the table says so:
our denominator runs one subnet at a time without splitting it into microbatches, the paper's is GPipe (which does),
and the GPipe/1F1B/PipeDream baselines on the same subnet sequence are not built yet (issue #5).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from sim.errors import SpecError, fail
from sim.fileio import write_json_atomic, write_text_atomic

__all__ = ["main", "PAPER_SPEEDUP"]

#: NASPipe / GPipe throughput from the artifact's sample output (hardware.md §4.1).
PAPER_SPEEDUP = {"c1": 8.0, "c2": 4.3, "c3": 2.8}


def _simulate(out: Path, topology: str, space: str, subnets: int, seed: int, *flags: str) -> dict:
    args = ["--topology", topology, "--schedule", "csp", "--space", space, "--subnets", str(subnets), "--seed",
            str(seed), "--no-gantt", "--out", str(out), *flags]
    result = subprocess.run([sys.executable, "-m", "sim.run", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SpecError(f"sim.run {' '.join(args)} failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "metrics.json").read_text())


def _largest_stage_subnet_bytes(topology: str, space: str, subnets: int, seed: int) -> tuple[int, int]:
    """(largest parameter bytes one subnet needs on one stage, the whole supernet's parameter bytes)."""
    from sim.csp_plan import CspInputs, build_csp_problem

    supernet, _, stage_layers, chosen, _ = build_csp_problem(CspInputs(None, space, topology, subnets, seed))
    dtype = supernet.graph.dtype_bytes
    largest = 0
    for choice in chosen:
        for start, end in stage_layers:
            blocks = [i - 1 for i in range(start, end) if 1 <= i <= supernet.num_blocks]
            largest = max(largest, sum(supernet.candidates[b][choice[b]].params * dtype for b in blocks))
    return largest, supernet.graph.total_param_bytes()


def main(argv: list[str]) -> int:
    """``python -m experiments.run naspipe [options]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m experiments.run naspipe", description=__doc__.split("\n")[0])
    parser.error = lambda message: fail(message)  # type: ignore[method-assign]
    parser.add_argument("--out", default="runs/naspipe")
    parser.add_argument("--topology", default="8xV100")
    parser.add_argument("--spaces", default="c1,c2,c3")
    parser.add_argument("--subnets", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-factor", type=float, default=1.25,
                        help="device parameter budget in units of the largest subnet's bytes on a stage")
    args = parser.parse_args(argv)
    spaces = [s for s in args.spaces.split(",") if s]
    if args.subnets < 1 or not args.budget_factor >= 1:
        fail(f"--subnets must be >= 1 and --budget-factor >= 1, got {args.subnets}, {args.budget_factor}")
    out = Path(args.out)
    rows = []
    for space in spaces:
        largest, whole = _largest_stage_subnet_bytes(args.topology, space, args.subnets, args.seed)
        budget = int(largest * args.budget_factor)
        case = {}
        for name, flags in (("csp", []), ("csp+predict", ["--device-param-budget", str(budget), "--prefetch",
                                                          "predict"]),
                            ("csp+on_demand", ["--device-param-budget", str(budget), "--prefetch", "on_demand"]),
                            ("one-at-a-time", ["--one-at-a-time"])):
            metrics = _simulate(out / space / name, args.topology, space, args.subnets, args.seed, *flags)
            case[name] = metrics["csp"]["subnets_per_s"]
        rows.append({"space": space, "subnets_per_s": case, "speedup_csp": case["csp"] / case["one-at-a-time"],
                     "paper_naspipe_over_gpipe": PAPER_SPEEDUP.get(space), "device_budget_bytes": budget,
                     "supernet_bytes": whole})
        print(f"  {space}: " + ", ".join(f"{k} {v:.1f}/s" for k, v in case.items()), flush=True)
    lines = ["| space | csp | csp+predict | csp+on_demand | one-at-a-time | CSP ÷ one-at-a-time "
             "| paper NASPipe ÷ GPipe | device budget / supernet |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate = row["subnets_per_s"]
        paper = f"{row['paper_naspipe_over_gpipe']:.1f}×" if row["paper_naspipe_over_gpipe"] else "—"
        lines.append(f"| {row['space']} | {rate['csp']:.1f} | {rate['csp+predict']:.1f} | {rate['csp+on_demand']:.1f} "
                     f"| {rate['one-at-a-time']:.1f} | {row['speedup_csp']:.2f}× | {paper} | "
                     f"{row['device_budget_bytes'] / 1e6:.0f} MB / {row['supernet_bytes'] / 1e9:.2f} GB |")
    lines += ["", "subnets/s, simulated. Not like for like: our baseline runs one subnet at a time without "
              "microbatches; the paper's is GPipe; GPipe/1F1B/PipeDream on the same subnet sequence are not built yet."]
    table = "\n".join(lines)
    print()
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic({"topology": args.topology, "subnets": args.subnets, "seed": args.seed, "rows": rows},
                      out / "results.json")
    write_text_atomic(table + "\n", out / "table.md")
    print(f"wrote {out}/{{results.json, table.md}}")
    return 0
