"""What a search's rows rest on: each candidate's regime and the interval of its iteration time (issue #40).

A search ranks plans by predicted time; a pick from a regime no published run is in is an extrapolation, and the
rows say so. Each candidate's regime (:func:`sim.report.interval.regime`) is taken from its own choices (its
parallel degrees, ZeRO stage and precision), the problem's model family and the devices it runs on; its calibration
(:func:`sim.report.interval.calibrate`, on the shipped residuals) gives the 90 % interval of its time, the same one
``sim.run`` prints for the plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.hw.topology import Topology
from sim.models import build_model
from sim.report.interval import Calibration, CalibrationIndex, Regime, Residual, regime, shipped_index
from sim.search.space import MODEL_PRECISION, Candidate, SearchProblem

__all__ = ["Trust"]


class Trust:
    """The regimes and calibrations of one problem's candidates, each regime calibrated once."""

    def __init__(self, problem: SearchProblem, topology: Topology, residuals: Sequence[Residual] | None = None):
        graph = build_model(problem.model)
        self._family = graph.spec.partition(":")[0]
        self._model_precision = "fp32" if graph.dtype_bytes == 4 else "bf16"
        self._topology = topology
        self._index = shipped_index() if residuals is None else CalibrationIndex(residuals)
        self._regimes: dict[tuple, Regime] = {}  # a regime per distinct choice of what decides it

    def regime(self, candidate: Candidate) -> Regime:
        """``candidate``'s regime: its devices (those it names, or the first its world needs), the model's family,
        its precision, its parallel dimensions and its scale."""
        key = (candidate.devices, candidate.tp, candidate.cp, candidate.ep, candidate.pp, candidate.dp, candidate.zero,
               candidate.precision)
        found = self._regimes.get(key)
        if found is None:  # once per distinct choice: a space has many candidates and few regimes
            world = candidate.tp * candidate.cp * candidate.dp * candidate.pp
            indices = candidate.devices if candidate.devices else range(min(world, len(self._topology.devices)))
            names = [self._topology.devices[i].hardware.name for i in indices]
            precision = self._model_precision if candidate.precision == MODEL_PRECISION else candidate.precision
            degrees = {"tp": candidate.tp, "cp": candidate.cp, "ep": candidate.ep, "pp": candidate.pp,
                       "dp": candidate.dp}
            found = self._regimes[key] = regime(names, self._family, precision, degrees, candidate.zero)
        return found

    def calibration(self, candidate: Candidate) -> Calibration:
        """What ``candidate``'s interval rests on (:class:`sim.report.interval.Calibration`)."""
        return self._index.calibrate(self.regime(candidate))
