"""sim.search.space: the listed space against counts derived here (a hand count and a plain nested loop), the
rules of what is listed once, the size bound checked before listing, and invalid spaces."""

from itertools import permutations
from math import factorial

import pytest

import sim.search.space as space_module
from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.search.space import Candidate, SearchProblem, SearchSpace, enumerate_candidates

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=16,vocab=50"
ALL_ORDERS = tuple("-".join(p) for p in permutations(("tp", "dp", "pp")))  # the six nestings, written out here


def problem(global_batch: int, **space) -> SearchProblem:
    return SearchProblem(model=MODEL, topology="unused", global_batch=global_batch, space=SearchSpace(**space))


def loop_count(n: int, g: int, s: SearchSpace) -> int:
    """The size of the space by a plain nested loop over every choice, written from the rules in the brief:
    tp·dp·pp = n; microbatch sizes b with b·dp <= g (powers of two when none are given); interleaved (the one
    chunked schedule) only where pp > 1, once per chunk count, the others with one chunk; where pp = 1 one
    synchronous schedule (if any is searched) plus pipedream if searched; sequence parallelism only
    where tp > 1 and ZeRO 1 only where dp > 1 (otherwise the one 'off' choice); one rank order per distinct nesting
    of the degrees > 1, which among all six orders is k! for k degrees > 1."""
    count = 0
    for tp in range(1, n + 1):
        for dp in range(1, n + 1):
            for pp in range(1, n + 1):
                if tp * dp * pp != n:
                    continue
                given = s.microbatch_sizes or [2 ** k for k in range(g + 1) if 2 ** k <= g]
                sizes = [b for b in given if b * dp <= g]
                schedules = 0
                for name in s.schedules:
                    if name == "interleaved":
                        schedules += len(s.chunks) if pp > 1 else 0
                    elif pp > 1 or name == "pipedream":
                        schedules += 1
                if pp == 1 and any(name in ("gpipe", "1f1b", "zb1p") for name in s.schedules):
                    schedules += 1
                sps = len(s.sequence_parallel) if tp > 1 else 1
                zeros = len(s.zero) if dp > 1 else 1
                big = sum(d > 1 for d in (tp, dp, pp))
                if sorted(s.rank_orders) == sorted(ALL_ORDERS):
                    orders = factorial(big)
                else:
                    assert s.rank_orders == ("tp-dp-pp",)
                    orders = 1
                count += len(sizes) * schedules * len(s.recompute) * sps * zeros * orders * len(s.partitions)
    return count


def test_a_small_space_counted_by_hand():
    # 4 devices, global batch 8, one schedule, nothing else: the six (tp, dp, pp) shapes with 4, 2, 4, 3, 4, 3
    # powers of two b with b·dp <= 8 for (1,1,4), (1,4,1), (4,1,1), (1,2,2), (2,1,2), (2,2,1): 20 candidates.
    found = enumerate_candidates(problem(8, schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,),
                                         zero=(0,)), 4)
    assert len(found) == 20
    by_shape = {}
    for c in found:
        by_shape.setdefault((c.tp, c.dp, c.pp), []).append(c.microbatch_size)
    assert by_shape == {(1, 1, 4): [1, 2, 4, 8], (1, 4, 1): [1, 2], (4, 1, 1): [1, 2, 4, 8], (1, 2, 2): [1, 2, 4],
                        (2, 1, 2): [1, 2, 4, 8], (2, 2, 1): [1, 2, 4]}


SPACES = [
    (4, 8, SearchSpace()),
    (8, 16, SearchSpace(rank_orders=ALL_ORDERS, microbatch_sizes=(1, 2, 3))),
    (6, 12, SearchSpace(schedules=("gpipe", "interleaved"), chunks=(2, 3), recompute=("full",),
                        rank_orders=ALL_ORDERS, partitions=("balanced", "uniform"))),
    (12, 6, SearchSpace(schedules=("interleaved", "zb1p", "pipedream"), zero=(1,), sequence_parallel=(True,))),
    (1, 5, SearchSpace()),
]


