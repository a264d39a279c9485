"""build_plan's bounds: the op count it predicts before generating, the op cap and the byte-count overflow."""

from __future__ import annotations

import pytest

from sim.core.errors import SpecError
from sim.ir.plan import SCHEDULED_KINDS
from sim.ir.schedule_csv import dumps_schedule_csv
from sim.models import build_model
from sim.plan import limits
from sim.plan.build import build_plan
from sim.plan.inputs import PlanInputs
from sim.plan.limits import MAX_BYTES, MAX_PLAN_OPS, check_plan_size, compute_ops_per_microbatch, plan_op_count
from sim.run import main
from sim.schedules import SCHEDULES, ScheduleEntry

#: Compute ops per (vstage, microbatch) by the schedules' definitions: F and B, or F, I and W (ZB-H1's split); a
#: stream's F and B and at most one R (the drain's recompute), so its count is a bound; DualPipeV's F and B or F, I
#: and W (it splits the backwards at its ends only), so its count is a bound too.
DEFINED = {"gpipe": 2, "1f1b": 2, "interleaved": 2, "pipedream": 2, "zb1p": 3, "stream": 3, "dualpipev": 3}


def test_compute_ops_per_microbatch_are_the_schedules_definitions():
    assert {name: compute_ops_per_microbatch(entry) for name, entry in SCHEDULES.items()} == DEFINED


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("recompute", [False, True])
def test_predicted_op_count_is_the_lowered_plans(schedule, recompute):
    entry = SCHEDULES[schedule]
    for ranks, m in ((1, 1), (2, 2), (3, 6), (4, 8)):
        chunks = 2 if entry.chunked else 1
        if entry.chunked and ranks == 1 or schedule == "stream" and recompute:  # a stream refuses --recompute
            continue
        if entry.fixed_chunks > 1 and m < 2 * ranks:  # DualPipeV needs m >= 2p
            continue
        layers = ranks * entry.chunks_per_rank(chunks)
        built = build_plan(PlanInputs(f"uniform:layers={layers}", f"{ranks}xideal", schedule, m,
                                      chunks=chunks, recompute=recompute))
        plan = built.plan
        predicted = plan_op_count(m, plan.placement.vstage_to_rank, DEFINED[schedule] + recompute,
                                  entry.weight_policy in ("stash", "stream"))
        # A stream recomputes only in its drain: the bound counts one R per (vstage, frame), the plan has fewer.
        missing = sum(1 for program in plan.programs for op in program if op.kind.value == "F") - sum(
            1 for program in plan.programs for op in program if op.kind.value == "R") if schedule == "stream" else 0
        if schedule == "dualpipev":  # B on most (vstage, microbatch), I and W on the rest: the count of 3 bounds them
            split = sum(1 for program in plan.programs for op in program if op.kind.value == "W")
            missing = len(plan.placement.vstage_to_rank) * m - split
            assert split > 0 and missing > 0
        assert predicted - missing == sum(len(program) for program in plan.programs), (schedule, ranks, m)


def test_predicted_op_count_of_a_schedule_file(tmp_path):
    built = build_plan(PlanInputs("uniform:layers=4", "4xideal", "zb1p", 6))
    csv = tmp_path / "zb.csv"
    csv.write_text(dumps_schedule_csv(built.plan.programs))
    compute = sum(op.kind in SCHEDULED_KINDS for program in built.plan.programs for op in program)
    assert plan_op_count(6, (0, 1, 2, 3), compute / (4 * 6), False) == sum(map(len, built.plan.programs))
    assert build_plan(PlanInputs("uniform:layers=4", "4xideal", microbatches=None, schedule_file=str(csv))).plan \
        .programs == built.plan.programs


def test_the_cap_is_the_memory_budget_at_the_measured_bytes_per_op():
    assert MAX_PLAN_OPS == limits.MEMORY_BUDGET_BYTES // limits.PEAK_BYTES_PER_OP
    graph = build_model("uniform:layers=1")
    # One vstage, one compute op per microbatch: m + 1 ops (the OPT_STEP), so m = MAX - 1 is the largest that fits.
    check_plan_size(graph, MAX_PLAN_OPS - 1, 1, (0,), 1, False)
    with pytest.raises(SpecError, match=rf"--microbatches {MAX_PLAN_OPS}$"):
        check_plan_size(graph, MAX_PLAN_OPS, 1, (0,), 1, False)


def test_too_many_microbatches_are_rejected_before_any_generator_runs(monkeypatch, capsys, tmp_path):
    original = ScheduleEntry.build

    def build_small_only(self, num_ranks, num_microbatches, chunks=1):
        assert num_microbatches <= 4, "the generator ran for the plan itself"  # the op-count probe uses 4
        return original(self, num_ranks, num_microbatches, chunks)

    monkeypatch.setattr(ScheduleEntry, "build", build_small_only)
    for schedule in ("1f1b", "zb1p", "pipedream"):
        with pytest.raises(SystemExit) as info:
            main(["--topology", "4xV100", "--model", "gpt:layers=8", "--schedule", schedule, "-m", "1000000000000",
                  "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith("error: a plan of ") and err.endswith("--microbatches 1000000000000\n"), err
        assert "bytes of memory sim.run needs per op (measured)" in err
    assert not (tmp_path / "out").exists()


def test_microbatch_size_that_overflows_the_byte_counts_is_rejected():
    graph = build_model("uniform:layers=2,act_mb=1")
    per_sample = graph.input_bytes + sum(layer.activation_bytes + layer.saved_bytes + layer.workspace_bytes
                                         for layer in graph.layers)
    largest = MAX_BYTES // (8 * per_sample)  # 8 microbatches of it still fit in 2^63 - 1 bytes
    check_plan_size(graph, 8, largest, (0, 1), 2, False)
    with pytest.raises(SpecError, match=rf"overflow the memory accounting .*; --microbatch-size {largest + 1}$"):
        check_plan_size(graph, 8, largest + 1, (0, 1), 2, False)


def test_absurd_microbatch_size_is_one_error_line(capsys, tmp_path):
    size = "1" + "0" * 320  # beyond a float: used to end in an OverflowError traceback
    with pytest.raises(SystemExit) as info:
        main(["--topology", "4xV100", "--model", "gpt:layers=8", "-m", "4", "--microbatch-size", size,
              "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.endswith(f"--microbatch-size {size}\n"), err


def test_chunks_are_counted_before_the_placement_is_built():
    # 4 ranks × 10^12 chunks would be a placement tuple of 4·10^12 entries; the count alone rejects it.
    with pytest.raises(SpecError, match=r"more stages \(4000000000000, 1000000000000 per device of 4xideal\)"):
        build_plan(PlanInputs("uniform:layers=8", "4xideal", "interleaved", 8, chunks=10**12))
