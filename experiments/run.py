"""``python -m experiments.run NAME``: reproduce one experiment, print its table and write its files.

Experiments are registered by name in :data:`EXPERIMENTS`; ``python -m experiments.run list`` prints them. Each one
runs the product's own tools, its command-line tools (``sim.run``, ``executor.run``) or the public functions behind
them (``sim.csp.build``, ``sim.csp.baselines``), so a result here is a result of the product and not of a private
code path.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from sim.core.errors import fail, run_cli

__all__ = ["EXPERIMENTS", "Experiment", "main"]


@dataclass(frozen=True)
class Experiment:
    """A registered experiment.

    Attributes:
        name: what to type after ``experiments.run``.
        description: one line for ``list``.
        main: ``argv -> exit status``; parses its own options.
    """

    name: str
    description: str
    main: Callable[[list[str]], int]


def _sim_vs_real(argv: list[str]) -> int:
    from experiments import sim_vs_real  # imported on demand: it needs torch, others may not

    return sim_vs_real.main(argv)


def _csp_prefetch(argv: list[str]) -> int:
    from experiments import csp_prefetch

    return csp_prefetch.main(argv)


def _naspipe(argv: list[str]) -> int:
    from experiments import naspipe

    return naspipe.main(argv)


EXPERIMENTS: dict[str, Experiment] = {
    "csp_prefetch": Experiment("csp_prefetch", "NASPipe's predictor vs copy-on-demand over random CSP problems: how "
                               "often it is faster, equal, slower", _csp_prefetch),
    "naspipe": Experiment("naspipe", "NASPipe CSP vs GPipe, 1F1B, PipeDream and its ablations on search spaces "
                          "c1-c3, 8xV100, simulated, beside the paper's speedups", _naspipe),
    "sim_vs_real": Experiment("sim_vs_real", "simulator fidelity: predicted vs measured iteration time on 2 CPU "
                              "ranks, gpipe and 1f1b x 4/8/16 microbatches, calibrated profile", _sim_vs_real),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if not argv or argv[0] in ("-h", "--help"):
            parser = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.split("\n\n")[0])
            parser.add_argument("name", help="experiment name, or 'list'")
            parser.print_help()
            return 0 if argv else 2
        name, rest = argv[0], argv[1:]
        if name == "list":
            for experiment in EXPERIMENTS.values():
                print(f"{experiment.name:<14} {experiment.description}")
            return 0
        if name not in EXPERIMENTS:
            fail(f"unknown experiment {name!r} (known: {', '.join(sorted(EXPERIMENTS))})")
        return EXPERIMENTS[name].main(rest)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