@pytest.mark.parametrize("n,g,space", SPACES, ids=[f"{n}dev-G{g}" for n, g, _ in SPACES])
def test_the_count_equals_a_plain_loop_and_every_candidate_obeys_the_rules(n, g, space):
    found = enumerate_candidates(SearchProblem(model=MODEL, topology="unused", global_batch=g, space=space), n)
    assert len(found) == loop_count(n, g, space)
    assert len(set(found)) == len(found)  # no duplicates
    assert found == sorted(found)  # the fixed order
    for c in found:
        assert c.tp * c.dp * c.pp == n, c  # every device used
        assert c.microbatch_size * c.dp <= g, c
        assert not c.sequence_parallel or c.tp > 1, c
        assert c.zero == 0 or c.dp > 1, c
        if c.schedule == "interleaved":
            assert c.pp > 1 and c.chunks in space.chunks, c
        else:
            assert c.chunks == 1, c
        assert c.schedule in space.schedules and c.recompute in space.recompute
        assert c.rank_order in space.rank_orders and c.partition in space.partitions
    # Interleaved appears with each allowed chunk count wherever it appears at all.
    if "interleaved" in space.schedules:
        chunked = {}
        for c in found:
            if c.schedule == "interleaved":
                key = (c.tp, c.dp, c.pp, c.microbatch_size, c.recompute, c.sequence_parallel, c.zero,
                       c.rank_order, c.partition)
                chunked.setdefault(key, set()).add(c.chunks)
        assert bool(chunked) == (n > 1)  # some shape has pp > 1 exactly when there is more than one device
        assert all(v == set(space.chunks) for v in chunked.values())
    # Rank orders: one per distinct nesting of the degrees > 1.
    nestings = {}
    for c in found:
        key = (c.tp, c.dp, c.pp, c.microbatch_size, c.schedule, c.chunks, c.recompute, c.sequence_parallel, c.zero,
               c.partition)
        degrees = {"tp": c.tp, "dp": c.dp, "pp": c.pp}
        effective = tuple(name for name in c.rank_order.split("-") if degrees[name] > 1)
        assert effective not in nestings.setdefault(key, set()), c
        nestings[key].add(effective)


def test_equivalent_rank_orders_are_listed_once():
    space = SearchSpace(schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,), zero=(0,),
                        microbatch_sizes=(1,), rank_orders=("tp-dp-pp", "tp-pp-dp"))
    found = enumerate_candidates(SearchProblem(model=MODEL, topology="unused", global_batch=4, space=space), 4)
    shapes = {}
    for c in found:
        shapes.setdefault((c.tp, c.dp, c.pp), []).append(c.rank_order)
    # With dp = 1 (or tp·pp using a single degree > 1) both orders nest alike: listed once, under the first given.
    assert shapes[(2, 1, 2)] == ["tp-dp-pp"]
    assert shapes[(1, 1, 4)] == ["tp-dp-pp"]
    assert shapes[(4, 1, 1)] == ["tp-dp-pp"]
    assert shapes[(1, 4, 1)] == ["tp-dp-pp"]
    # dp > 1 and pp > 1: the two orders differ (dp inside pp, or pp inside dp).
    assert sorted(shapes[(1, 2, 2)]) == ["tp-dp-pp", "tp-pp-dp"]
    # dp > 1 with tp > 1 but pp = 1: both nest tp inside dp.
    assert shapes[(2, 2, 1)] == ["tp-dp-pp"]


def test_the_bound_rejects_before_anything_is_listed(monkeypatch):
    # A space with no choice listed once (no tp/dp-only options, one order, no interleaving): its bound is exact.
    narrow = problem(8, schedules=("1f1b", "gpipe"), recompute=("none", "full"), sequence_parallel=(False,),
                     zero=(0,))
    size = len(enumerate_candidates(narrow, 4))
    assert size == loop_count(4, 8, narrow.space)
    monkeypatch.setattr(space_module, "MAX_CANDIDATES", size)
    assert len(enumerate_candidates(narrow, 4)) == size

    def no_candidate(*args, **kwargs):
        raise AssertionError("a candidate was made before the bound was checked")

    monkeypatch.setattr(space_module, "MAX_CANDIDATES", size - 1)
    monkeypatch.setattr(space_module, "Candidate", no_candidate)
    with pytest.raises(SpecError, match=f"has {size:,} candidates, more than {size - 1:,}"):
        enumerate_candidates(narrow, 4)


