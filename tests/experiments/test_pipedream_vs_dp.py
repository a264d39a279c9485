"""experiments.run pipedream_vs_dp: the plans it tries, its figures against closed forms, its files and errors."""

from __future__ import annotations

import csv

import pytest

from experiments.pipedream_vs_dp import CLUSTERS, MODELS, ClusterCase, ModelCase, PlanCase, candidates, compare
from experiments.run import main
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
    from sim.core.errors import SpecError

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


def test_quick_run_writes_its_files_and_its_summary_agrees_with_every_plan(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["pipedream_vs_dp", "--quick", "--clusters", "A", "--out", str(out)]) == 0  # half of --quick
    printed = capsys.readouterr().out
    assert "| vgg16 | A (4x4xv100-pcie-16gb) |" in printed and "5.28x" in printed
    assert sorted(p.name for p in out.iterdir()) == ["pipedream_vs_dp.csv", "pipedream_vs_dp.png", "plans.csv"]
    summary, plans = _rows(out / "pipedream_vs_dp.csv"), _rows(out / "plans.csv")
    assert [(r["model"], r["cluster"]) for r in summary] == [("vgg16", "A"), ("cnn", "A")]
    for row in summary:
        mine = [p for p in plans if (p["model"], p["cluster"]) == (row["model"], row["cluster"])]
        assert len(mine) == int(row["plans_tried"])
        dp = min((p for p in mine if p["pp"] == "1"), key=lambda p: float(p["iteration_time_s"]))
        fitting = [p for p in mine if p["pp"] != "1" and p["status"] == "ok"]
        best = min(fitting, key=lambda p: float(p["iteration_time_s"]))
        assert float(row["dp_time_s"]) == pytest.approx(float(dp["iteration_time_s"]), rel=1e-9)
        assert float(row["best_time_s"]) == pytest.approx(float(best["iteration_time_s"]), rel=1e-9)
        assert float(row["speedup"]) == pytest.approx(float(row["dp_time_s"]) / float(row["best_time_s"]), rel=1e-8)
        assert int(row["plans_out_of_memory"]) == sum(p["status"].startswith("out of memory") for p in mine)
    speedup = {(r["model"], r["cluster"]): float(r["speedup"]) for r in summary}
    # VGG-16's 553 MB of fp32 gradients over 10 GbE: pipelining wins; a 60K-parameter CNN with 4 MB activations
    # per frame: data parallelism wins
    assert speedup["vgg16", "A"] > 1 > speedup["cnn", "A"]
    assert summary[0]["paper_speedup"] == "5.28" and (out / "pipedream_vs_dp.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [(["--models", "resnet"], "--models: unknown 'resnet'"),
                                           (["--clusters", ","], "--clusters: unknown empty list"),
                                           (["--bogus"], "unrecognized arguments: --bogus")])
def test_bad_options_are_one_line_and_leave_no_files(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["pipedream_vs_dp", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()
