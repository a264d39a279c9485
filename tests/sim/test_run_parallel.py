"""``python -m sim.run`` with tensor, data and pipeline parallelism: sizes, outputs and one-line errors."""

from __future__ import annotations

import json

import pytest

from sim.ir.plan import Plan
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.run import main

GPT = "gpt:layers=8,hidden=256,heads=8,seq=64,vocab=512"


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr()


def test_global_batch_sets_the_microbatches_per_replica():
    built = build_plan(PlanInputs(GPT, "2x8xA100", "1f1b", microbatch_size=4, global_batch=96, tp=2, dp=3))
    assert built.plan.num_microbatches == 96 // (4 * 3)
    assert built.plan.layout.pp == 16 // (2 * 3)  # the devices left
    assert built.plan.world_size == 2 * 3 * 2


def test_a_3d_run_writes_its_layout_everywhere(tmp_path, capsys):
    code, out = _run(capsys, "--topology", "2x8xA100", "--model", GPT, "--tp", "2", "--dp", "2", "--pp", "4",
                     "--global-batch", "32", "--microbatch-size", "2", "--schedule", "interleaved", "--chunks", "2",
                     "--out", str(tmp_path))
    assert code == 0, out.err
    assert "parallel TP 2 × DP 2 × PP 4 = 16 devices (order tp-dp-pp); tp groups: 8, first [0, 1]; dp groups: 8, " \
           "first [0, 2]; pp groups: 4, first [0, 4, 8, 12]" in out.out
    plan = Plan.loads((tmp_path / "plan.json").read_text())
    assert (plan.layout.tp, plan.layout.dp, plan.layout.pp, plan.num_microbatches) == (2, 2, 4, 8)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["plan"]["parallel"] == {"tp": 2, "dp": 2, "pp": 4, "order": "tp-dp-pp", "sequence_parallel": False,
                                           "zero": 0, "devices": 16}
    assert metrics["replicas"] == 2
    assert [d["device_rank"] for d in metrics["devices"]] == [0, 4, 8, 12]
    assert metrics["throughput_samples_per_s"] == pytest.approx(32 / metrics["iteration_time_s"])
    assert {"TP_F", "TP_B", "REDUCE_GRAD"} <= set(metrics["ops"])
    trace = json.loads((tmp_path / "trace.json").read_text())
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "tp", "collective"} <= threads
    assert (tmp_path / "gantt.png").stat().st_size > 0


@pytest.mark.parametrize(("args", "needle"), [
    (["--tp", "4", "--dp", "4", "--microbatches", "4"], "--tp 4 × --dp 4 = 16 devices, topology 8xA100 has 8"),
    (["--tp", "2", "--dp", "2", "--pp", "4", "--microbatches", "4"],
     "--tp 2 × --dp 2 × --pp 4 = 16 devices, topology 8xA100 has 8"),
    (["--dp", "3", "--global-batch", "32", "--microbatch-size", "2"],
     "--global-batch 32 is not a whole number of microbatches of --microbatch-size 2 on --dp 3 replicas "
     "(32 / (2 × 3) = 5.33333)"),
    (["--dp", "2", "--global-batch", "32", "--microbatches", "4"],
     "--microbatches 4 disagrees with --global-batch 32 = 16 microbatches × 1 samples × 2 replicas"),
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--zero", "1", "--microbatches", "4"], "--zero 1 shards optimizer state across data-parallel replicas; it needs "
                                             "--dp > 1"),
    (["--tp", "2", "--model", "uniform:layers=8", "--microbatches", "4"], "tensor parallelism is modelled for gpt"),
    (["--rank-order", "pp-tp", "--microbatches", "4"], "--rank-order must be one of"),
    (["--sequence-parallel", "--microbatches", "4"], "--sequence-parallel shards activations"),
    (["--dp", "2", "--zero", "1", "--schedule", "pipedream", "--microbatches", "4"],
     "--zero 1 is modelled for schedules that update once per iteration, not pipedream"),
    (["--tp", "3", "--pp", "2", "--microbatches", "4"], "heads"),
])
def test_bad_layouts_are_one_error_line_and_status_2(tmp_path, capsys, args, needle):
    base = ["--topology", "8xA100", "--model", GPT]
    if "--model" in args:
        base = ["--topology", "8xA100"]
    with pytest.raises(SystemExit) as info:
        main([*base, *args, "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "out").exists()


def test_csp_refuses_the_parallel_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--topology", "4xV100", "--schedule", "csp", "--space", "c1", "--dp", "2", "--out", str(tmp_path)])
    assert info.value.code == 2 and "--dp does not apply to --schedule csp" in capsys.readouterr().err


def test_the_bound_on_work_counts_the_tensor_parallel_ops():
    # 1F1B on 4 stages with TP: per microbatch F, B, TP_F, TP_B on each stage and SEND/RECV both ways at 3 cuts.
    from sim.core.errors import SpecError
    with pytest.raises(SpecError, match=r"a plan of 56,000,004 ops \(4 stages on 4 ranks, 28 ops per microbatch\)"):
        build_plan(PlanInputs(GPT, "8xA100", "1f1b", microbatches=2_000_000, tp=2, pp=4))
    plan = build_plan(PlanInputs(GPT, "8xA100", "1f1b", microbatches=3, tp=2, pp=4)).plan
    assert sum(len(program) for program in plan.programs) == 28 * 3 + 4  # and one OPT_STEP per stage
