"""``python -m experiments.run NAME``: reproduce one experiment, print its table and write its files.

Experiments are registered by name in :data:`EXPERIMENTS`; ``python -m experiments.run list`` prints them. Each is a
module of the package's shape (``experiments/__init__.py``): this command parses its flags, calls its ``run``, prints
its ``report`` and has its ``write`` write its files (:func:`experiments.harness.execute`). Each one runs the
product's own tools, its command-line tools (``sim.run``, ``executor.run``) or the public functions behind
them (``sim.csp.csp_plan``, ``sim.csp.baselines``), so a result here is a result of the product and not of a private
code path.

An experiment that writes files has an ``--out`` directory, checked here before it runs
(:func:`sim.core.fileio.prepare_output_dir`: an unusable path is one ``error:`` line, not a traceback after minutes of
work), and its files are all or none (:func:`sim.core.errors.run_cli`). No name, or an unknown one, is one ``error:``
line with status 2.
"""

from __future__ import annotations

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

import sys
from collections.abc import Callable
from dataclasses import dataclass

from sim.core.cli import CliParser
from sim.core.errors import did_you_mean, fail, run_cli
from sim.core.fileio import prepare_output_dir

__all__ = ["EXPERIMENTS", "Experiment", "main", "make_parser"]


@dataclass(frozen=True)
class Experiment:
    """A registered experiment.

    Attributes:
        name: what to type after ``experiments.run``.
        description: one line for ``list``.
        main: ``argv -> exit status``: :func:`_command` runs the module by the package's convention.
        out: the default of its ``--out`` directory, or ``None`` if it writes no files. This is the one default:
            ``--out`` is always passed to ``main``.
    """

    name: str
    description: str
    main: Callable[[list[str]], int]
    out: str | None = None


def _command(name: str) -> Callable[[list[str]], int]:
    """The ``main`` of experiment ``name``: its module imported on demand (some need torch, others should not pay for
    it), run by :func:`experiments.harness.execute`, its report and ``wrote`` line printed, progress on stderr."""

    def main(argv: list[str]) -> int:
        from experiments import harness

        harness.execute(harness.load(name), argv, print, progress=_progress)
        return 0

    return main


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _results(argv: list[str]) -> int:
    from experiments import results

    return results.main(argv, {name: (entry.description, entry.out is not None) for name, entry in EXPERIMENTS.items()})


