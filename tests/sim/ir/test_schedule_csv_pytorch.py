"""Schedule files that PyTorch's ``torch.distributed.pipelining`` really writes, and ours read back by PyTorch.

PyTorch's multi-stage schedules build their per-rank action lists (``pipeline_order``) in the constructor, from the
stages' indices and the pipeline group's size alone, so no process group is needed: the stages below are stand-ins
carrying only those fields. ``_PipelineScheduleRuntime._dump_csv(path, format=...)`` writes ``"compute_comms"`` by
default (the lowered schedule with SEND/RECV, UNSHARD/RESHARD and REDUCE_GRAD) and ``"compute_only"`` on request;
``sim`` reads both (``--schedule-file``). The oracles are PyTorch's own ``pipeline_order``, our generators, and the
bubble closed forms of DESIGN §4 under uniform costs on ``Nxideal`` (free links).

This module imports torch; ``sim`` itself never does.
"""

import json
from dataclasses import dataclass, field

import pytest
import torch
from torch.distributed.pipelining import schedules as pt

from sim.ir.plan import Plan
from sim.run import main as sim_main

T_F, T_B = 1e-3, 2e-3  # uniform:fwd_ms=1,bwd_ms=2, one layer per vstage


@dataclass
class _Stage:
    """What a PyTorch schedule constructor reads of a ``PipelineStage``: where it sits in the pipeline, and its module
    (the zero-bubble schedules check that it is an ``nn.Module``). The constructor writes back
    ``stage_index_to_group_rank``."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: torch.nn.Module = field(default_factory=torch.nn.Identity)


def _pytorch_schedule(schedule_class, p, v, m):
    """The schedule object PyTorch builds for rank 0 of p ranks with v stages each (its stages 0, p, 2p, ...)."""
    return schedule_class([_Stage(k * p, p * v, p) for k in range(v)], m)


def _compute_ids(schedule, rank):
    """PyTorch's own per-rank compute order: bubbles (None) dropped, OVERLAP_F_B as its sub-actions in order."""
    ids = []
    for action in schedule.pipeline_order[rank]:
        if action is None:
            continue
        ids.extend(str(sub) for sub in (action.sub_actions or (action,)))
    return ids


def _simulate_file(tmp_path, name, path, p, layers):
    out = tmp_path / name
    assert sim_main(["--topology", f"{p}xideal", "--model", f"uniform:layers={layers},fwd_ms=1,bwd_ms=2",
                     "--partition", "uniform", "--schedule-file", str(path), "--no-gantt", "--out", str(out)]) == 0
    return Plan.loads((out / "plan.json").read_text()), json.loads((out / "metrics.json").read_text())


def _l0_ids(plan):
    return [[op.id for op in program if op.kind.value in ("F", "B", "I", "W")] for program in plan.programs]


