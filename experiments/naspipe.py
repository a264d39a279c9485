"""NASPipe (ASPLOS'22) in simulation: CSP against GPipe, 1F1B, PipeDream and its own ablations (NASPipe §6).

For each search space (``c1``–``c3``, NASPipe's naming: c1 the largest) on ``8xV100``, one seeded subnet sequence
(each subnet one minibatch of ``--minibatch`` samples) is trained under

* ``csp`` — CSP, every layer resident; ``csp+predict`` / ``csp+on_demand`` — CSP with the supernet in host memory
  and a device parameter budget of ``--budget-factor`` × the largest subnet's choice-block bytes on a stage, with
  and without the predictor; ``one-at-a-time`` — CSP's ablation without overlap (:mod:`sim.csp.simulate`);
* ``gpipe`` / ``1f1b`` — each subnet one iteration of ``--microbatches`` microbatches, a flush in between;
  ``pipedream`` — asynchronous, no flush, no causal dependencies, stashed weights (:mod:`sim.csp.baselines`).

It prints and writes (``results.json``, ``table.md``, ``naspipe.png``) subnets/s per case, throughput relative to
GPipe beside the paper's (``../shared/reference/hardware.md`` §4.1: NASPipe/GPipe 8.0×, 4.3×, 2.8× and PipeDream/GPipe
0.91×, 0.80×, 1.25× on c1, c2, c3, from the artifact's sample output on 4 GPUs), and the device parameter bytes per
case against the whole supernet's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from sim.core.cli import CliParser
from sim.core.errors import SpecError
from sim.core.fileio import write_json_atomic, write_text_atomic

__all__ = ["PAPER_OVER_GPIPE", "CASES", "Result", "parser", "run", "report", "write"]

#: Throughput relative to GPipe in the artifact's sample output (hardware.md §4.1): (NASPipe, PipeDream).
PAPER_OVER_GPIPE = {"c1": (8.0, 0.91), "c2": (4.3, 0.80), "c3": (2.8, 1.25)}

#: Case names, in table order.
CASES = ("csp", "csp+predict", "csp+on_demand", "one-at-a-time", "gpipe", "1f1b", "pipedream")


def _stage_block_bytes(supernet, stage_layers) -> list[int]:
    """Per stage, the parameter bytes of every candidate of its choice blocks (what the budget is about), bytes."""
    dtype = supernet.graph.dtype_bytes
    return [sum(c.params * dtype for i in range(start, end) if 1 <= i <= supernet.num_blocks
                for c in supernet.candidates[i - 1]) for start, end in stage_layers]


def _space(args: argparse.Namespace, space: str) -> dict:
    """Every case on one space: subnets/s and the most parameter bytes any device holds."""
    from sim.csp.baselines import run_baseline, stage_supernet_bytes
    from sim.csp.csp_plan import CspInputs, build_csp_plan, build_csp_problem
    from sim.predict import predict

    inputs = CspInputs(None, space, args.topology, args.subnets, args.seed, args.lookahead, args.minibatch)
    plan, setup, problem = build_csp_problem(inputs)
    supernet, stage_layers = setup.supernet, plan.placement.vstage_layers
    resident = stage_supernet_bytes(supernet, stage_layers)
    shared = [whole - blocks for whole, blocks in zip(resident, _stage_block_bytes(supernet, stage_layers))]
    largest = max(sum(problem.key_bytes[k] for k in row[s]) for row in problem.uses for s in range(len(row)))
    budget = int(largest * args.budget_factor)
    rates, device_bytes, copy_wait = {}, {}, {}
    for name, policy, one in (("csp", "resident", False), ("csp+predict", "predict", False),
                              ("csp+on_demand", "on_demand", False), ("one-at-a-time", "resident", True)):
        budgeted = policy != "resident"
        case = replace(inputs, one_at_a_time=one, device_param_budget_bytes=budget if budgeted else None,
                       prefetch=policy if budgeted else None)
        run = predict(build_csp_plan(case)).csp
        assert run is not None
        rates[name] = args.subnets / run.makespan
        device_bytes[name] = (max(shared[c.stage] + c.peak_resident_bytes for c in run.copies) if budgeted
                              else max(resident))
        if budgeted:
            copy_wait[name] = sum(c.copy_wait_s for c in run.copies)
    for name in ("gpipe", "1f1b", "pipedream"):
        baseline = run_baseline(inputs, name, args.microbatches)
        rates[name] = baseline.subnets_per_s
        device_bytes[name] = max(baseline.device_param_bytes)
    naspipe_paper, pipedream_paper = PAPER_OVER_GPIPE.get(space, (None, None))
    return {"space": space, "spec": supernet.graph.spec, "subnets_per_s": rates,
            "over_gpipe": {k: v / rates["gpipe"] for k, v in rates.items()},
            "paper_over_gpipe": {"naspipe": naspipe_paper, "pipedream": pipedream_paper},
            "device_param_bytes": device_bytes, "supernet_bytes": supernet.graph.total_param_bytes(),
            "device_budget_bytes": budget, "copy_wait_s": copy_wait}


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    head = "| space | " + " | ".join(CASES) + " | paper NASPipe / GPipe | paper PipeDream / GPipe |"
    lines = [head, "|---|" + "---:|" * (len(CASES) + 2)]
    for row in rows:
        rel = row["over_gpipe"]
        paper = row["paper_over_gpipe"]
        cells = [f"{row['subnets_per_s'][c]:.1f} ({rel[c]:.2f}×)" for c in CASES]
        fmt = [f"{paper[k]:.2f}×" if paper[k] else "—" for k in ("naspipe", "pipedream")]
        lines.append(f"| {row['space']} | " + " | ".join(cells) + f" | {fmt[0]} | {fmt[1]} |")
    lines += ["", "subnets/s (× GPipe), simulated on " + f"{args.topology}, {args.subnets} subnets of "
              f"{args.minibatch} samples, seed {args.seed}; gpipe/1f1b split each subnet into {args.microbatches} "
              "microbatches.", "", "| space | supernet | " + " | ".join(f"device: {c}" for c in CASES) + " |",
              "|---|---:|" + "---:|" * len(CASES)]
    for row in rows:
        cells = [f"{row['device_param_bytes'][c] / 1e6:.0f} MB" for c in CASES]
        lines.append(f"| {row['space']} | {row['supernet_bytes'] / 1e6:.0f} MB | " + " | ".join(cells) + " |")
    lines += ["", "Most parameter bytes on one device (fp16; shared layers included; pipedream counts its stashed "
              "versions). The budgeted CSP cases hold at most the budget of choice-block parameters."]
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    """Grouped bars of throughput relative to GPipe per space, with the paper's values as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(CASES)
    for k, case in enumerate(CASES):
        xs = [i + (k - len(CASES) / 2 + 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [row["over_gpipe"][case] for row in rows], width, label=case)
    for i, row in enumerate(rows):
        for key, marker in (("naspipe", "*"), ("pipedream", "x")):
            if row["paper_over_gpipe"][key]:
                ax.plot([i], [row["paper_over_gpipe"][key]], marker, color="black", markersize=10,
                        label=f"paper {key} / GPipe" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [row["space"] for row in rows])
    ax.set_ylabel("throughput / GPipe")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Result:
    """The settings (as the flags gave them) and one row per space: subnets/s of every case, relative to GPipe, the
    paper's ratios, the most parameter bytes on a device, the supernet's bytes, the budget (bytes) and the budgeted
    cases' copy waits (s); ``plot``: whether ``write`` draws ``naspipe.png``."""

    settings: argparse.Namespace
    rows: tuple[dict, ...]
    plot: bool = True


def parser() -> CliParser:
    """``python -m experiments.run naspipe [options]``."""
    parser = CliParser(prog="python -m experiments.run naspipe", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/naspipe", help="output directory (default runs/naspipe)")
    parser.add_argument("--topology", default="8xV100", help="the cluster simulated (default 8xV100, NASPipe's)")
    parser.add_argument("--spaces", default="c1,c2,c3", help="supernet spaces, comma-separated (default c1,c2,c3)")
    parser.add_argument("--subnets", type=int, default=64, help="subnets trained in sequence (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the subnet sampler (default 0)")
    parser.add_argument("--lookahead", type=int, default=30, help="most subnets in flight under CSP (NASPipe: 30)")
    parser.add_argument("--minibatch", type=int, default=32, help="samples per subnet (32 x 128 tokens, about "
                        "NASPipe's 3840-token batches)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per subnet for gpipe and 1f1b")
    parser.add_argument("--budget-factor", type=float, default=1.25,
                        help="device parameter budget in units of the largest subnet's bytes on a stage")
    parser.add_argument("--no-plot", action="store_true", help="skip the figure")
    return parser


def run(*, topology: str = "8xV100", spaces: str = "c1,c2,c3", subnets: int = 64, seed: int = 0, lookahead: int = 30,
        minibatch: int = 32, microbatches: int = 8, budget_factor: float = 1.25, no_plot: bool = False) -> Result:
    """Every case on every space of ``spaces`` (comma-separated) on ``topology``; ``budget_factor`` sizes the device
    parameter budget in units of the largest subnet's bytes on a stage; ``no_plot``: ``write`` draws no figure.

    Raises:
        SpecError: a count below 1, a budget factor below 1, microbatches that do not divide the minibatch (each
            named by its flag), or a bad space or topology.
    """
    settings = argparse.Namespace(topology=topology, subnets=subnets, seed=seed, lookahead=lookahead,
                                  minibatch=minibatch, microbatches=microbatches, budget_factor=budget_factor)
    for name in ("subnets", "lookahead", "minibatch", "microbatches"):
        if getattr(settings, name) < 1:
            raise SpecError(f"--{name} must be >= 1, got {getattr(settings, name)}")
    if not budget_factor >= 1:
        raise SpecError(f"--budget-factor must be >= 1, got {budget_factor}")
    if minibatch % microbatches:
        raise SpecError(f"--microbatches {microbatches} must divide --minibatch {minibatch}")
    rows = tuple(_space(settings, space) for space in spaces.split(",") if space)
    return Result(settings, rows, not no_plot)


def report(result: Result) -> str:
    """Each space's rates, then the tables of rates and device bytes."""
    return "\n".join([*(f"  {row['space']}: " + ", ".join(f"{k} {v:.1f}/s" for k, v in row["subnets_per_s"].items())
                        for row in result.rows), "", _table(list(result.rows), result.settings)])


def write(result: Result, out: Path) -> list[Path]:
    """``results.json`` (the settings and rows), ``table.md`` and, unless ``--no-plot``, ``naspipe.png`` in ``out``."""
    s = result.settings
    write_json_atomic({"topology": s.topology, "subnets": s.subnets, "seed": s.seed, "minibatch": s.minibatch,
                       "microbatches": s.microbatches, "lookahead": s.lookahead, "budget_factor": s.budget_factor,
                       "rows": list(result.rows)}, out / "results.json")
    write_text_atomic(_table(list(result.rows), s) + "\n", out / "table.md")
    if not result.plot:
        return [out / "results.json", out / "table.md"]
    _plot(list(result.rows), out / "naspipe.png")
    return [out / "results.json", out / "table.md", out / "naspipe.png"]
