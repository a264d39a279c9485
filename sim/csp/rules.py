"""NASPipe's causal synchronous parallel (CSP) decision rule, as pure functions (DESIGN §3 "NASPipe CSP in the IR").

NASPipe (Zhao et al., ASPLOS'22, §4) trains a sequence of subnets of one supernet, subnet ``0, 1, 2, ...`` in
chronological order, each for one batch, and pipelines them over the stages. Two subnets that pick the same choice
of a block share that layer's parameters, so a later subnet must see every update of an earlier one that touched a
layer it uses. CSP lets a stage run the forward of subnet ``b`` only when no *earlier, unfinished* subnet uses one of
``b``'s layers on that stage; the runtime retries the rule whenever the stage's state changes. The released
scheduler is ``schedule(buffer_list, wait_list, ops, stage)`` in ``reproducible/translation/main_with_runtime.py``
(see ``shared/reference/schedules.md`` §7); :func:`csp_pick` is the same predicate.

Data: a *subnet table* ``uses[subnet][stage]`` is a frozenset of hashable layer keys, e.g. ``(block, choice)``.
A key is scoped to its stage: ``(stage, key)`` names one parameter set, and two subnets conflict on a stage iff
their key sets there intersect (NASPipe: ``ops[b][i] == ops[w][i]`` for a layer ``i`` of the stage's range).

The state a stage decides on (both exactly NASPipe's lists):

* ``arrived`` — subnets whose forward input is on the stage and whose forward has not started, in arrival order
  (``buffer_list``);
* ``unfinished`` — subnets that have not finished their backward *and* weight update on the stage. It must contain
  every such id below the highest id that has arrived, whether or not that id has arrived yet (``wait_list``, filled
  up to ``wait_upper``; see :func:`wait_list`). Leaving out an earlier subnet that has not arrived yet is unsafe: the
  forwards of a stage may reorder subnets, so ``b`` can reach stage ``s + 1`` before an earlier ``w`` that shares a
  layer of stage ``s + 1`` with it, and would then read that layer before ``w`` updated it.

Properties (proved here, checked by ``tests/sim/csp/test_rules.py``), for any timing and interleaving in which every
stage starts a forward only on :func:`csp_pick`'s choice, and a subnet leaves ``unfinished`` only after its update
there:

1. *Updates of a layer happen in subnet order, and F(s, b) and B(s, b) see exactly the updates of the earlier
   subnets that use the layer.* Let ``w < b`` share key ``k`` on stage ``s``. When F(s, b) starts, ``w`` is not in
   ``unfinished`` (else ``w`` conflicts), so OPT_STEP(s, w) < F(s, b) < B(s, b) < OPT_STEP(s, b). A later sharer
   ``c > b`` starts F(s, c) only after OPT_STEP(s, b) by the same argument, so between F(s, b) and OPT_STEP(s, b)
   nothing updates ``k``, and before F(s, b) exactly the earlier sharers did. Hence every subnet sees the same
   weight versions as training the subnets one by one, for any number of stages (NASPipe §4, "reproducibility").
2. *A later subnet never blocks an earlier one* (the ``w < b`` in the rule is a consequence, not a choice). If
   ``c > b`` is unfinished on ``s`` and shares a key with ``b`` there, then ``c`` has not started F(s, c): starting
   it required ``b`` finished on ``s``. So ``c`` reads nothing ``b`` writes yet, and it will wait for ``b`` itself.
   Blocking ``b`` on ``c`` as well would deadlock the two.
3. *No deadlock.* Let ``m`` be the smallest subnet not finished everywhere. Every ``w < m`` is finished on every
   stage, so :func:`csp_pick` never blocks ``m``: whenever ``m`` has arrived, some subnet is picked, each pick consumes
   an arrival, and ``m`` runs after finitely many picks; its backward and updates need no permission. By induction
   on ``m`` every subnet finishes.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence

__all__ = [
    "SubnetTable",
    "causal_deps",
    "conflicts",
    "csp_pick",
    "predict_next",
    "sequential_versions",
    "subnet_table",
    "wait_list",
]

#: ``uses[subnet][stage]`` → the layer keys the subnet uses on that stage.
SubnetTable = Sequence[Sequence[frozenset[Hashable]]]


def subnet_table(rows: Iterable[Iterable[Iterable[Hashable]]], num_stages: int | None = None) -> tuple:
    """Normalise a subnet table to ``tuple[tuple[frozenset, ...], ...]`` and check its shape.

    Args:
        rows: per subnet (chronological order), per stage, the layer keys it uses.
        num_stages: the expected number of stages per row (default: the first row's length).

    Raises:
        ValueError: no subnets, a row of the wrong length, or zero stages.
    """
    table = tuple(tuple(frozenset(keys) for keys in row) for row in rows)
    if not table:
        raise ValueError("a subnet table needs at least one subnet")
    stages = len(table[0]) if num_stages is None else num_stages
    if stages < 1:
        raise ValueError(f"a subnet table needs at least one stage, got {stages}")
    for b, row in enumerate(table):
        if len(row) != stages:
            raise ValueError(f"subnet {b} has {len(row)} stages, expected {stages}")
    return table


def wait_list(seen_upper: int, finished: Collection[int]) -> frozenset[int]:
    """NASPipe's ``wait_list`` on one stage: every id below ``seen_upper`` that has not finished there.

    Args:
        seen_upper: one more than the highest subnet id that has arrived on the stage (``wait_upper``), 0 if none.
        finished: subnets whose backward and weight update on the stage are done.
    """
    return frozenset(w for w in range(seen_upper) if w not in finished)


def _shares(stage: int, b: int, w: int, uses: SubnetTable) -> bool:
    return not uses[b][stage].isdisjoint(uses[w][stage])


def conflicts(stage: int, b: int, unfinished: Collection[int], uses: SubnetTable) -> tuple[int, ...]:
    """The earlier unfinished subnets that share a layer with ``b`` on ``stage``, ascending.

    These are what ``b``'s forward waits for: the edges ``OPT_STEP(stage, w) → F(stage, b)`` (``B`` and its update
    run back to back in NASPipe). Later subnets are never listed (module docstring, property 2).
    """
    return tuple(w for w in sorted(unfinished) if w < b and _shares(stage, b, w, uses))


def csp_pick(stage: int, arrived: Sequence[int], unfinished: Collection[int], uses: SubnetTable) -> int | None:
    """The subnet whose forward ``stage`` may start now, or ``None`` (NASPipe §4, ``schedule()``).

    Args:
        stage: the stage deciding.
        arrived: subnets whose forward input is on the stage, forward not started, in arrival order.
        unfinished: subnets not yet through backward and weight update on the stage, including every earlier id
            that has not arrived yet (:func:`wait_list`).
        uses: the subnet table.

    Returns:
        The first ``b`` of ``arrived`` with no ``w < b`` in ``unfinished`` sharing a layer key with it on ``stage``.

    Raises:
        ValueError: an arrived subnet is missing from ``unfinished`` (the caller passed the wrong set).
    """
    for b in arrived:
        if b not in unfinished:
            raise ValueError(
                f"stage {stage}: arrived subnet {b} is not in unfinished {sorted(unfinished)}; unfinished must hold "
                f"every id below the highest arrived one that has not finished here, not only started ones "
                f"(sim.csp.rules.wait_list)"
            )
    earlier = sorted(unfinished)
    for b in arrived:
        if not any(w < b and _shares(stage, b, w, uses) for w in earlier):
            return b
    return None


def predict_next(
    stage: int,
    arrived: Sequence[int],
    unfinished: Collection[int],
    running: int | None,
    uses: SubnetTable,
    *,
    finishes: bool = True,
    finishing: Collection[int] = (),
) -> int | None:
    """NASPipe's context predictor: :func:`csp_pick` on the state the stage will be in at its next forward decision.

    The stage prefetches the predicted subnet's layers while ``running`` computes. With ``finishes`` (the default,
    DESIGN §3 and NASPipe's prediction after a backward arrives) ``running`` is assumed through its update: it leaves
    both lists. With ``finishes=False`` (NASPipe's "#predict next forward", made when the forward of ``running`` is
    picked) it only leaves ``arrived`` and stays unfinished. ``finishing`` are subnets certain to finish on the stage
    before its next forward decision (their gradients are already waiting, and a stage runs ready backwards first);
    they leave ``unfinished`` too.
    """
    rest = [b for b in arrived if b != running]
    done = set(finishing) | ({running} if finishes and running is not None else set())
    return csp_pick(stage, rest, [w for w in unfinished if w not in done], uses)


def causal_deps(stage: int, b: int, uses: SubnetTable) -> tuple[int, ...]:
    """For each layer key of ``b`` on ``stage``, the latest earlier subnet that used it; ascending, deduplicated.

    These edges ``OPT_STEP(stage, w) → F(stage, b)`` are all a replay needs: updates of one key form a chain, so the
    other earlier users are ordered before ``b`` transitively.
    """
    latest: set[int] = set()
    for key in uses[b][stage]:
        for w in range(b - 1, -1, -1):
            if key in uses[w][stage]:
                latest.add(w)
                break
    return tuple(sorted(latest))


def sequential_versions(uses: SubnetTable) -> dict[tuple[int, int, Hashable], tuple[int, ...]]:
    """The reference semantics: what each subnet reads when the subnets train one by one.

    Returns:
        ``(subnet, stage, key) → the subnets whose updates the layer holds when ``subnet`` uses it``, i.e. the earlier
        subnets that use ``key`` on ``stage``, in order. A weight is identified by its update log, so two runs whose
        subnets read equal logs compute bitwise-equal results (NASPipe's reproducibility claim).
    """
    logs: dict[tuple[int, Hashable], list[int]] = {}
    seen: dict[tuple[int, int, Hashable], tuple[int, ...]] = {}
    for b, row in enumerate(uses):
        for stage, keys in enumerate(row):
            for key in keys:
                seen[(b, stage, key)] = tuple(logs.get((stage, key), ()))
        for stage, keys in enumerate(row):
            for key in keys:
                logs.setdefault((stage, key), []).append(b)
    return seen
