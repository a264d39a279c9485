"""The torchtitan experiment: every current row read, each mapped to the inputs torchtitan's configuration means, and
its prediction the one prediction path's (``sim.run`` on the same flags gives the same tokens per device)."""

import json
import math
import subprocess
import sys

import pytest

from experiments import torchtitan
from experiments.published_rows import RowResult
from sim.cost.allocator import FRAGMENTATION


def test_every_current_row_is_read():
    rows = torchtitan.load_rows()
    assert len(rows) == 32 and len({r.row_id for r in rows}) == 32
    assert {r.gpu for r in rows} == {"H100-HBM2E", "H200"}


def _row(row_id):
    return next(r for r in torchtitan.load_rows() if r.row_id == row_id)


def test_rows_become_torchtitans_configuration():
    cp = torchtitan.plan_inputs(_row("tt2412_t2_4"))  # FSDP 1, CP 8, 262,144 tokens, full AC, Float8, compile
    assert (cp.dp, cp.cp, cp.cp_comm, cp.zero, cp.global_batch) == (1, 8, "allgather", 3, 1)
    assert cp.model == "llama3.1-8b,seq=262144" and cp.topology == "1x8xH100-HBM2E"
    assert cp.recompute == "full" and cp.precision == "fp8" and cp.compiled
    pp = torchtitan.plan_inputs(_row("tt2412_t5_2"))  # 405B interleaved: one microbatch per stage, 2 per rank
    assert (pp.schedule, pp.chunks, pp.microbatch_size, pp.global_batch) == ("interleaved", 2, 2, 256)
    assert not pp.reshard_after_forward  # torchtitan keeps parameters gathered under pipeline parallelism
    plain = torchtitan.plan_inputs(_row("tt2412_t1_1"))
    assert (plain.dp, plain.zero, plain.microbatch_size, plain.recompute, plain.precision, plain.compiled) == \
        (8, 3, 2, "selective", None, False)
    assert torchtitan.unmodelled(_row("atp_70b_6")) == ("async TP's transfers' contention with the GEMMs",
                                                        "Float8 rowwise GEMM's small-shape tail")
    assert torchtitan.plan_inputs(_row("atp_70b_6")).async_tp and not torchtitan.plan_inputs(_row("atp_70b_5")).async_tp
    assert torchtitan.plan_inputs(_row("atp_70b_6")).precision == "fp8-rowwise"
    assert torchtitan.plan_inputs(_row("atp_70b_4")).precision == "fp8"  # the tensorwise twin
    assert torchtitan.plan_inputs(_row("atp_70b_6")).sequence_parallel
    # the loss as each file's torchtitan ran it: eager at 9dec370 (compile or not), compiled with the model from
    # pull request #1033 on (the June 2025 files) when compile is on
    assert {torchtitan.plan_inputs(_row(r)).loss for r in ("tt2412_t1_1", "tt2412_t1_2", "tt2412_t5_1")} == {"eager"}
    assert torchtitan.plan_inputs(_row("trainy_1")).loss == "compiled"
    assert torchtitan.plan_inputs(_row("atp_70b_1")).loss == "compiled"