def test_the_bound_is_the_exact_count_on_a_mixed_cluster_with_placements(monkeypatch):
    """The count checked before listing is the list's own length where several placements, orders, ZeRO stages and
    sequence parallelism multiply (the count once multiplied every shape by the most placements, 24 times too many)."""
    wide = SearchProblem("gpt:layers=8,hidden=256,heads=8,seq=256,vocab=1000", "2xV100+2xA100", 8)
    topology = Topology.parse(wide.topology)
    size = len(enumerate_candidates(wide, topology.num_ranks, topology))
    monkeypatch.setattr(space_module, "MAX_CANDIDATES", size - 1)
    with pytest.raises(SpecError, match=f"has {size:,} candidates, more than {size - 1:,}"):
        enumerate_candidates(wide, topology.num_ranks, topology)


def test_a_huge_space_is_rejected_by_the_default_bound():
    # 1024 devices: 66 shapes, each with at least 976 of the 1000 microbatch sizes, 3 schedule choices or more and 3
    # recompute modes, over 570,000 before sequence parallelism, ZeRO and the 6 rank orders multiply it, far past two
    # million; listing it would take minutes.
    space = dict(microbatch_sizes=tuple(range(1, 1001)), rank_orders=ALL_ORDERS)
    with pytest.raises(SpecError, match="more than 2,000,000"):
        enumerate_candidates(problem(10 ** 6, **space), 1024)


@pytest.mark.parametrize("field,value,needle", [
    ("schedules", ("bogus",), "'bogus'"),
    ("schedules", ("csp",), "'csp'"),
    ("schedules", ("1f1b", "stream"), "schedule 'stream'"),
    ("schedules", (), "no schedules"),
    ("chunks", (1,), "chunks cannot include 1"),
    ("recompute", ("some",), "'some'"),
    ("recompute", (), "no recompute"),
    ("microbatch_sizes", (0,), "microbatch sizes cannot include 0"),
    ("sequence_parallel", ("yes",), "'yes'"),
    ("zero", (4,), "zero cannot include 4"),
    ("rank_orders", ("x-y-z",), "'x-y-z'"),
    ("partitions", ("",), "''"),
])
def test_an_invalid_space_is_refused_naming_the_value(field, value, needle):
    with pytest.raises(SpecError) as info:
        enumerate_candidates(problem(8, **{field: value}), 4)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("g", [0, -3])
def test_a_global_batch_below_one_is_refused(g):
    with pytest.raises(SpecError, match=f"got {g}"):
        enumerate_candidates(problem(g), 4)


def test_run_flags_name_every_choice_that_differs_from_sim_runs_defaults():
    p = SearchProblem(model=MODEL, topology="4xA100", global_batch=8, profile="p.json")
    c = Candidate(2, 2, 1, 2, "interleaved", 4, "full", True, 1, "dp-tp-pp", "uniform")
    flags = c.run_flags(p)
    pairs = dict(zip(flags, flags[1:]))
    for flag, value in [("--topology", "4xA100"), ("--model", MODEL), ("--schedule", "interleaved"), ("--tp", "2"),
                        ("--dp", "2"), ("--pp", "1"), ("--global-batch", "8"), ("--microbatch-size", "2"),
                        ("--chunks", "4"), ("--recompute", "full"), ("--zero", "1"), ("--rank-order", "dp-tp-pp"),
                        ("--partition", "uniform"), ("--profile", "p.json")]:
        assert pairs[flag] == value, flag
    assert "--sequence-parallel" in flags
    plain = Candidate(1, 1, 4, 1, "1f1b").run_flags(SearchProblem(model=MODEL, topology="4xA100", global_batch=8))
    for flag in ("--chunks", "--recompute", "--sequence-parallel", "--zero", "--rank-order", "--partition",
                 "--profile"):
        assert flag not in plain
    assert c.microbatches(8) == 2.0 and Candidate(1, 1, 4, 3, "1f1b").microbatches(8) == pytest.approx(8 / 3)