EXPERIMENTS: dict[str, Experiment] = {
    "csp_prefetch": Experiment("csp_prefetch", "NASPipe's predictor vs copy-on-demand over random CSP problems: how "
                               "often it is faster, equal, slower", _command("csp_prefetch")),
    "mixed_real": Experiment("mixed_real", "a real run on emulated mixed hardware: the plan sim.search picks for 2 CPU "
                             "ranks with one slowed 2x vs the homogeneous-assumption plan, measured with executor.run "
                             "--slowdown, and its prediction", _command("mixed_real"), out="runs/mixed_real"),
    "gpipe_scaling": Experiment("gpipe_scaling", "GPipe's Tables 2 and 3: normalised throughput over K partitions "
                                "and M microbatches for AmoebaNet-D and a Transformer on TPU v3 cores and PCIe "
                                "P100s, simulated beside the published figures", _command("gpipe_scaling"),
                                out="runs/gpipe_scaling"),
    "hetero_search": Experiment("hetero_search", "on mixed clusters, the searched plan against the Alpa "
                                "assumption's and the homogeneous assumption's, in simulated iteration time",
                                _command("hetero_search"), out="runs/hetero_search"),
    "memory": Experiment("memory", "peak activation memory per stage of gpipe, 1f1b, interleaved, zb1p and "
                         "pipedream, with and without recompute, simulated against the closed forms; a 6.7B GPT on "
                         "8xA100", _command("memory"), out="runs/memory"),
    "memory_real": Experiment("memory_real", "peak memory per rank, predicted vs measured by executor.run "
                              "--measure-memory on 2-4 CPU ranks: every schedule with and without recompute, DP "
                              "and TP; and per layer, the bytes autograd saves beside the simulator's",
                              _command("memory_real"),
                              out="runs/memory_real"),
    "memory_suite": Experiment("memory_suite", "peak memory on a seeded random suite of small plans (models, "
                               "schedules, recomputation, DP/TP/PP, ZeRO), predicted vs executor.run --measure-memory "
                               "on every CPU rank", _command("memory_suite"), out="runs/memory_suite"),
    "naspipe": Experiment("naspipe", "NASPipe CSP vs GPipe, 1F1B, PipeDream and its ablations on search spaces "
                          "c1-c3, 8xV100, simulated, beside the paper's speedups", _command("naspipe"),
                          out="runs/naspipe"),
    "naspipe_paper": Experiment("naspipe_paper", "NASPipe vs GPipe under the artifact's own conditions (GPipe's "
                                "whole supernet resident at 32/64/128 x 8 tokens, NASPipe at 192 x 64 from host "
                                "memory), in tokens/s beside the paper's 8.0/4.3/2.8x", _command("naspipe_paper"),
                                out="runs/naspipe_paper"),
    "partime": Experiment("partime", "PARTIME's stream on 1-8 stages of an 8xV100 node, four conv configurations "
                          "at 256 and 1024 px, eager and with CUDA graphs, simulated beside the authors' findings; "
                          "step time predicted vs measured on 2 CPU ranks", _command("partime"), out="runs/partime"),
    "partime_drift": Experiment("partime_drift", "what PARTIME's delayed-gradient update costs: its online loss "
                                "against exact online SGD on a drifting synthetic stream and across a scene cut, "
                                "1/2/4/8 stages", _command("partime_drift"), out="runs/partime_drift"),
    "pipedream": Experiment("pipedream", "PipeDream's claims: no stall in the steady state (uniform stages against "
                            "the closed forms), weight stashing's memory against GPipe and 1F1B, and pipedream_vs_dp's "
                            "throughput beside the published 5.28x / 2.98x", _command("pipedream"),
                            out="runs/pipedream"),
    "pipedream_vs_dp": Experiment("pipedream_vs_dp", "the best pipeline plan vs pure data parallelism for VGG-16, "
                                  "a GPT and a small CNN on 16 V100s over 10 GbE, 25 GbE and NVSwitch, simulated, "
                                  "beside PipeDream's speedups", _command("pipedream_vs_dp"),
                                  out="runs/pipedream_vs_dp"),
    "vtrain": Experiment("vtrain", "the simulator against vTrain's 1,440 third-party Megatron-DeepSpeed runs on 2-8 "
                         "A100s, per (TP, DP, PP) group, on a seeded held-out half, and how it ranks configurations",
                         _command("vtrain"), out="runs/vtrain"),
    "torchtitan": Experiment("torchtitan", "torchtitan's 32 published Llama 3.1 runs on 8-512 H100s and 32-64 H200s "
                             "(FSDP, TP, PP, CP, Float8, torch.compile), predicted beside the published tokens/s per "
                             "GPU; only their H100's three unpublished ceilings fitted, on a seeded half",
                             _command("torchtitan"),
                             out="runs/torchtitan"),
    "megatron_bridge": Experiment("megatron_bridge", "Megatron-Bridge's published pre-training rows on GB200, GB300 "
                                  "and B300 (Llama 3 and the mixtures of experts Qwen3, GPT-OSS, DeepSeek-V3; TP, PP, "
                                  "VP, CP, EP, FSDP; BF16, FP8, MXFP8, NVFP4), each expressible row predicted beside "
                                  "the published tokens/s per GPU, nothing fitted", _command("megatron_bridge"),
                                  out="runs/megatron_bridge"),
    "coverage": Experiment("coverage", "every published run predicted (vTrain, torchtitan, Megatron-Bridge) and "
                           "the 90 % intervals per regime calibrated on a seeded half of each data set, checked on "
                           "the other half; --write stores the calibration the tool ships", _command("coverage"),
                           out="runs/coverage"),
    "deepseek_v3": Experiment("deepseek_v3", "DeepSeek-V3's pre-training on 2,048 H800s (PP 16, EP 64, ZeRO-1, FP8) "
                              "as its report describes it, predicted beside the 1,543 tokens/s per GPU its 180 K "
                              "GPU-hours per trillion tokens imply, nothing fitted", _command("deepseek_v3"),
                              out="runs/deepseek_v3"),
    "second_opinion": Experiment("second_opinion", "for each published torchtitan and Megatron-Bridge row, the "
                                 "search's best plan for the same model, GPUs, global batch and precision beside the "
                                 "published plan: its predicted speed-up and which dimensions moved (predictions, "
                                 "not measurements)", _command("second_opinion"), out="runs/second_opinion"),
    "faults": Experiment("faults", "goodput under failures of a 70B-class plan on 1k-16k H100s: restart from the "
                         "checkpoint, drop a replica, ReCycle's rerouting and Oobleck's re-planning, over the MTBF, "
                         "beside Llama 3's > 90 % effective training time", _command("faults"), out="runs/faults"),
    "faults_real": Experiment("faults_real", "a straggler (--slowdown) and a crash with a restart from the checkpoint "
                              "on 2 CPU ranks, measured against their predictions", _command("faults_real"),
                              out="runs/faults_real"),
    "zeno": Experiment("zeno", "one Byzantine replica of four on CPU ranks: the loss of plain averaging against Zeno's "
                       "aggregation, and what Zeno costs per step, simulated and measured", _command("zeno"),
                       out="runs/zeno"),
    "search_vtrain": Experiment("search_vtrain", "sim.search restricted to the configurations vTrain measured in "
                                "each (model, GPUs, global batch) group: Spearman of its ranking and the top-1 "
                                "regret of its pick", _command("search_vtrain"), out="runs/search_vtrain"),
    "relaxed_search": Experiment("relaxed_search", "the differentiable relaxation of per-stage choices against the "
                                 "balanced DP, annealing and brute force on a seeded suite, in simulated iteration "
                                 "time", _command("relaxed_search"), out="runs/relaxed_search"),
    "search_strategies": Experiment("search_strategies", "the search's strategies (brute force, planner, joint DP, "
                                    "annealing from it, Alpa assumption) against each other on a seeded suite, in "
                                    "simulated iteration time", _command("search_strategies"),
                                    out="runs/search_strategies"),
    "sim_vs_real": Experiment("sim_vs_real", "simulator fidelity: predicted vs measured iteration time on 2 CPU "
                              "ranks, gpipe and 1f1b x 4/8/16 microbatches, calibrated profile",
                              _command("sim_vs_real"),
                              out="runs/sim_vs_real"),
    "megatron_interleaved": Experiment("megatron_interleaved", "interleaved 1F1B vs 1F1B over p, m and chunks v: "
                                       "uniform stages against the closed form, a GPT on A100 and V100 nodes, and "
                                       "the extra messages, beside SC'21's 10+%", _command("megatron_interleaved"),
                                       out="runs/megatron_interleaved"),
    "zero_bubble": Experiment("zero_bubble", "ZB-H1 vs 1F1B over p and m: uniform stages against the closed forms, "
                              "a GPT on A100s, beside the published 23%", _command("zero_bubble"),
                              out="runs/zero_bubble"),
    "results": Experiment("results", "every experiment above run again, its printed tables and figures gathered into "
                          "docs/results.md", _results, out="runs/results"),
}


