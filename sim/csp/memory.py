"""Context switching on one CSP stage: which layer keys are resident, what to copy in and what to write back.

NASPipe (§4.3) keeps the whole supernet in host memory and copies a subnet's layers to the device before its
forward; a predictor guesses the next forward so the copy can start early. This module is the decision side of it,
torch-free and shared: the simulator (:mod:`sim.csp.simulate`, which also times the copies on its copy engines) and the
executor (``executor.csp.runner``, with ``executor.csp.offload`` moving the tensors) both ask a :class:`StageMemory`,
so a rank decides from its state exactly what the simulator decides from the same state. The rules (their reasons
are in :mod:`sim.csp.simulate`, "Context switching"):

* the device starts empty and holds at most ``budget`` bytes of layer keys; a forward needs all its keys resident;
* a *pinned* key (used by a subnet whose forward has started here and that has not finished here) is never evicted;
* eviction follows Belady's rule on the known subnet sequence: the key used again furthest in the future goes
  first, least recently used among equals; a prefetch evicts only keys whose next use comes after its subnet, and is
  dropped when that is not enough or its subnet has started;
* memory admission: an arrival ``b`` may be picked only if ``keys(b) ∪ pinned ∪ keys(w)`` fits for every earlier
  unfinished ``w`` that has not started (deadlock freedom);
* the predictor runs :func:`sim.csp.rules.predict_next` on the assumed state of the next forward decision: the last
  stage finishes the running subnet first (its loss is part of F), waiting gradients finish first, the next subnet to
  arrive counts as arrived, admission applies.

Bytes are the plan's (``problem.key_bytes``: parameters × the graph's ``dtype_bytes``, as ``sim.run`` counts them),
so ``--device-param-budget`` means the same for the executor as for the simulator.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from sim.csp.rules import SubnetTable, predict_next, wait_list

__all__ = ["CopyPlan", "StageMemory", "StageState"]


@dataclass
class StageState:
    """The CSP state of one stage, owned and updated by the rank's loop (names as in :mod:`sim.csp.rules`).

    Attributes:
        arrived: subnets whose forward input is here and whose forward has not started, in arrival order.
        finished: subnets whose backward and update are done here.
        upper: one more than the highest subnet id that has arrived here (NASPipe's ``wait_upper``).
        grads: subnets whose output gradient is here and whose backward has not run, in arrival order.
    """

    arrived: list[int] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    upper: int = 0
    grads: list[int] = field(default_factory=list)

    def unfinished(self) -> frozenset[int]:
        """NASPipe's ``wait_list``: every id below ``upper`` not finished here (:func:`sim.csp.rules.wait_list`)."""
        return wait_list(self.upper, self.finished)


@dataclass(frozen=True)
class CopyPlan:
    """One context switch: write ``victims`` back (op ``EVICT``), then copy ``missing`` in (op ``PREFETCH``).

    Attributes:
        subnet: whose keys are copied in (the op ids' subnet).
        missing: keys to copy host → device.
        victims: keys to write back device → host first, in eviction order (module docstring).
    """

    subnet: int
    missing: tuple[Hashable, ...]
    victims: tuple[Hashable, ...]


class StageMemory:
    """The resident set of one stage under a parameter budget, and the copy statistics in plan bytes.

    Args:
        stage: the stage (rank).
        num_stages: stages in the pipeline (the last one's forward includes the loss).
        uses: the subnet table, ``uses[subnet][stage]`` → layer keys.
        key_bytes: bytes of each layer key.
        budget: most bytes of layer keys resident at once.
        state: the stage's CSP state, read (never written) here.
    """

    def __init__(self, stage: int, num_stages: int, uses: SubnetTable, key_bytes: Mapping[Hashable, int],
                 budget: int, state: StageState) -> None:
        self.stage, self.last = stage, stage == num_stages - 1
        self.uses, self.key_bytes, self.budget, self.state = uses, key_bytes, budget, state
        self.users: dict[Hashable, list[int]] = {}  # key → the subnets using it here, ascending
        for b, row in enumerate(uses):
            for k in row[stage]:
                self.users.setdefault(k, []).append(b)
        self.resident: dict[Hashable, int] = {}  # key → last-use stamp (LRU)
        self.started: set[int] = set()  # forward started, not finished here: its keys are pinned
        self.stamp = 0
        self.used = self.peak = 0  # resident bytes now, and the most at once
        self.h2d_bytes = self.d2h_bytes = self.prefetches = self.evictions = 0

    def keys(self, b: int) -> frozenset[Hashable]:
        """Subnet ``b``'s layer keys on this stage."""
        return self.uses[b][self.stage]

    def nbytes(self, keys: Collection[Hashable]) -> int:
        """Bytes of ``keys``."""
        return sum(self.key_bytes[k] for k in keys)

    def pinned(self, started: Collection[int] | None = None) -> set[Hashable]:
        """Keys of the started, unfinished subnets (``started`` replaces them for an assumed state)."""
        return set().union(*(self.keys(c) for c in (self.started if started is None else started)))

    def admitted(self, arrived: Sequence[int], unfinished: Collection[int],
                 started: Collection[int] | None = None) -> tuple[int, ...]:
        """The arrivals whose forward may start memory-wise (memory admission), in arrival order."""
        started = self.started if started is None else started
        pinned = self.pinned(started)
        ok = []
        for b in arrived:
            base = pinned | self.keys(b)
            earlier = [w for w in unfinished if w < b and w not in started]
            if self.nbytes(base) <= self.budget and all(self.nbytes(base | self.keys(w)) <= self.budget
                                                        for w in earlier):
                ok.append(b)
        return tuple(ok)

    def touch(self, keys: Collection[Hashable]) -> None:
        """Mark ``keys`` used now (a forward, an update or a copy), in a fixed order so stamps are reproducible."""
        for k in sorted(keys, key=repr):
            self.stamp += 1
            self.resident[k] = self.stamp

    def start(self, b: int) -> None:
        """``b``'s forward is starting: pin its keys."""
        self.started.add(b)

    def finish(self, b: int) -> None:
        """``b``'s update is done here: unpin its keys, which it just used."""
        self.started.discard(b)
        self.touch(self.keys(b))

    def next_use(self, key: Hashable, done: Collection[int] = ()) -> int:
        """The next subnet to use ``key`` here: the smallest user neither started nor finished (nor in ``done``);
        the number of subnets when none will."""
        st = self.state
        for b in self.users.get(key, ()):
            if b not in st.finished and b not in done and b not in self.started:
                return b
        return len(self.uses)

    def _victims(self, need: int, candidates: set[Hashable], done: Collection[int] = (),
                 before: int | None = None, in_use: frozenset[Hashable] = frozenset()) -> list[Hashable] | None:
        """Keys to evict so that ``need`` more bytes fit, or None if impossible: from ``candidates``, the one used
        again furthest in the future first, least recently used among equals; with ``before``, only keys whose next
        use comes after subnet ``before``; a key of ``in_use`` (resident, pinned) that Belady's order reaches before
        enough is free stops the search (None): the copy should wait until that key can go instead."""
        free = self.budget - self.used
        victims: list[Hashable] = []
        # Stamps are unique per resident key, so the key itself is never compared.
        for next_use, _, k in sorted((-self.next_use(k, done), self.resident[k], k) for k in candidates | in_use):
            if free >= need:
                break
            if k in in_use or (before is not None and -next_use <= before):
                break  # a key still in use should go first, or every remaining key is needed no later than before
            victims.append(k)
            free += self.key_bytes[k]
        return victims if free >= need else None

    def _missing(self, b: int) -> tuple[Hashable, ...]:
        return tuple(sorted((k for k in self.keys(b) if k not in self.resident), key=repr))

    def demand(self, b: int) -> CopyPlan | None:
        """The copy that makes started subnet ``b``'s keys resident, or None when they all are.

        Raises:
            RuntimeError: no room even after evicting every unpinned key (admission rules it out).
        """
        missing = self._missing(b)
        if not missing:
            return None
        victims = self._victims(self.nbytes(missing), set(self.resident) - self.pinned() - self.keys(b))
        if victims is None:
            raise RuntimeError(f"stage {self.stage}: no room for subnet {b}'s layers under {self.budget} B")
        return CopyPlan(b, missing, tuple(victims))

    def predict(self, running: int | None) -> tuple[int, frozenset[int]] | None:
        """Whom to prefetch for: ``(subnet, done)``, ``done`` being the subnets assumed finished by then; None when
        the predicted subnet's keys are all resident or nothing can be predicted.

        Args:
            running: the subnet whose forward was just picked (still in ``state.arrived``), or None after an update.
        """
        st = self.state
        done = set(st.grads) | ({running} if self.last and running is not None else set())
        started = (self.started | ({running} if running is not None else set())) - done
        # The sequence is sampled ahead and subnets mostly arrive in id order: the next one, id ``upper``, counts as
        # arrived, or a stage fed one subnet at a time would never have anything to predict while it computes.
        coming = (st.upper,) if st.upper < len(self.uses) else ()
        unfinished = wait_list(st.upper + len(coming), st.finished)
        rest = frozenset(w for w in unfinished if w not in done)
        arrived = self.admitted(tuple(b for b in st.arrived if b != running) + coming, rest, started)
        x = predict_next(self.stage, arrived, unfinished, running, self.uses, finishes=self.last, finishing=st.grads)
        if x is None or self.keys(x) <= self.resident.keys():
            return None
        return x, frozenset(done)

    def prefetch(self, x: int, done: Collection[int]) -> CopyPlan | None:
        """The prefetch for predicted subnet ``x``, re-checked now; None when it has started or finished (its demand
        copy did the work), nothing is missing, or there is no room without evicting a key needed up to ``x`` or
        before a key that is still in use."""
        if x in self.started or x in self.state.finished:
            return None
        missing = self._missing(x)
        if not missing:
            return None
        # Evicting now, while the running subnet pins its keys, must not pick a worse victim than the demand copy
        # would later: if Belady's order reaches a pinned key first, the prefetch is dropped (it retries after the
        # next update).
        pinned = self.pinned()
        victims = self._victims(self.nbytes(missing), set(self.resident) - pinned - self.keys(x), done, before=x,
                                in_use=frozenset((pinned - self.keys(x)) & self.resident.keys()))
        return None if victims is None else CopyPlan(x, missing, tuple(victims))

    def apply(self, plan: CopyPlan) -> None:
        """Account for ``plan`` having run at once (the executor copies synchronously on its timeline)."""
        self.begin(plan)
        self.evicted(plan)
        self.copying(plan)
        self.copied(plan)

    # The simulator times the two copies, so it applies a plan in the four steps below, in this order.

    def begin(self, plan: CopyPlan) -> None:
        """``plan`` is decided: its victims stop being resident (nobody may use or evict them any more)."""
        for k in plan.victims:
            del self.resident[k]

    def evicted(self, plan: CopyPlan) -> None:
        """The write-back of ``plan``'s victims is done: their bytes are free."""
        if plan.victims:
            self.used -= self.nbytes(plan.victims)
            self.d2h_bytes += self.nbytes(plan.victims)
            self.evictions += len(plan.victims)

    def copying(self, plan: CopyPlan) -> None:
        """The copy-in of ``plan``'s missing keys starts: their bytes are taken."""
        self.used += self.nbytes(plan.missing)
        assert self.used <= self.budget, (self.stage, self.used, self.budget)
        self.peak = max(self.peak, self.used)

    def copied(self, plan: CopyPlan) -> None:
        """The copy-in is done: the missing keys are resident and just used."""
        self.h2d_bytes += self.nbytes(plan.missing)
        self.prefetches += 1
        self.touch(plan.missing)
