"""experiments.run memory: the quick run's files, every uniform stage's simulated activation memory equal to the
published closed forms to the byte (written out here again from the papers' statements, not taken from the
experiment), the GPT's overflow column against the device's capacity, and bad input."""

from __future__ import annotations

import csv

import pytest

from experiments.run import main as run_main
from tests.experiments.refusal import refused


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    assert run_main(["memory", "--quick", "--out", str(out)]) == 0
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "memory.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _units(row: dict) -> tuple[int, int, int, int]:
    """A, C, R, P of the uniform model as the test derives them from its spec: L/(p·v) layers of 1 MB saved output
    each plus the stage input of 1 MB; every layer's input, 1 MB each; one layer's 1 MB; 10 MB of weights per
    layer."""
    layers = 16 // (int(row["p"]) * int(row["chunks"]))
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
    uniform = [r for r in quick if r["part"] == "uniform"]
    plans = {(r["schedule"], r["recompute"], r["m"]) for r in uniform}
    assert plans == {(s, rc, str(m)) for s in ("gpipe", "1f1b", "interleaved", "zb1p", "pipedream")
                     for rc in ("false", "true") for m in (4, 8, 16)}
    assert len(uniform) == len(plans) * 4


def test_every_uniform_stage_equals_its_closed_form_to_the_byte(quick):
    for row in (r for r in quick if r["part"] == "uniform"):
        a, c, layer, w = _units(row)
        assert (int(row["activation_bytes"]), int(row["checkpoint_bytes"]), int(row["rebuilt_layer_bytes"]),
                int(row["param_bytes"])) == (a, c, layer, w)
        assert int(row["workspace_bytes"]) == 0
        expected = _published(row["schedule"], int(row["p"]), int(row["m"]), int(row["stage"]), int(row["chunks"]),
                              row["recompute"] == "true", a, c, layer, w)
        assert int(row["peak_bytes"]) - int(row["state_bytes"]) == int(row["simulated_bytes"]) == expected, row


def test_the_interleaved_first_stage_is_megatrons_p_a_times_one_plus_p_minus_1_over_pv(quick):
    # p = 4, v = 2, m = 8: p·A_stage·(1 + (p - 1)/(p·v)) with A_stage = v chunk activations is 11 chunk activations
    (row,) = [r for r in quick if (r["part"], r["schedule"], r["recompute"], r["m"], r["stage"]) == (
        "uniform", "interleaved", "false", "8", "0")]
    p, v = 4, 2
    assert int(row["simulated_bytes"]) == round(p * v * (1 + (p - 1) / (p * v))) * int(row["activation_bytes"])


def test_gpt_rows_flag_exactly_the_stages_over_the_device(quick):
    gpt = [r for r in quick if r["part"] == "gpt"]
    assert len(gpt) == 10 * 8 and {float(r["capacity_bytes"]) for r in gpt} == {80e9}
    for row in gpt:
        assert (row["overflows"] == "true") == (int(row["peak_bytes"]) > 80 * 10**9)
    # 1F1B's stage 0 holds p = 8 microbatches, its last stage one (plus the LM head's workspace), as the form says
    first, last = [r for r in gpt if (r["schedule"], r["recompute"]) == ("1f1b", "false")][::7]
    assert int(first["simulated_bytes"]) == 8 * int(first["activation_bytes"])
    assert int(last["simulated_bytes"]) == int(last["activation_bytes"]) + int(last["workspace_bytes"]) > 0


@pytest.mark.parametrize("args, needle", [(["--stages", "1"], "--stages"), (["--stages", "4,x"], "--stages"),
                                          (["--stages", "16"], "--stages"), (["--bogus"], "--bogus")])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, needle):
    assert needle in refused(capsys, ["memory", "--out", str(tmp_path / "o"), *args])
    assert not (tmp_path / "o" / "memory.csv").exists()
