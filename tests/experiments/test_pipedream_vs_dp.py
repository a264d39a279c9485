"""experiments.pipedream_vs_dp: the plans it tries, its figures against closed forms, its files and errors."""

from __future__ import annotations

import csv

import pytest

from experiments import pipedream_vs_dp
from experiments.pipedream_vs_dp import CLUSTERS, MODELS, ClusterCase, ModelCase, PlanCase, candidates, compare
from sim.core.errors import SpecError
from sim.hw.topology import Topology
from tests.sim.cost.nccl_closed_form import nccl_call_s


def test_candidates_are_dp_then_every_depth_dividing_the_devices_with_both_nestings():
    plans = candidates(16, 10)
    assert plans[:2] == [PlanCase("1f1b", 1, 16), PlanCase("1f1b", 1, 16, overlap=True)]
    assert {(c.pp, c.dp) for c in plans[2:]} == {(2, 8), (4, 4), (8, 2)}  # 16 stages > 10 layers: left out
    assert len(plans) == 2 + 3 * 2 * 2  # three depths x {1f1b, gpipe} x {replicas adjacent, stages adjacent}
    full = candidates(16, 16)
    assert full[-3:] == [PlanCase("1f1b", 16, 1), PlanCase("gpipe", 16, 1), PlanCase("pipedream", 16, 1)]
    assert [c.label for c in (*full[:4], full[-1])] == [
        "DP x16", "DP x16 (overlapped)", "1f1b pp2 x dp8 (replicas adjacent)", "1f1b pp2 x dp8 (stages adjacent)",
        "pipedream pp16"]
    assert [(c.pp, c.dp) for c in candidates(6, 8)][2:] == [(2, 3)] * 4 + [(3, 2)] * 4 + [(6, 1)] * 3


