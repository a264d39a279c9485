"""MemorySizes' training state under ZeRO with a measured profile (the executor's training), against the executor's
own tensors counted by hand: ``executor.data_parallel`` keeps, per replica, the whole parameters, whole gradients
while a backward makes them (per step; under ZeRO-2 per microbatch, until its reduction copies them), and its sharded
optimizer a slice of the parameters it steps and Adam's state on the slice. The slices of the reduce-scatters'
results are the reductions' (``tests/sim/cost/test_ledger.py``)."""

import pytest

from sim.cost.memory_sizes import MemorySizes, StateShards
from sim.cost.profile import LayerMemory
from sim.models import build_model

PARAMS, GRADS, ADAM = 4_000, 4_000, 8_000  # one layer's fp32 parameters, gradients and Adam's two moments, bytes


def _layer():
    return LayerMemory(output_bytes=0, retained_bytes=0, forward_transient_bytes=0, backward_transient_bytes=0,
                       first_backward_bytes=0, input_backward_bytes=0, weight_backward_bytes=0, deferred_bytes=0,
                       param_bytes=PARAMS, gradient_bytes=GRADS, deferred_gradient_bytes=0, optimizer_bytes=ADAM)


def _sizes(zero, dp):
    graph = build_model("gpt:layers=2,hidden=64,heads=2,seq=16,vocab=100")
    measured = tuple(_layer() for _ in range(len(graph)))
    return MemorySizes(graph, 1, StateShards.of_zero(zero, dp), lambda device: measured), len(graph)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("dp", [2, 4])
def test_zero_1_and_2_hold_a_parameter_slice_beside_the_whole_parameters_and_gradients(zero, dp):
    sizes, n = _sizes(zero, dp)
    assert sizes.state_bytes(0, n) == n * (PARAMS + GRADS) + -(-n * ADAM // dp) + -(-n * PARAMS // dp)


def test_without_zero_and_under_zero_3_nothing_is_added():
    sizes, n = _sizes(0, 2)
    assert sizes.state_bytes(0, n) == n * (PARAMS + GRADS + ADAM)
    sizes, n = _sizes(3, 2)
    assert sizes.state_bytes(0, n) == -(-n * PARAMS // 2) + -(-n * GRADS // 2) + -(-n * ADAM // 2)


def test_a_freed_stage_output_is_the_boundary_the_stage_sends_and_the_last_stage_frees_nothing():
    graph = build_model("llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1000,seq=128")
    sizes = MemorySizes(graph, 2, StateShards(), lambda device: None)
    n = len(graph)
    for start, end in ((0, 2), (2, 4), (1, 3)):  # stages that send their output on
        kept, freed = sizes.activation_bytes(start, end), sizes.activation_bytes(start, end, output_freed=True)
        assert kept - freed == 2 * graph.boundary_bytes(end) == 2 * 128 * 256 * 2  # two samples of s·h in bf16
    assert sizes.activation_bytes(3, n, output_freed=True) == sizes.activation_bytes(3, n)  # sends nothing
