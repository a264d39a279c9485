"""The fast evaluator against the one prediction path (``sim.search.evaluate.evaluate``: build_plan + predict) over
whole search spaces: the same verdicts, the same peaks, the same time where it says it is exact, a lower bound where
it says a link is contended."""

import pytest

from sim.bench.fast import ENGINE, EXACT, LOWER_BOUND, FastEvaluator
from sim.search.evaluate import evaluate
from sim.search.space import SearchProblem, SearchSpace, enumerate_candidates

MODEL = "gpt:layers=8,hidden=512,heads=8,seq=256,vocab=1000"


@pytest.mark.parametrize("topology, devices, global_batch, schedules", [
    ("8xA100", 8, 8, ("1f1b", "interleaved")),
    ("4xV100+4xA100", 8, 8, ("gpipe", "zb1p")),
    ("2x2xV100", 4, 8, ("1f1b", "interleaved", "zb1p")),
])
def test_every_candidate_agrees_with_the_engine(topology, devices, global_batch, schedules):
    problem = SearchProblem(MODEL, topology, global_batch,
                            space=SearchSpace(schedules=schedules, chunks=(2,), recompute=("none", "full"),
                                              zero=(0,), rank_orders=("tp-dp-pp", "pp-dp-tp")),
                            memory_limit_bytes=int(0.2e9))  # small enough that some plans do not fit
    _agrees(problem, devices)


def test_the_2026_dimensions_agree_with_the_engine():
    # Context parallelism (both exchanges), FSDP with HSDP, FP8 and compile on a Llama-family model: the fast
    # evaluator's shared structures must tell these apart wherever they change the plan's ops.
    problem = SearchProblem("llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1408,vocab=1000,seq=1024", "4xH100", 4,
                            space=SearchSpace(schedules=("1f1b",), recompute=("none", "full"), zero=(0, 3),
                                              sequence_parallel=(False,), cp=(1, 2), cp_comms=("ring", "allgather"),
                                              dp_replicate=(1, 2), precisions=("model", "fp8"),
                                              compile=(False, True)),
                            memory_limit_bytes=int(1.5e9))
    assert {c.cp for c in enumerate_candidates(problem, 4)} == {1, 2}
    _agrees(problem, 4)


def test_expert_parallelism_agrees_with_the_engine():
    # A mixture of experts with EP and ETP folded onto TP × DP, ZeRO-1 (the experts' state over their own group) and
    # MXFP8: the expert all-to-alls are ops the shared structures must hold.
    model = ("moe:layers=4,hidden=256,heads=8,kv_heads=2,head_dim=32,ffn=512,vocab=1000,seq=512,experts=8,topk=2,"
             "expert_ffn=128,qk_norm=0")
    problem = SearchProblem(model, "4xB200", 8,
                            space=SearchSpace(schedules=("1f1b",), recompute=("none",), zero=(0, 1),
                                              sequence_parallel=(True,), ep=(1, 2, 4), etp=(1, 2),
                                              precisions=("model", "mxfp8")),
                            memory_limit_bytes=int(0.3e9))
    listed = enumerate_candidates(problem, 4)
    assert {(c.ep, c.etp) for c in listed} >= {(1, 1), (4, 1), (2, 2)}
    assert all((c.tp * c.dp * c.cp) % (c.ep * c.etp) == 0 for c in listed)
    _agrees(problem, 4)


def _agrees(problem: SearchProblem, devices: int) -> None:
    fast = FastEvaluator(problem)
    methods = {EXACT: 0, LOWER_BOUND: 0, ENGINE: 0}
    fits = 0
    for candidate in enumerate_candidates(problem, devices):
        quick, slow = fast.evaluate(candidate), evaluate(problem, candidate)
        assert (quick.feasible, quick.reason[:12]) == (slow.feasible, slow.reason[:12]), candidate
        if slow.iteration_time_s is None:
            assert quick.iteration_time_s is None
            continue
        fits += quick.feasible
        methods[quick.method] += 1
        assert quick.peak_memory_bytes == slow.peak_memory_bytes, candidate
        assert (quick.microbatches, quick.layer_counts) == (slow.microbatches, slow.layer_counts), candidate
        if quick.method == EXACT:
            assert quick.iteration_time_s == slow.iteration_time_s, candidate
            assert quick.throughput_samples_per_s == slow.throughput_samples_per_s, candidate
        elif quick.method == LOWER_BOUND:
            assert quick.iteration_time_s <= slow.iteration_time_s * (1 + 1e-12), candidate
    assert methods[EXACT] > 20 and fits > 0  # the comparison was not vacuous
    assert len(fast.structures) < sum(methods.values())  # structures were shared, so the cached path ran too