def make_parser() -> CliParser:
    """The ``experiments.run`` argument parser (each experiment's own options: ``NAME --help``)."""
    parser = CliParser(prog="python -m experiments.run", description=__doc__.split("\n\n")[0],
                       epilog=f"experiments: {', '.join(sorted(EXPERIMENTS))}; NAME --help shows its options")
    parser.add_argument("name", help="experiment name, or 'list'")
    return parser


def _with_checked_out(experiment: Experiment, rest: list[str]) -> list[str]:
    """``rest`` with ``--out`` given (the registry's default if it was not), after checking and making that
    directory; ``rest`` unchanged for an experiment without files or a call for its help."""
    if experiment.out is None or {"-h", "--help"} & set(rest):
        return rest
    finder = CliParser(prog=f"python -m experiments.run {experiment.name}", add_help=False)
    finder.add_argument("--out")
    given, _ = finder.parse_known_args(rest)
    prepare_output_dir(given.out if given.out is not None else experiment.out, "--out")
    return rest if given.out is not None else [*rest, "--out", experiment.out]


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if argv[:1] in (["-h"], ["--help"]):
            make_parser().print_help()
            return 0
        if not argv:
            fail(f"name an experiment ({', '.join(sorted(EXPERIMENTS))}) or 'list': python -m experiments.run NAME")
        name, rest = argv[0], argv[1:]
        if name == "list":
            for experiment in EXPERIMENTS.values():
                print(f"{experiment.name:<14} {experiment.description}")
            return 0
        if name not in EXPERIMENTS:
            fail(f"unknown experiment {name!r}{did_you_mean(name, EXPERIMENTS)} (known: "
                 f"{', '.join(sorted(EXPERIMENTS))})")
        experiment = EXPERIMENTS[name]
        return experiment.main(_with_checked_out(experiment, rest))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
