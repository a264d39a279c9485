"""The planner's screen: its pipeline model equals the closed form (and the simulator) on uniform stages with free
links, and the planner strategy finds the brute-force best on a seeded suite while simulating a tenth of the space."""

import random

import pytest

from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.search.planner import FILL, estimate_all
from sim.search.search import run_search
from sim.search.space import Candidate, SearchProblem, SearchSpace


@pytest.mark.parametrize("schedule, pipeline, microbatches", [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 2, 3),
                                                              ("zb1p", 4, 8)])
def test_uniform_stages_on_free_links_give_the_closed_form(schedule, pipeline, microbatches):
    # 8 layers of 2 ms forward + 4 ms backward on ideal devices and links: a stage of 8/p layers takes t = 6·8/p ms
    # per microbatch, so (m + fill·(p−1))·t, fill 1 for gpipe and 1f1b, 1/3 for zb1p (the optimizer step is free).
    problem = SearchProblem("uniform:layers=8,fwd_ms=2,bwd_ms=4", f"{pipeline}xideal", microbatches)
    candidate = Candidate(1, 1, pipeline, 1, schedule, partition="uniform")
    (estimate,) = estimate_all(problem, Topology.parse(problem.topology), [candidate])
    stage = 6e-3 * 8 / pipeline
    assert estimate == pytest.approx((microbatches + FILL[schedule] * (pipeline - 1)) * stage, rel=1e-12)
    if schedule != "zb1p":  # gpipe and 1f1b: the simulator's time is the same closed form (DESIGN §4)
        simulated = run_search(SearchProblem(problem.model, problem.topology, microbatches, space=SearchSpace(
            schedules=(schedule,), recompute=("none",), partitions=("uniform",),
            microbatch_sizes=(1,)))).evaluations
        (match,) = [e for e in simulated if e.candidate.pp == pipeline]
        assert match.iteration_time_s == pytest.approx(estimate, rel=1e-9)


@pytest.mark.parametrize("pipeline, microbatches", [(2, 4), (4, 8), (4, 11)])
def test_dualpipev_estimate_is_the_simulated_time(pipeline, microbatches):
    # 2p vstages of 8/(2p) layers: a rank computes two of them per microbatch, and the fill is p − 1 units of a third
    # of a vstage (sim.schedules.dualpipev's closed form 6m + p − 1), which the simulator's time equals.
    problem = SearchProblem("uniform:layers=8,fwd_ms=2,bwd_ms=4", f"{pipeline}xideal", microbatches)
    candidate = Candidate(1, 1, pipeline, 1, "dualpipev", partition="uniform")
    (estimate,) = estimate_all(problem, Topology.parse(problem.topology), [candidate])
    vstage = 6e-3 * 8 / (2 * pipeline)
    assert estimate == pytest.approx((2 * microbatches + FILL["dualpipev"] * (pipeline - 1)) * vstage, rel=1e-12)
    simulated = run_search(SearchProblem(problem.model, problem.topology, microbatches, space=SearchSpace(
        schedules=("dualpipev",), recompute=("none",), partitions=("uniform",), microbatch_sizes=(1,)))).evaluations
    (match,) = [e for e in simulated if e.candidate.pp == pipeline]
    assert match.iteration_time_s == pytest.approx(estimate, rel=1e-9)


def test_a_deadline_leaves_the_rest_unestimated():
    problem = SearchProblem("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000", "4xA100", 8)
    candidates = [Candidate(1, 1, 4, 1, "1f1b"), Candidate(1, 2, 2, 1, "1f1b")]
    assert estimate_all(problem, Topology.parse("4xA100"), candidates, deadline=0.0) == [None, None]


def suite(count: int, seed: int) -> list[SearchProblem]:
    rng = random.Random(seed)
    topologies = ["4xA100", "8xA100", "2x4xA100", "2xV100+2xA100", "4xV100+4xA100"]
    return [SearchProblem(f"gpt:layers={rng.choice([4, 8, 12])},hidden={rng.choice([256, 512])},heads=8,seq=256,"
                          f"vocab=4000", rng.choice(topologies), rng.choice([8, 16]),
                          space=SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb1p"), chunks=(2,),
                                            recompute=("none", "full"), zero=(0,)))
            for _ in range(count)]


@pytest.mark.parametrize("problem", suite(4, seed=21), ids=lambda p: f"{p.topology}-{p.model.split(',')[0]}")
def test_the_planner_finds_the_brute_force_best_within_one_percent(problem):
    brute = run_search(problem)
    planned = run_search(problem, strategy="planner")
    assert planned.best.iteration_time_s <= brute.best.iteration_time_s * 1.01
    assert len(planned.evaluations) < brute.space_size
    by_candidate = {e.candidate: e for e in brute.evaluations}
    assert all(by_candidate[e.candidate] == e for e in planned.evaluations)


