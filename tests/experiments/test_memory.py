"""experiments.memory: the quick run's rows and files, every uniform stage's simulated activation memory equal to the
published closed forms to the byte (written out here again from the papers' statements, not taken from the
experiment), the GPT's overflow column against the device's capacity, and bad input."""

from __future__ import annotations

import csv

import pytest

from experiments import memory
from experiments.memory import StageRow
from sim.core.errors import SpecError


@pytest.fixture(scope="module")
def quick() -> memory.Result:
    return memory.run(quick=True)


def _units(row: StageRow) -> tuple[int, int, int, int]:
    """A, C, R, P of the uniform model as the test derives them from its spec: L/(p·v) layers of 1 MB saved output
    each plus the stage input of 1 MB; every layer's input, 1 MB each; one layer's 1 MB; 10 MB of weights per
    layer."""
    layers = 16 // (row.p * row.chunks)
    return (layers + 1) * 10**6, layers * 10**6, 10**6, layers * 10 * 10**6


def _published(schedule: str, p: int, m: int, r: int, v: int, recompute: bool, a: int, c: int, layer: int,
               w: int) -> int:
    """Bytes beyond the training state on stage r:
    GPipe keeps all m microbatches (GPipe §2.3); 1F1B p - r (Megatron SC'21 §2.2.1); interleaved, Megatron's
    warm-up 2(p - r - 1) + (v - 1)p chunk forwards plus one, capped at the m·v chunks there are; ZB-H1 p on every
    stage in this engine (W frees, README); PipeDream p - r plus its live weight versions, one per forward after the
    first p - r, at most p - r at a time. With recomputation a stage keeps every layer's input only (Megatron's uniform
    checkpointing, one layer per checkpoint), plus the one layer rebuilt at a time by the microbatch being
    backpropagated (and, under ZB-H1, by each of the r waiting for their W)."""
    if schedule == "gpipe":
        n, extra = m, 0
    elif schedule == "1f1b":
        n, extra = p - r, 0
    elif schedule == "interleaved":
        n, extra = min(2 * (p - r - 1) + (v - 1) * p + 1, m * v), 0
    elif schedule == "zb1p":
        n, extra = p, 0
    else:
        n, extra = p - r, min(p - r, 1 + m - (p - r)) * w
    if not recompute:
        return n * a + extra
    rebuilt = r + 1 if schedule == "zb1p" else 1
    return n * c + rebuilt * layer + extra


def test_the_quick_run_covers_every_schedule_m_and_stage(quick):
    plans = {(r.schedule, r.recompute, r.m) for r in quick.uniform}
    assert plans == {(s, rc, m) for s in ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream")
                     for rc in (False, True) for m in (4, 8, 16)}
    assert len(quick.uniform) == len(plans) * 4 and {r.part for r in quick.uniform} == {"uniform"}


def test_every_uniform_stage_equals_its_closed_form_to_the_byte(quick):
    for row in quick.uniform:
        a, c, layer, w = _units(row)
        assert (row.activation, row.checkpoint, row.rebuilt_layer, row.param) == (a, c, layer, w)
        assert row.workspace == 0
        expected = _published(row.schedule, row.p, row.m, row.stage, row.chunks, row.recompute, a, c, layer, w)
        assert row.peak - row.state == row.simulated == expected, row


def test_the_interleaved_first_stage_is_megatrons_p_a_times_one_plus_p_minus_1_over_pv(quick):
    # p = 4, v = 2, m = 8: p·A_stage·(1 + (p - 1)/(p·v)) with A_stage = v chunk activations is 11 chunk activations
    (row,) = [r for r in quick.uniform if (r.schedule, r.recompute, r.m, r.stage) == ("interleaved", False, 8, 0)]
    p, v = 4, 2
    assert row.simulated == round(p * v * (1 + (p - 1) / (p * v))) * row.activation


def test_gpt_rows_flag_exactly_the_stages_over_the_device(quick, tmp_path):
    gpt = list(quick.gpt)
    assert len(gpt) == 10 * 8 and {r.capacity for r in gpt} == {80e9} and {r.part for r in gpt} == {"gpt"}
    # 1F1B's stage 0 holds p = 8 microbatches, its last stage one (plus the LM head's workspace), as the form says
    first, last = [r for r in gpt if (r.schedule, r.recompute) == ("1f1b", False)][::7]
    assert first.simulated == 8 * first.activation
    assert last.simulated == last.activation + last.workspace > 0
    # the file's overflow column: exactly the stages whose peak is over the device's 80 GB
    files = memory.write(quick, tmp_path)
    assert files == [tmp_path / "memory.csv", tmp_path / "memory.png"]
    assert files[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(files[0], newline="") as handle:
        written = [r for r in csv.DictReader(handle) if r["part"] == "gpt"]
    assert [(int(r["peak_bytes"]), r["overflows"] == "true") for r in written] == [
        (r.peak, r.peak > 80 * 10**9) for r in gpt]


@pytest.mark.parametrize("stages", ["1", "4,x", "16", "4,4"])
def test_bad_stages_are_refused_naming_the_flag(stages):
    with pytest.raises(SpecError, match="--stages"):
        memory.run(quick=True, stages=stages)
