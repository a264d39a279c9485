"""sim.search.evaluate: a candidate costs exactly what ``python -m sim.run`` with its flags writes; rule-breaking
candidates are infeasible with the rule and the value; the memory limit against the simulated peaks."""

import json
import math

import pytest

from sim.cost.allocator import FRAGMENTATION
from sim.run import main as sim_run
from sim.search.evaluate import build_candidate_plan, evaluate
from sim.search.space import Candidate, SearchProblem

MODEL = "gpt:layers=8,hidden=256,heads=4,seq=128,vocab=1000"  # 10 layers: embed, 8 blocks, head


def problem(topology="4xA100", global_batch=8, model=MODEL, **kw) -> SearchProblem:
    return SearchProblem(model=model, topology=topology, global_batch=global_batch, **kw)


CASES = [
    ("tp2-dp2-sp-zero1", problem(), Candidate(2, 2, 1, 2, "1f1b", sequence_parallel=True, zero=1)),
    ("pp4-interleaved-selective", problem(), Candidate(1, 1, 4, 1, "interleaved", 2, "selective")),
    ("tp2-pp2-zb1p-full-order-uniform", problem(),
     Candidate(2, 1, 2, 2, "zb1p", recompute="full", rank_order="pp-dp-tp", partition="uniform")),
    ("mixed-dp2-pp2-gpipe-zero1", problem("2xV100+2xA100", global_batch=16),
     Candidate(1, 2, 2, 4, "gpipe", zero=1, rank_order="tp-pp-dp")),
]