def _screen_equals_engine(problem, *, seed, count, keep=lambda candidate: True, below=lambda candidate: False):
    """Assert the planner's memory screen gives the engine's own peak per simulated rank (``predict``, memory check
    off) on ``count`` of ``problem``'s candidates drawn at random; returns them. A candidate a rule refuses (e.g. a TP
    group mixing device models, a split backward under ZeRO-3) is drawn past. Where ``below(candidate)``, the screen
    may only be at or below the engine's peak (its replay frees what a collective frees at its end when it starts:
    ``sim.cost.ledger.program_order_peaks``), and is checked so."""
    from sim.plan.build import build_plan
    from sim.predict import predict_built
    from sim.search.planner import _Screen
    from sim.search.space import enumerate_candidates

    topology = Topology.parse(problem.topology)
    candidates = [c for c in enumerate_candidates(problem, topology.num_ranks, topology) if keep(c)]
    screen = _Screen(problem, topology)
    random.Random(seed).shuffle(candidates)
    checked = []
    for candidate in candidates:
        try:
            engine = predict_built(build_plan(candidate.plan_inputs(problem)), check_memory=False)
        except SpecError:
            continue
        peaks = screen.peaks(candidate)
        if below(candidate):
            assert all(p <= e for p, e in zip(peaks, engine.peak_memory_bytes, strict=True)), candidate.label
        else:
            assert peaks == engine.peak_memory_bytes, candidate.label
        checked.append(candidate)
        if len(checked) == count:
            return checked
    raise AssertionError(f"only {len(checked)} of {count} candidates could be built")


def test_the_memory_screen_is_the_engines_peak_on_random_plans_of_every_schedule():
    """Oracle: the engine's own peak per simulated rank (``predict``, memory check off). The screen replays the memory
    ledger over the schedule's programs without building or simulating the plan; it must give the same bytes."""
    space = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb1p", "pipedream"),
                        recompute=("none", "full", "selective"), microbatch_sizes=(1, 2),
                        partitions=("balanced", "uniform"))
    problem = SearchProblem("gpt:layers=8,hidden=256,heads=8,seq=128,vocab=1000", "4xV100+4xA100", 16, space=space)
    checked = _screen_equals_engine(problem, seed=7, count=40)
    assert {c.schedule for c in checked} == set(space.schedules)
    assert {c.recompute for c in checked} == set(space.recompute)


def test_the_memory_screen_is_the_engines_peak_for_a_mixture_over_expert_degrees_and_a_skewed_routing():
    """Oracle: the engine's peak, as above, for a mixture whose candidates differ in their expert-parallel degree
    under a skewed routing: each costed on its own shard (the planner once kept one shard per tensor degree,
    sequence parallelism, recomputation and context degree, so an ep=2 plan was costed with ep=1's experts, and
    every shard balanced)."""
    space = SearchSpace(schedules=("1f1b", "gpipe"), ep=(1, 2, 4), zero=(0, 1), microbatch_sizes=(1, 2))
    problem = SearchProblem("moe:layers=4,experts=8,hidden=512,expert_ffn=512,ffn=1024,heads=8,kv_heads=2,"
                            "head_dim=64,seq=256,topk=2,vocab=4000", "8xA100", 16, space=space, routing="skew:1.5")
    checked = _screen_equals_engine(problem, seed=5, count=16)
    assert {c.ep for c in checked} == {1, 2, 4}


def test_the_memory_screen_holds_data_parallel_buffers_as_the_engine_does(tmp_path):
    """Oracle: the engine's peak, as above, where a profile says the framework reduces a flat copy of the gradients
    and they live per step (``executor.data_parallel``): without ZeRO the copy is held from each REDUCE_GRAD's issue to
    its update, which only the lowered programs (collectives included) show; under ZeRO-1 and 2 the copy is freed when
    its reduce-scatter ends, at a time the replay does not know, so the screen is a lower bound there; under ZeRO-3,
    FSDP's gathered parameters included, exact again."""
    import json

    from sim.models import build_model

    graph = build_model("gpt:layers=6,hidden=128,heads=4,seq=64,vocab=500")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "format": "pipedejavu-profile", "format_version": 1, "model": graph.spec, "device": "cpu",
        "microbatch_size": 1, "gradients": "per_step", "reduction": "flat_copy",
        "layers": [{"name": layer.name, "fwd_s": 1e-3 * (i + 1), "bwd_s": 2e-3 * (i + 1)}
                   for i, layer in enumerate(graph.layers)]}))
    space = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb1p"), recompute=("none", "full"),
                        microbatch_sizes=(1,), chunks=(2,), zero=(0, 1, 2, 3))
    problem = SearchProblem(graph.spec, "8xcpu", 16, space=space, profile=str(profile))
    checked = _screen_equals_engine(problem, seed=3, count=32, keep=lambda c: c.dp > 1,
                                    below=lambda c: c.zero in (1, 2))
    assert {c.schedule for c in checked} == set(space.schedules) and {c.zero for c in checked} == {0, 1, 2, 3}


def test_plans_the_screen_says_do_not_fit_sort_behind_the_others():
    from sim.search.planner import OVER_MEMORY

    topology = Topology.parse("4xA100")
    candidates = [Candidate(1, 1, 4, 1, "1f1b"), Candidate(1, 1, 4, 1, "gpipe")]
    roomy = SearchProblem("gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000", "4xA100", 64)
    tight = SearchProblem(roomy.model, roomy.topology, 64, memory_limit_bytes=int(0.5e9))
    fine, squeezed = estimate_all(roomy, topology, candidates), estimate_all(tight, topology, candidates)
    assert all(value < OVER_MEMORY for value in fine)
    assert squeezed[0] < OVER_MEMORY <= squeezed[1]  # gpipe holds all 64 microbatches at once; 1f1b at most 4
    assert squeezed[1] - OVER_MEMORY == pytest.approx(fine[1])