def _dump_both(tmp_path, schedule):
    paths = tmp_path / "compute_only.csv", tmp_path / "compute_comms.csv"
    schedule._dump_csv(str(paths[0]), format="compute_only")
    schedule._dump_csv(str(paths[1]))  # the default: compute_comms
    assert "SEND_F" in paths[1].read_text() and "SEND_F" not in paths[0].read_text()
    return paths


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (2, 3, 4), (3, 2, 6)])
def test_interleaved_1f1b_file_is_our_interleaved_schedule(tmp_path, capsys, p, v, m):
    """PyTorch's ``ScheduleInterleaved1F1B`` and ``--schedule interleaved --chunks v`` are the same Megatron schedule
    (arXiv 2104.04473 §2.2): the same per-rank order, hence the same lowered plan and, under uniform costs, the
    bubble (p − 1)/(v·m + p − 1), i.e. the makespan (v·m + p − 1)(t_f + t_b) (DESIGN §4)."""
    schedule = _pytorch_schedule(pt.ScheduleInterleaved1F1B, p, v, m)
    ours = tmp_path / "ours"
    assert sim_main(["--topology", f"{p}xideal", "--model", f"uniform:layers={p * v},fwd_ms=1,bwd_ms=2",
                     "--partition", "uniform", "--schedule", "interleaved", "--chunks", str(v), "-m", str(m),
                     "--no-gantt", "--out", str(ours)]) == 0
    generated = Plan.loads((ours / "plan.json").read_text())
    makespan = (v * m + p - 1) * (T_F + T_B)
    for path in _dump_both(tmp_path, schedule):
        plan, metrics = _simulate_file(tmp_path, path.stem, path, p, p * v)
        assert _l0_ids(plan) == [_compute_ids(schedule, r) for r in range(p)]
        assert plan.programs == generated.programs and plan.placement == generated.placement
        assert metrics["iteration_time_s"] == pytest.approx(makespan, rel=1e-12)
        assert metrics["bubble_fraction"] == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
    capsys.readouterr()


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (2, 3, 4), (3, 2, 3)])
def test_looped_bfs_file_reaches_its_closed_form(tmp_path, capsys, p, v, m):
    """``ScheduleLoopedBFS`` (breadth-first, arXiv 2211.05953): each rank runs all m forwards of its first stage,
    then of its next, ..., then the backwards in reverse. With m ≥ p a rank never waits inside a phase: stage k + p
    needs stage k + p − 1's forward of microbatch j at (k + p + j)·t_f and rank k mod p reaches it at ≥ (k + m + j)·t_f.
    So the forwards end on the last rank at (p − 1 + v·m)·t_f, the backwards start there and ripple back over p − 1
    ranks: makespan (v·m + p − 1)(t_f + t_b), GPipe's bubble over v·m microbatch-chunks."""
    assert m >= p
    schedule = _pytorch_schedule(pt.ScheduleLoopedBFS, p, v, m)
    for path in _dump_both(tmp_path, schedule):
        plan, metrics = _simulate_file(tmp_path, path.stem, path, p, p * v)
        assert _l0_ids(plan) == [_compute_ids(schedule, r) for r in range(p)]
        assert plan.placement.vstage_to_rank == tuple(s % p for s in range(p * v))  # PyTorch's loop placement
        assert metrics["iteration_time_s"] == pytest.approx((v * m + p - 1) * (T_F + T_B), rel=1e-12)
    capsys.readouterr()


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (2, 2, 4)])
def test_interleaved_zero_bubble_file_keeps_pytorchs_order(tmp_path, capsys, p, v, m):
    """``ScheduleInterleavedZeroBubble`` splits each backward into I and W and pads with bubbles: both dump formats
    read back to PyTorch's own compute order, every rank does exactly its v·m·(t_f + t_b) of work (I + W = B), and
    the makespan cannot be below that work."""
    schedule = _pytorch_schedule(pt.ScheduleInterleavedZeroBubble, p, v, m)
    makespans = []
    for path in _dump_both(tmp_path, schedule):
        plan, metrics = _simulate_file(tmp_path, path.stem, path, p, p * v)
        assert _l0_ids(plan) == [_compute_ids(schedule, r) for r in range(p)]
        assert {op.kind.value for program in plan.programs for op in program} >= {"F", "I", "W"}
        busy = [d["busy_s"] for d in metrics["devices"]]
        assert busy == pytest.approx([v * m * (T_F + T_B)] * p, rel=1e-9)
        assert metrics["iteration_time_s"] >= v * m * (T_F + T_B) - 1e-12
        makespans.append(metrics["iteration_time_s"])
    assert makespans[0] == makespans[1]
    capsys.readouterr()


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4)])
def test_dualpipev_overlap_cells_run_as_forward_then_backward(tmp_path, capsys, p, m):
    """``ScheduleDualPipeV`` writes ``(sF i;s'B j)OVERLAP_F_B`` cells; sim reads each as the F then the B on the
    compute stream (what PyTorch's runtime does with the sub-actions), in V placement: rank r holds stages r and
    2p − 1 − r."""
    schedule = _pytorch_schedule(pt.ScheduleDualPipeV, p, 2, m)
    for path in _dump_both(tmp_path, schedule):
        assert "OVERLAP_F_B" in path.read_text()
        plan, metrics = _simulate_file(tmp_path, path.stem, path, p, 2 * p)
        assert _l0_ids(plan) == [_compute_ids(schedule, r) for r in range(p)]
        assert plan.placement.vstage_to_rank == tuple(list(range(p)) + list(reversed(range(p))))
        busy = [d["busy_s"] for d in metrics["devices"]]
        assert busy == pytest.approx([2 * m * (T_F + T_B)] * p, rel=1e-9)
    capsys.readouterr()


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1)])
def test_our_schedule_csv_loads_into_pytorch_with_the_same_actions(tmp_path, capsys, schedule, v):
    """``schedule.csv`` is PyTorch's compute_only format: its ``_PipelineScheduleRuntime._load_csv`` reads it, its
    ``_validate_schedule`` accepts it (inferring our placement) and its lowering adds the communication."""
    p, m = 4, 8
    out = tmp_path / "ours"
    assert sim_main(["--topology", f"{p}xideal", "--model", f"uniform:layers={p * v}", "--partition", "uniform",
                     "--schedule", schedule, "-m", str(m), *(["--chunks", str(v)] if v > 1 else []), "--no-gantt",
                     "--out", str(out)]) == 0
    plan = Plan.loads((out / "plan.json").read_text())
    runtime = pt._PipelineScheduleRuntime([_Stage(k * p, p * v, p) for k in range(v)], m)
    runtime._load_csv(str(out / "schedule.csv"))  # format="compute_only", the default
    assert [[str(a) for a in runtime.pipeline_order[r]] for r in range(p)] == _l0_ids(plan)
    lowered = [[str(a) for a in runtime.pipeline_order_with_comms[r] if a.is_compute_op] for r in range(p)]
    assert lowered == _l0_ids(plan)
    assert [runtime.stage_index_to_group_rank[s] for s in range(p * v)] == list(plan.placement.vstage_to_rank)
    capsys.readouterr()