@pytest.mark.parametrize("p,c", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_an_evaluation_is_what_sim_run_writes_for_the_candidates_flags(tmp_path, capsys, p, c):
    assert sim_run([*c.run_flags(p), "--no-gantt", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    e = evaluate(p, c)
    assert e.feasible and e.reason == "" and e.candidate == c
    assert e.iteration_time_s == metrics["iteration_time_s"]
    assert e.throughput_samples_per_s == metrics["throughput_samples_per_s"]
    assert e.microbatches == metrics["num_microbatches"] == p.global_batch // (c.microbatch_size * c.dp)
    assert list(e.peak_memory_bytes) == [d["peak_memory_bytes"] for d in metrics["devices"]]
    assert list(e.memory_capacity_bytes) == [d["memory_capacity_bytes"] for d in metrics["devices"]]
    assert e.max_peak_memory_bytes == max(d["peak_memory_bytes"] for d in metrics["devices"])
    # The partition covers the model's 10 layers over pp·chunks virtual stages.
    assert len(e.layer_counts) == c.pp * c.chunks and sum(e.layer_counts) == 10
    # The plan a search writes is the plan sim.run writes, byte for byte.
    assert "".join(build_candidate_plan(p, c).iter_dumps()) == (tmp_path / "plan.json").read_text()


@pytest.mark.parametrize("p,c,needles", [
    (problem(model="gpt:layers=8,hidden=256,heads=2,seq=128,vocab=1000"), Candidate(4, 1, 1, 1, "1f1b"),
     ("tp=4", "heads=2")),
    (problem(), Candidate(1, 1, 4, 3, "1f1b"), ("--global-batch 8", "--microbatch-size 3")),
    (problem("8xA100", model="gpt:layers=2,hidden=256,heads=4,seq=128,vocab=1000"), Candidate(1, 1, 8, 1, "gpipe"),
     ("(8,", "layers (4)")),
    (problem("2xA100", global_batch=3), Candidate(1, 1, 2, 1, "interleaved", 2), ("--microbatches 3", "2 ranks")),
    # pp innermost puts devices 0 and 2 (a V100 and an A100) in one tensor-parallel group.
    (problem("2xV100+2xA100"), Candidate(2, 1, 2, 1, "1f1b", rank_order="pp-dp-tp"), ("[0, 2]", "v100")),
], ids=["heads-tp", "batch-not-whole", "stages-over-layers", "interleaved-m-pp", "tp-group-mixes-devices"])
def test_a_candidate_breaking_a_rule_is_infeasible_naming_the_value(p, c, needles):
    e = evaluate(p, c)
    assert not e.feasible and e.iteration_time_s is None and e.throughput_samples_per_s is None
    assert e.peak_memory_bytes == () and e.layer_counts == () and e.max_peak_memory_bytes == 0
    for needle in needles:
        assert needle in e.reason, e.reason


def test_a_memory_limit_below_a_peak_makes_the_plan_infeasible_and_keeps_its_time():
    c = Candidate(1, 1, 4, 1, "1f1b")
    free = evaluate(problem(), c)
    peaks = free.peak_memory_bytes
    assert free.feasible and len(set(peaks)) > 1, peaks  # the pipeline ranks hold different amounts
    # Between the two smallest peaks: every rank but one is over; the one named is the furthest over, the largest.
    limit = sorted(peaks)[1] - 1
    capped = evaluate(problem(memory_limit_bytes=limit), c)
    worst = peaks.index(max(peaks))
    assert not capped.feasible
    assert capped.reason.startswith("out of memory: ") and f"pipeline rank {worst} " in capped.reason
    assert "(--memory-limit)" in capped.reason
    assert capped.iteration_time_s == free.iteration_time_s and capped.peak_memory_bytes == peaks
    assert capped.memory_capacity_bytes == (limit,) * 4
    # At the largest peak exactly, everything fits without headroom.
    exact = evaluate(problem(memory_limit_bytes=max(peaks), memory_headroom=0.0), c)
    assert exact.feasible and exact.reason == "" and exact.iteration_time_s == free.iteration_time_s
    # With the default headroom (the allocator's fragmentation) the peak times 1 + headroom must fit: a limit of
    # exactly that fits, one a few bytes below does not, and the reason names the headroom.
    grown = math.ceil(max(peaks) * (1 + FRAGMENTATION)) + 1
    assert evaluate(problem(memory_limit_bytes=grown), c).feasible
    short = evaluate(problem(memory_limit_bytes=grown - 4), c)
    assert not short.feasible and "headroom (--memory-headroom)" in short.reason
    assert short.memory_capacity_bytes == (grown - 4,) * 4  # the capacity recorded is the limit, not the headroom's
    # A limit above the device's own memory does not raise the device's capacity.
    roomy = evaluate(problem(memory_limit_bytes=10 ** 15), c)
    assert roomy.feasible and roomy.memory_capacity_bytes == free.memory_capacity_bytes


def test_without_a_limit_the_devices_own_memory_decides():
    # 8 blocks of hidden 8192 keep ~13 GB of weights and Adam states per block; on two 16 GB V100s, 4 blocks each
    # cannot fit, and no --memory-limit is named in the reason.
    p = problem("2xV100", model="gpt:layers=8,hidden=8192,heads=64,seq=128,vocab=1000", global_batch=2)
    e = evaluate(p, Candidate(1, 1, 2, 1, "1f1b"))
    assert not e.feasible and e.reason.startswith("out of memory: ") and "--memory-limit" not in e.reason
    assert e.iteration_time_s is not None
    assert any(peak > cap for peak, cap in zip(e.peak_memory_bytes, e.memory_capacity_bytes))


def test_every_replica_of_a_mixed_cluster_is_checked_for_memory():
    # Pipeline ranks nested inside replicas: replica 0 runs on the two 80 GB A100s, replica 1 on the two 32 GB
    # V100s. A stage of this model needs ~52 GB (4 blocks of hidden 8192, weights and Adam states): it fits the
    # A100s, not the V100s, so the plan does not fit although its first replica does.
    p = problem("2xA100+2xV100", model="gpt:layers=8,hidden=8192,heads=64,seq=128,vocab=1000", global_batch=4)
    e = evaluate(p, Candidate(1, 2, 2, 1, "1f1b", rank_order="tp-pp-dp"))
    assert e.memory_capacity_bytes == (80 * 10 ** 9,) * 2 + (32 * 10 ** 9,) * 2  # the catalog's A100 80GB, V100 32GB
    assert all(32 * 10 ** 9 < peak < 80 * 10 ** 9 for peak in e.peak_memory_bytes), e.peak_memory_bytes
    assert not e.feasible and e.reason.startswith("out of memory: pipeline rank ") and "of replica 1 (v100" in e.reason
