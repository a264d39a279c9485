"""The kernel-level GPU cost (sim.cost.gpu_time) against hand-computed cases.

Oracles: the issue/queue recurrence worked by hand (host-bound: Σ host + the last kernel's GPU time; GPU-bound:
the first host time + Σ GPU; a mixed case step by step), tile and wave counts of a GEMM on a toy device whose
numbers make the arithmetic exact, the memory-bound formula ``bytes / (bandwidth · efficiency)``, and Megatron's
count of tensor-parallel collectives per block (Narayanan et al. 2021 §2.3: two all-reduces in the forward, two
in the backward). Devices and kernel models are built here, so the built-in constants can be refitted freely.
"""

import math
from dataclasses import fields
from importlib.resources import files

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.core.errors import SpecError
from sim.cost.gpu_time import (
    KernelModel,
    default_kernel_model,
    kernel_seconds,
    load_kernel_model,
    optimizer_seconds,
    sequence_seconds,
    transformer_layer_seconds,
)
from sim.cost.kernels.block import layer_step_kernels
from sim.cost.kernels.optimizer import optimizer_kernels
from sim.cost.kernels.record import Kernel
from sim.hw.catalog import DeviceSpec
from sim.models.graph import TransformerPart

# A toy GPU: 4 compute units, 1e12 FLOP/s at a 0.5 matmul ceiling (5e11 FLOP/s achieved), 1e12 bytes/s (5e11
# achieved at the test models' memory efficiency of 0.5).
TOY = DeviceSpec("toy", 1e12, 0.5, 1e9, 1e12, 1e-5, "pcie3-x16", "test", 1e12, compute_units=4)
# The same with unbounded compute and bandwidth: every kernel then takes exactly the kernel gap.
INSTANT = DeviceSpec("instant", math.inf, 1.0, 1e12, math.inf, 0.0, "pcie3-x16", "test", math.inf, compute_units=4)


def _model(**changes) -> KernelModel:
    # Every overhead 0 (also any constant added to the model later, which these kernel-level cases do not use),
    # memory-bound kernels at half the bandwidth, 16 × 16 GEMM tiles with 8 K-steps of prologue and epilogue.
    values = {item.name: 0.0 for item in fields(KernelModel) if item.name != "source"}
    values.update(memory_efficiency=0.5, gemm_k_overhead=8, gemm_tile=16, source="test")
    values.update(changes)
    return KernelModel(**values)


# --- the issue/queue recurrence ----------------------------------------------------------------------------------

def test_sequence_of_nothing_takes_no_time():
    assert sequence_seconds([]) == 0.0


def test_host_bound_sequence_is_the_host_time_plus_the_last_kernel():
    # Each kernel finishes before the host has issued the next: Σ host + gpu of the last = 9 + 1.
    assert sequence_seconds([(3.0, 1.0), (3.0, 2.0), (3.0, 1.0)]) == 10.0


def test_gpu_bound_sequence_is_the_first_issue_plus_the_gpu_time():
    # The next kernel is always issued before the GPU is free: host of the first + Σ gpu = 1 + 12.
    assert sequence_seconds([(1.0, 5.0), (1.0, 4.0), (2.0, 3.0)]) == 13.0


def test_mixed_sequence_by_hand():
    # issued 1, 2, 10, 11, 12; done 1+5 = 6, max(6, 2)+1 = 7, max(7, 10)+1 = 11 (the GPU idled 7..10 waiting for
    # the host), max(11, 11)+4 = 15, max(15, 12)+4 = 19. Neither extreme's formula: both give 16.
    steps = [(1.0, 5.0), (1.0, 1.0), (8.0, 1.0), (1.0, 4.0), (1.0, 4.0)]
    assert sum(h for h, _ in steps) + steps[-1][1] == 16.0 == steps[0][0] + sum(g for _, g in steps)
    assert sequence_seconds(steps) == 19.0


_STEP = st.tuples(st.integers(0, 100), st.integers(0, 100))


@given(st.lists(_STEP, min_size=1, max_size=30))
def test_sequence_lies_between_its_extremes(steps):
    # Integers keep the sums exact. The GPU cannot finish before the host has issued everything and run the last
    # kernel, nor before it has run every kernel from the first issue; and the host and GPU never both idle.
    steps = [(float(h), float(g)) for h, g in steps]
    total = sequence_seconds(steps)
    hosts, gpus = [h for h, _ in steps], [g for _, g in steps]
    assert total >= max(sum(hosts) + gpus[-1], hosts[0] + sum(gpus))
    assert total <= sum(hosts) + sum(gpus)


# --- one kernel ----------------------------------------------------------------------------------------------------

def _gemm(m, n, k, batch=1):
    # Operands and output in fp16: at most 14,848 bytes here, 30 ns on the toy device, a tenth of a wave.
    return Kernel("g", "gemm", 2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * 2), (m, n, k), batch)