def test_on_free_links_every_plan_is_the_pipeline_closed_form():
    # 8 layers of f = 1 ms and b = 2 ms per sample on ideal devices (transfers and all-reduces cost nothing): a flush
    # schedule over p stages of 8/p layers takes (m + p - 1)(8/p)(f + b) (GPipe's and 1F1B's bubble), and so does
    # one pipedream iteration (no flush inside it, but it fills and drains once); pure DP is m·8·(f + b).
    model = ModelCase("u", "uniform:layers=8,fwd_ms=1,bwd_ms=2", 1, 16)
    result = compare(model, ClusterCase("ideal", "8xideal", "free links"))
    assert len(result.plans) == 13 and all(p.status == "ok" for p in result.plans)
    for plan in result.plans:
        p, d = plan.candidate.pp, plan.candidate.dp
        m = 16 // d
        assert plan.microbatches == m
        assert plan.time_s == pytest.approx((m + p - 1) * (8 // p) * 3e-3, rel=1e-12), plan.candidate
    # DP (2 microbatches of 8 layers) is the fastest here; the best pipeline is the shallowest (least bubble: pp 2,
    # m 4, 5 x 4 layers), and the first of equal ones
    assert result.dp.time_s == pytest.approx(0.048, rel=1e-12)
    assert result.dp is result.plans[0] and result.best is result.plans[2]  # first of equal ones
    assert result.best.candidate.label == "1f1b pp2 x dp4 (replicas adjacent)"
    assert result.speedup == pytest.approx(0.048 / 0.060, rel=1e-12)


def test_pure_dp_is_compute_plus_the_ring_all_reduce_of_the_whole_gradient():
    # 4 layers of 25 MB of weights on one NVSwitch (every ring hop gpu → switch → gpu): after the 2 microbatches of
    # its 32/16 samples, each replica all-reduces S = 100 MB, 2(n-1)/n · S/B + 2(n-1)·α (the ring beats the tree at
    # this size); synthetic layers update for free.
    model = ModelCase("u", "uniform:layers=4,fwd_ms=1,bwd_ms=2,param_mb=25", 1, 32)
    result = compare(model, ClusterCase("nv", "16xV100", "NVSwitch"))
    path = Topology.parse("16xV100").path(0, 1)
    alpha, bandwidth = sum(link.spec.latency for link in path), min(link.spec.bandwidth for link in path)

    def ring(size: float, n: int = 16) -> float:
        return 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * alpha

    compute, last_backward = 2 * 4 * 3e-3, 4 * 2e-3
    after, overlapped = result.plans[:2]
    # Each all-reduce is an NCCL call over NVSwitch: its link time at the cheaper protocol's latencies, with the
    # chosen algorithm's steps (ring 2(n - 1) = 30, tree 2·log2(16) = 8).
    assert after.time_s == pytest.approx(compute + nccl_call_s(ring(100e6), 30, "nvlink"), rel=1e-12)
    # Overlapped (PyTorch DDP's buckets of 25 MiB, K = 4, each costed as a full bucket T): bucket k of K is ready at
    # k/K of the last backward and they are reduced one after another, so the last ends at
    # max_k (k/K·Δ + (K - k + 1)·T) after that backward starts. At 25 MiB NCCL's double binary tree,
    # 2·(log2(16)·α + S/B), beats the ring; the fastest is used.
    tree = 2 * (4 * alpha + 25 * 2**20 / bandwidth)
    assert tree < ring(25 * 2**20)
    k_buckets, bucket = 4, nccl_call_s(tree, 8, "nvlink")
    tail = max(k / k_buckets * last_backward + (k_buckets - k + 1) * bucket for k in range(1, k_buckets + 1))
    assert overlapped.time_s == pytest.approx(compute - last_backward + tail, rel=1e-12)
    assert result.dp is overlapped and overlapped.time_s < after.time_s


def test_a_global_batch_that_does_not_split_over_the_devices_is_refused():
    with pytest.raises(SpecError, match="global batch 40 is not a multiple of microbatch size 1 x 16 devices"):
        compare(ModelCase("u", "uniform:layers=4", 1, 40), ClusterCase("nv", "16xV100", ""))


def test_the_clusters_are_the_ones_described():
    a, b, dgx2 = (Topology.parse(CLUSTERS[k].topology) for k in ("A", "B", "dgx2"))
    assert a.num_ranks == b.num_ranks == dgx2.num_ranks == 16
    assert {d.name for d in a.devices} == {"v100-pcie-16gb"} and {d.name for d in b.devices} == {"v100-sxm2-16gb"}
    # Cluster-A's servers meet over 10 GbE, B's over 25 GbE; the DGX-2 never leaves its NVSwitch
    assert {link.spec.name for link in a.path(0, 4)} >= {"eth-10g"}
    assert {link.spec.name for link in b.path(0, 8)} >= {"eth-25g"}
    assert {link.spec.name for link in dgx2.path(0, 15)} == {"nvswitch-v100"}
    for model in MODELS.values():  # every default batch splits into whole microbatches on 16 replicas
        assert model.global_batch % (16 * model.microbatch_size) == 0


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_quick_run_writes_its_files_and_its_summary_agrees_with_every_plan(tmp_path):
    result = pipedream_vs_dp.run(quick=True, clusters="A")  # half of --quick
    assert [(c.model.key, c.cluster.key) for c in result.comparisons] == [("vgg16", "A"), ("cnn", "A")]
    files = pipedream_vs_dp.write(result, tmp_path)
    assert files == [tmp_path / "pipedream_vs_dp.csv", tmp_path / "plans.csv", tmp_path / "pipedream_vs_dp.png"]
    summary, plans = _rows(files[0]), _rows(files[1])
    assert [(r["model"], r["cluster"]) for r in summary] == [("vgg16", "A"), ("cnn", "A")]
    for row, comparison in zip(summary, result.comparisons):
        # the summary's DP and best plan are the fastest of the plans tried, by brute force over them (to 1e-9: of
        # equal plans the first in order wins)
        assert len([p for p in plans if (p["model"], p["cluster"]) == (row["model"], row["cluster"])]) == int(
            row["plans_tried"]) == len(comparison.plans)
        fitting = [p for p in comparison.plans if p.time_s is not None]
        assert comparison.dp.time_s == pytest.approx(min(p.time_s for p in fitting if p.candidate.pp == 1), rel=1e-9)
        assert comparison.best.time_s == pytest.approx(min(p.time_s for p in fitting if p.candidate.pp > 1), rel=1e-9)
        assert all(p.status == "ok" for p in fitting)
        assert comparison.speedup == comparison.dp.time_s / comparison.best.time_s
        assert float(row["speedup"]) == pytest.approx(comparison.speedup, rel=1e-8)
        assert int(row["plans_out_of_memory"]) == sum(p.status.startswith("out of memory") for p in comparison.plans)
    speedup = {(c.model.key, c.cluster.key): c.speedup for c in result.comparisons}
    # VGG-16's 553 MB of fp32 gradients over 10 GbE: pipelining wins; a 60K-parameter CNN with 4 MB activations
    # per frame: data parallelism wins
    assert speedup["vgg16", "A"] > 1 > speedup["cnn", "A"]
    assert summary[0]["paper_speedup"] == "5.28" and files[2].stat().st_size > 10_000


@pytest.mark.parametrize("options, message", [({"models": "resnet"}, "--models: unknown 'resnet'"),
                                              ({"clusters": ","}, "--clusters: unknown empty list")])
def test_bad_keys_are_refused_naming_the_flag(options, message):
    with pytest.raises(SpecError, match=message):
        pipedream_vs_dp.run(**options)
