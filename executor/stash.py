"""Weight stashing for async PipeDream plans (``weight_policy = "stash"``; Narayanan et al., SOSP'19 §3.3).

A stage updates its weights after every microbatch, while other microbatches that started under older weights are
still in flight. Each F therefore runs with the weight version :func:`sim.ir.weight_versions.weight_versions` assigns to
it (the same function the simulator uses), its R and backward run with that same version, and the OPT_STEP that
follows moves the microbatch's gradient onto the live parameters and steps the optimizer there.

Versions are kept as detached copies, made when a version comes into being (at the start of the iteration and after
each update) and only if some forward still to run needs it; a version is dropped once its last forward has
started. Every microbatch gets its own leaf tensors over the version's storage, so gradients of two microbatches
that share a version never mix. The pipeline drains at the end of each iteration, so versions are counted from the
start of the iteration (version u = the iteration's first weights plus u updates).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from torch import Tensor, nn

from sim.ir.plan import Plan
from sim.ir.weight_versions import weight_versions

__all__ = ["StashedWeights"]


class StashedWeights:
    """The weight versions one rank keeps for its vstages.

    Args:
        plan: a lowered stash plan.
        rank: this rank.
        stages: vstage → module (its parameters are the live weights the optimizer updates).
    """

    def __init__(self, plan: Plan, rank: int, stages: Mapping[int, nn.Module]) -> None:
        self.stages = stages
        self.versions = {key: u for key, u in weight_versions(plan).items() if key[0] in stages}
        self.begin_iteration()

    def begin_iteration(self) -> None:
        """Start counting versions afresh from the live weights (the pipeline drained at the last iteration's end)."""
        self.updates = {v: 0 for v in self.stages}
        self.needed = {v: Counter(u for (w, _), u in self.versions.items() if w == v) for v in self.stages}
        self.history: dict[int, dict[int, dict[str, Tensor]]] = {v: {} for v in self.stages}
        self.leaves: dict[tuple[int, int], dict[str, Tensor]] = {}
        for v in self.stages:
            self._keep_if_needed(v)

    def _keep_if_needed(self, v: int) -> None:
        version = self.updates[v]
        if self.needed[v][version] > 0:
            self.history[v][version] = {name: p.detach().clone() for name, p in self.stages[v].named_parameters()}

    def stashed_versions(self, v: int) -> int:
        """How many versions of vstage ``v`` are held now (for tests and memory accounting)."""
        return len(self.history[v])

    def weights_for(self, v: int, mb: int, *, first: bool) -> dict[str, Tensor]:
        """The parameters microbatch ``mb`` runs vstage ``v`` with; ``first`` for its F, else R or backward."""
        if first:
            version = self.versions[(v, mb)]
            source = self.history[v][version]
            self.leaves[(v, mb)] = {name: t.detach().requires_grad_(True) for name, t in source.items()}
            self.needed[v][version] -= 1
            if self.needed[v][version] == 0:
                del self.history[v][version]
        return self.leaves[(v, mb)]

    def move_gradients(self, v: int, mb: int) -> None:
        """Hand microbatch ``mb``'s gradients of vstage ``v`` to the live parameters (before the optimizer step)."""
        leaves = self.leaves.pop((v, mb))
        for name, param in self.stages[v].named_parameters():
            param.grad = leaves[name].grad

    def updated(self, v: int) -> None:
        """Record that the optimizer stepped vstage ``v``: a new version exists."""
        self.updates[v] += 1
        self._keep_if_needed(v)