def _brute_force_slots(m: int, n: int, batch: int, units: int, tile: int) -> int:
    """Tile slots (elements of output computed, padding included) of the best of the library's tile shapes."""
    shapes = [(tile, tile), (2 * tile, tile), (tile, 2 * tile), (tile, tile // 2), (tile // 2, tile)]
    best = None
    for tm, tn in shapes:
        tiles = -(-m // tm) * -(-n // tn) * batch
        waves = -(-tiles // units)
        slots = waves * units * tm * tn
        best = slots if best is None else min(best, slots)
    return best


def test_gemm_that_fills_one_wave_exactly_and_one_tile_more_takes_two():
    model = _model(kernel_gap_s=1e-6)
    # 64 × 16 with 16 × 16 tiles: 4 tiles, the toy's 4 units, one wave of 4 · 2 · 16² · (64 + 8) = 147,456 FLOPs.
    one_wave = 147_456 / 5e11
    assert kernel_seconds(_gemm(64, 16, 64), TOY, model) == pytest.approx(one_wave + 1e-6, rel=1e-12)
    # With square tiles only, one row more would be a fifth tile and a second full wave (8 slots of 16²); the library
    # instead picks 16 × 8 tiles: 10 of them, 3 waves of 4 slots of 128 elements, 3/4 of the second wave's cost.
    assert _brute_force_slots(65, 16, 1, 4, 16) == 12 * 128
    assert kernel_seconds(_gemm(65, 16, 64), TOY, model) == pytest.approx(1.5 * one_wave + 1e-6, rel=1e-12)
    # 80 rows: 16 × 8 (or 8 × 16) tiles again, 10 of them in 3 waves; 32 × 16 tiles would take a wave of 4 × 512.
    assert _brute_force_slots(80, 16, 1, 4, 16) == 12 * 128
    assert kernel_seconds(_gemm(80, 16, 64), TOY, model) == pytest.approx(1.5 * one_wave + 1e-6, rel=1e-12)
    # Batched products count their tiles together: 2 × (32 × 32) is 8 square tiles, two full waves, and no other
    # shape fills the units better.
    assert _brute_force_slots(32, 32, 2, 4, 16) == 8 * 256
    assert kernel_seconds(_gemm(32, 32, 64, batch=2), TOY, model) == pytest.approx(2 * one_wave + 1e-6, rel=1e-12)
    # Each check above is compute bound: the operands move in well under a wave.
    assert _gemm(80, 16, 64).bytes / (TOY.memory_bandwidth * model.memory_efficiency) < one_wave


def test_small_k_pays_the_tile_overhead():
    # K = 8 with 8 K-steps of prologue and epilogue: twice the FLOPs of the product itself.
    model = _model()
    assert kernel_seconds(_gemm(64, 16, 8), TOY, model) == pytest.approx(4 * 2 * 16 * 16 * 16 / 5e11, rel=1e-12)


def test_memory_bound_kernels_move_their_bytes_at_the_achieved_bandwidth():
    model = _model(kernel_gap_s=2e-6)
    # 1 GB at 1e12 · 0.5 bytes/s: 2 ms, whatever FLOPs an elementwise kernel declares.
    for kind in ("elementwise", "norm", "softmax", "dropout", "loss", "optimizer"):
        kernel = Kernel("k", kind, 1e15, 1e9)
        assert kernel_seconds(kernel, TOY, model) == pytest.approx(2e-3 + 2e-6, rel=1e-12), kind
    # A GEMM whose operands outweigh its arithmetic is memory bound too: one wave (≈ 0.3 µs) against 2 ms.
    skinny = Kernel("g", "gemm", 2.0 * 16 * 16 * 64, 1e9, (16, 16, 64))
    assert kernel_seconds(skinny, TOY, model) == pytest.approx(2e-3 + 2e-6, rel=1e-12)


def test_attention_is_a_roofline_over_its_flops_and_bytes():
    model = _model()
    assert kernel_seconds(Kernel("a", "attention", 1e9, 10.0), TOY, model) == pytest.approx(1e9 / 5e11, rel=1e-12)
    assert kernel_seconds(Kernel("a", "attention", 1.0, 1e9), TOY, model) == pytest.approx(2e-3, rel=1e-12)


# --- a layer and an optimizer step -------------------------------------------------------------------------------

BLOCK = dict(b=2, s=64, h=64, a=4)


def _block(tp):
    return TransformerPart("block", seq=BLOCK["s"], hidden=BLOCK["h"], heads=BLOCK["a"], vocab=100, tp=tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_bound_block_on_an_instant_device_counts_its_kernels(tp):
    # With no host time and kernels that take only the gap, a layer is its kernel count times the gap.
    fwd_k, bwd_k = layer_step_kernels(BLOCK["b"], BLOCK["s"], BLOCK["h"], BLOCK["a"], tp, sequence_parallel=False)
    seconds = transformer_layer_seconds(_block(tp), BLOCK["b"], INSTANT, _model(kernel_gap_s=0.5))
    assert (seconds.fwd, seconds.bwd) == (0.5 * len(fwd_k), 0.5 * len(bwd_k))


@pytest.mark.parametrize("tp, collectives", [(1, 0), (2, 2)])
def test_host_bound_block_issues_its_kernels_and_megatrons_collectives(tp, collectives):
    # Host-bound (1 s per issue against 0.5 s per kernel): Σ host + the last kernel. Megatron's block calls two
    # tensor-parallel collectives each way (f and g of Narayanan §2.3), none without tensor parallelism.
    fwd_k, bwd_k = layer_step_kernels(BLOCK["b"], BLOCK["s"], BLOCK["h"], BLOCK["a"], tp, sequence_parallel=False)
    model = _model(host_issue_s=1.0, host_collective_s=1.0, kernel_gap_s=0.5)
    seconds = transformer_layer_seconds(_block(tp), BLOCK["b"], INSTANT, model)
    assert seconds.fwd == len(fwd_k) + collectives + 0.5
    assert seconds.bwd == len(bwd_k) + collectives + 0.5


def test_selective_recompute_adds_the_attention_core_to_the_backward():
    plain = transformer_layer_seconds(_block(1), 2, INSTANT, _model(kernel_gap_s=0.5))
    again = transformer_layer_seconds(_block(1), 2, INSTANT, _model(kernel_gap_s=0.5), selective_recompute=True)
    # Korthikanti §5: Megatron's checkpointed CoreAttention is re-run: QKᵀ, the softmax (fused here: b·a = 8 rows
    # and s = 64 meet Megatron's rule), its dropout, attention over V and the context's permute copy, 5 kernels.
    assert again.fwd == plain.fwd and again.bwd == plain.bwd + 5 * 0.5


def test_optimizer_step_is_memory_bound_over_its_states():
    model = _model()
    kernels = optimizer_kernels(1000, dtype_bytes=2)
    moved = sum(k.bytes for k in kernels)
    assert optimizer_seconds(1000, TOY, model, 2) == pytest.approx(moved / (1e12 * 0.5), rel=1e-12)
    assert optimizer_seconds(0, TOY, model, 2) == 0.0
    # A ZeRO-1 share of 999.5 parameters is costed as 1000 whole ones.
    assert optimizer_seconds(999.5, TOY, model, 2) == optimizer_seconds(1000, TOY, model, 2)


# --- the constants' file -----------------------------------------------------------------------------------------

_GIVEN = {"host_issue_s": 5e-5, "host_collective_s": 7e-5, "kernel_gap_s": 2e-6, "memory_efficiency": 0.7,
          "gemm_k_overhead": 64, "gemm_tile": 128, "step_overhead_s": 8e-3}
# A complete document: the values above, and 0 for any constant the model has besides them.
_VALID = {**{item.name: "0.0" for item in fields(KernelModel) if item.name != "source"},
          # Exponent form with a decimal point: YAML 1.1 reads "5e-05" as a string.
          **{name: f"{value:.6e}" if isinstance(value, float) else str(value) for name, value in _GIVEN.items()},
          "source": "a test"}


def _yaml(entry):
    return "kernel_model:\n" + "".join(f"  {key}: {value}\n" for key, value in entry.items())


def test_a_complete_document_loads_with_its_values():
    model = load_kernel_model(_yaml(_VALID), "km.yaml")
    assert model == _model(**_GIVEN, source="a test")
    assert (model.host_issue_s, model.gemm_tile, model.step_overhead_s) == (5e-5, 128, 8e-3)


@pytest.mark.parametrize("change, message", [
    ({"host_issue_s": None}, r"km\.yaml: missing field\(s\) \['host_issue_s'\]"),
    ({"bogus_s": "1.0"}, r"km\.yaml: .*unknown field\(s\) \['bogus_s'\]"),
    ({"kernel_gap_s": "-1.0e-06"}, r"km\.yaml: .*kernel_gap_s .*-1e-06"),
    ({"step_overhead_s": "-0.5"}, r"km\.yaml: .*step_overhead_s .*-0.5"),
    ({"memory_efficiency": "1.5"}, r"km\.yaml: .*memory_efficiency .*1\.5"),
    ({"memory_efficiency": "0"}, r"km\.yaml: .*memory_efficiency .*0"),
    ({"gemm_tile": "0"}, r"km\.yaml: .*gemm_tile .*0"),
    ({"gemm_tile": "12.5"}, r"km\.yaml: .*gemm_tile .*12\.5"),
    ({"step_overhead_s": "fast"}, r"km\.yaml: .*step_overhead_s .*'fast'"),
])
def test_a_bad_document_names_the_file_and_the_field(change, message):
    entry = {**_VALID, **change}
    entry = {key: value for key, value in entry.items() if value is not None}
    with pytest.raises(SpecError, match=message):
        load_kernel_model(_yaml(entry), "km.yaml")


def test_a_document_without_the_mapping_is_refused():
    with pytest.raises(SpecError, match=r"km\.yaml: expected a top-level 'kernel_model:' mapping"):
        load_kernel_model("host_issue_s: 1.0\n", "km.yaml")


def test_the_built_in_constants_load():
    path = files("profiles") / "hardware" / "kernel_model.yaml"
    model = load_kernel_model(path.read_text(encoding="utf-8"), str(path))
    assert default_kernel_model() == model and model.source