@pytest.mark.parametrize("row_id", ["tt2412_t1_2", "tt2412_t2_2"])
def test_a_rows_prediction_is_sim_runs(row_id, tmp_path):
    row = _row(row_id)
    result = torchtitan.predict_row(row)
    inputs = torchtitan.plan_inputs(row)
    flags = ["--model", inputs.model, "--topology", inputs.topology, "--dp", str(inputs.dp), "--cp", str(inputs.cp),
             "--zero", str(inputs.zero), "--global-batch", str(inputs.global_batch), "--microbatch-size",
             str(inputs.microbatch_size), "--recompute", inputs.recompute, "--ignore-memory", "--no-gantt",
             "--out", str(tmp_path)]
    flags += ["--compile"] * inputs.compiled + ["--precision", "fp8"] * (inputs.precision == "fp8")
    flags += ["--cp-comm", inputs.cp_comm] * (inputs.cp > 1) + ["--loss", inputs.loss]
    subprocess.run([sys.executable, "-m", "sim.run", *flags], check=True, capture_output=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert result.predicted == metrics["tokens_per_s_per_device"]
    assert result.error == pytest.approx(result.predicted / row.tokens_per_s_per_gpu - 1)
    # memory beside throughput: the ledger's peak over the devices, against the published max reserved (GiB)
    assert result.peak_memory_bytes == max(d["peak_memory_bytes"] for d in metrics["devices"])
    assert result.fits == all(d["peak_memory_bytes"] <= d["memory_capacity_bytes"] for d in metrics["devices"])
    # what the GPUs report: the allocated peak grown by the allocator's fragmentation, at most the device
    reserved = max(d["reserved_memory_bytes"] for d in metrics["devices"])
    assert result.reserved_memory_bytes == reserved == min(
        math.ceil(result.peak_memory_bytes * (1 + FRAGMENTATION)), metrics["devices"][0]["memory_capacity_bytes"])
    assert torchtitan.memory_error(result) == pytest.approx(reserved / (row.memory_gib * 2**30) - 1)


def test_twenty_rows_publish_their_peak_memory_and_the_report_judges_them():
    rows = torchtitan.load_rows()
    published = {r.row_id: r.memory_gib for r in rows if r.memory_gib is not None}
    assert len(published) == 20 and published["tt2412_t1_1"] == 82.4 and published["trainy_2"] == 46.97
    with pytest.raises(ValueError, match="atp_70b_6"):
        torchtitan.memory_error(RowResult(_row("atp_70b_6"), 1.0, 1.0, (), True))


def test_the_fragmentation_fit_recovers_a_known_reserve_and_stops_at_the_device():
    from dataclasses import replace

    rows = [r for r in torchtitan.load_rows() if r.memory_gib is not None]
    # allocated peaks made so that the published reserved figures are each 1.2x of them: the fit must find 0.2
    results = [RowResult(replace(r, memory_gib=r.memory_gib), 1.0, r.memory_gib * 2**30 / 1.2, (), True)
               for r in rows]
    split = torchtitan.memory_halves(results, 0)
    assert split == torchtitan.memory_halves(results, 0) and split.count("fit") == 10
    assert torchtitan.fit_fragmentation(results, split) == pytest.approx(0.2)
    assert all(abs(torchtitan.memory_error(r, 0.2)) < 1e-9 for r in results)
    # a peak the device cannot hold reserves the device, no more
    huge = RowResult(rows[0], 1.0, 1e12, (), False)
    assert torchtitan.memory_error(huge, 0.2) == pytest.approx(96e9 / (rows[0].memory_gib * 2**30) - 1)


def test_the_split_is_seeded_and_fits_only_fully_modelled_rows_of_the_fitted_device():
    rows = torchtitan.load_rows()
    split = torchtitan.halves(rows, 0)
    assert split == torchtitan.halves(rows, 0) and split != torchtitan.halves(rows, 1)
    fit = [row for row, half in zip(rows, split) if half == "fit"]
    assert len(fit) == 8 and all(row.gpu == "H100-HBM2E" and not row.async_tp for row in fit)
    assert all(set(torchtitan.unmodelled(row)) <= {torchtitan.UNSTATED_PP} for row in fit)


def test_the_descent_finds_a_known_minimum():
    from experiments.torchtitan_fit import fit_figures

    target = {"matmul_efficiency": 0.5, "fp8_matmul_efficiency": 0.6, "attention_efficiency": 0.25}

    def objective(figures):
        return sum(abs(figures[k] / target[k] - 1) for k in target)

    found, value = fit_figures(objective, {k: 0.8 for k in target})
    assert value < 0.03 and all(found[k] == pytest.approx(target[k], rel=0.015) for k in target)


def test_trial_figures_reach_the_fitted_device_only():
    from experiments.torchtitan_fit import DEVICE, with_figures
    from sim.hw.topology import Topology

    topology = Topology.parse("1xH100-HBM2E+1xH100")  # one of each
    changed = with_figures(topology, {"matmul_efficiency": 0.3})
    assert [d.matmul_efficiency for d in changed.devices if d.name == DEVICE] == [0.3]
    assert [d for d in changed.devices if d.name != DEVICE] == [d for d in topology.devices if d.name != DEVICE]
    row = _row("tt2412_t1_1")
    slow = torchtitan.predict_row(row, with_figures(Topology.parse(torchtitan.plan_inputs(row).topology),
                                                     {"matmul_efficiency": 0.3}))
    assert slow.predicted < torchtitan.predict_row(row).predicted
