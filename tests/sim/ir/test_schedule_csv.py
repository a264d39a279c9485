"""schedule.csv: PyTorch's compute-only CSV, and its compute_comms form read by keeping the compute actions."""

import pytest

from sim.core.errors import SpecError
from sim.ir.plan import Op
from sim.ir.schedule_csv import dumps_schedule_csv, load_schedule_csv


def _ids(programs):
    return [[op.id for op in program] for program in programs]


def test_compute_only_round_trip(tmp_path):
    programs = ((Op.parse("0F0"), Op.parse("0F1"), Op.parse("0B0"), Op.parse("0B1")),
                (Op.parse("1F0"), Op.parse("1I0"), Op.parse("1W0"), Op.parse("1F1"), Op.parse("1B1")))
    path = tmp_path / "s.csv"
    path.write_text(dumps_schedule_csv(programs))
    assert load_schedule_csv(path) == programs


def test_compute_comms_file_keeps_compute_actions_in_order(tmp_path):
    # The shape of what PyTorch's runtime schedules dump: FSDP bookkeeping, sends, receives, gradient reduction.
    path = tmp_path / "comms.csv"
    path.write_text("0UNSHARD,0F0,0SEND_F0,0RECV_B0,0I0,0W0,0REDUCE_GRAD,0RESHARD\n"
                    "1UNSHARD,1RECV_F0,1F0,1I0,1SEND_B0,1W0,1REDUCE_GRAD,1RESHARD\n")
    assert _ids(load_schedule_csv(path)) == [["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]]


def test_dualpipev_overlap_cell_is_its_forward_then_its_backward(tmp_path):
    # DualPipeV overlaps a forward of one stage with a full backward of another in one cell; read sequentially (the
    # order PyTorch's runtime runs the sub-actions in), the pair costs F + B: an upper bound on the overlapped time.
    path = tmp_path / "dualpipev.csv"
    path.write_text("0F0,0F1,(0F2;1B0)OVERLAP_F_B,1B1,0RECV_B2,1B2\n")
    assert _ids(load_schedule_csv(path)) == [["0F0", "0F1", "0F2", "1B0", "1B1", "1B2"]]


@pytest.mark.parametrize("cell,message", [
    ("0FOO1", "row 1, column 2"), ("0OPT_STEP", "not a compute op"), ("0F", "has no microbatch"),
    ("(0F1;1X0)OVERLAP_F_B", r"row 1, column 2: not an op: '1X0'"),
    # The overlapped pair is exactly one F then one B: whatever else the cell holds is named.
    ("(0F1;0F2)OVERLAP_F_B", r"holds F;F; an OVERLAP_F_B cell must hold one forward and one full backward"),
    ("(0F1;1SEND_B0)OVERLAP_F_B", r"row 1, column 2: '\(0F1;1SEND_B0\)OVERLAP_F_B' holds F;SEND_B; an OVERLAP_F_B"),
    ("(0UNSHARD;0F1;1B0)OVERLAP_F_B", r"holds UNSHARD;F;B; an OVERLAP_F_B cell must hold one forward"),
    ("(0F1;1B0;1RESHARD)OVERLAP_F_B", r"holds F;B;RESHARD; an OVERLAP_F_B"),
    ("(1B0;0F1)OVERLAP_F_B", r"holds B;F; an OVERLAP_F_B"),
    ("(0F1)OVERLAP_F_B", r"holds F; an OVERLAP_F_B"),
    ("(0F;1B0)OVERLAP_F_B", r"has no microbatch for 0F"),
])
def test_bad_cells_are_named(tmp_path, cell, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"0F0,{cell}\n")
    with pytest.raises(SpecError, match=message):
        load_schedule_csv(path)


def test_a_binary_file_is_named_not_decoded(tmp_path):
    path = tmp_path / "schedule.csv"
    path.write_bytes(b"0F0,\xff\xfe0B0\n")
    with pytest.raises(SpecError, match=r"schedule file .*schedule.csv is not UTF-8 text \(byte 0xff at offset 4\)"):
        load_schedule_csv(path)