def test_the_problems_framework_settings_reach_the_candidates_they_apply_to():
    from sim.models.recompute_modules import DEFAULT_RECOMPUTE_MODULES
    from sim.plan.build import build_plan
    from sim.run import make_parser

    mixture = "qwen3-30b-a3b,seq=1024"
    p = SearchProblem(model=mixture, topology="8xH100", global_batch=8, deallocate_pipeline_outputs=True,
                      recompute_modules=("moe_act",))
    piped, flat = Candidate(1, 4, 2, 1, "1f1b", 1, "selective"), Candidate(1, 8, 1, 1, "1f1b", 1, "full")
    # freeing stage outputs needs stages, the modules a selective recomputation: each where it has a meaning
    assert (piped.plan_inputs(p).deallocate_pipeline_outputs, piped.plan_inputs(p).recompute_modules) == (
        True, ("moe_act",))
    assert (flat.plan_inputs(p).deallocate_pipeline_outputs, flat.plan_inputs(p).recompute_modules) == (
        False, DEFAULT_RECOMPUTE_MODULES)
    assert "--deallocate-pipeline-outputs" not in flat.run_flags(p) and "--recompute-modules" not in flat.run_flags(p)
    # and the flags rebuild the same plan with sim.run
    flags = piped.run_flags(p)
    assert flags[flags.index("--recompute-modules") + 1] == "moe_act" and "--deallocate-pipeline-outputs" in flags
    args = make_parser().parse_args([*flags, "--out", "unused"])
    assert (args.deallocate_pipeline_outputs, args.recompute_modules) == (True, ("moe_act",))
    built = build_plan(piped.plan_inputs(p))
    assert built.plan.layout.deallocate_pipeline_outputs and built.plan.option("recompute_modules") == "moe_act"


def test_one_pipeline_rank_lists_one_synchronous_schedule():
    found = enumerate_candidates(problem(4, schedules=("gpipe", "zb1p", "interleaved"), recompute=("none",),
                                         sequence_parallel=(False,), zero=(0,)), 2)
    single = {c.schedule for c in found if c.pp == 1}
    assert single == {"gpipe"}  # 1f1b is not searched: the first synchronous schedule stands for all
    assert {c.schedule for c in found if c.pp == 2} == {"gpipe", "zb1p", "interleaved"}
    with_1f1b = enumerate_candidates(problem(4, schedules=("zb1p", "1f1b", "pipedream")), 2)
    assert {c.schedule for c in with_1f1b if c.pp == 1} == {"1f1b", "pipedream"}


def test_the_2026_dimensions_are_listed_where_they_apply():
    # Oracle: a count by hand. 4 devices, tp in {1, 2, 4}, cp in {1, 2}: shapes (tp, cp, dp, pp) with product 4.
    problem = SearchProblem("llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=1000,seq=1024", "4xH100", 4,
                            space=SearchSpace(schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,),
                                              zero=(0, 3), cp=(1, 2), cp_comms=("ring", "allgather"),
                                              dp_replicate=(1, 2), precisions=("model", "fp8"),
                                              compile=(False, True), placements=False))
    found = enumerate_candidates(problem, 4)
    shapes = {(c.tp, c.cp, c.dp, c.pp) for c in found}
    expected = {(tp, cp, dp, 4 // (tp * cp * dp)) for tp in (1, 2, 4) for cp in (1, 2) for dp in (1, 2, 4)
                if 4 % (tp * cp * dp) == 0}
    assert shapes == expected
    assert all(c.cp_comm == "ring" for c in found if c.cp == 1)  # no exchange to choose without CP
    assert {c.cp_comm for c in found if c.cp == 2} == {"ring", "allgather"}
    assert all(c.dp_replicate == 1 for c in found if c.zero != 3)  # HSDP is a form of FSDP
    assert all(c.dp % c.dp_replicate == 0 for c in found)
    assert all(c.zero == 0 for c in found if c.dp * c.cp == 1)  # nothing to shard over
    assert {(c.precision, c.compiled) for c in found} == {(p, k) for p in ("model", "fp8") for k in (False, True)}
    one = next(c for c in found if c.cp == 2 and c.zero == 3 and c.precision == "fp8" and c.compiled)
    inputs = one.plan_inputs(problem)
    assert (inputs.cp, inputs.precision, inputs.compiled, inputs.zero) == (2, "fp8", True, 3)
    flags = one.run_flags(problem)
    assert ["--cp", "2", "--cp-comm", one.cp_comm] == flags[flags.index("--cp"):flags.index("--cp") + 4]
    assert "--compile" in flags and flags[flags.index("--precision") + 1] == "fp8"
