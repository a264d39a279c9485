"""MemorySizes' training state under ZeRO with a measured profile (the executor's training), against the executor's
own tensors counted by hand: ``executor.data_parallel`` keeps, per replica, the whole parameters and (ZeRO-1) their
whole gradients, and its sharded optimizer a slice of the parameters it steps, that slice's gradient (ZeRO-1; under
ZeRO-2 the slice's gradient is the sharded gradient) and Adam's state on the slice."""

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


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_1_holds_a_parameter_slice_and_its_gradient_beside_the_whole_ones(dp):
    sizes, n = _sizes(1, dp)
    assert sizes.state_bytes(0, n) == n * (PARAMS + GRADS) + -(-n * (ADAM + PARAMS + GRADS) // dp)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_2_holds_a_parameter_slice_beside_the_sharded_gradients(dp):
    sizes, n = _sizes(2, dp)
    assert sizes.state_bytes(0, n) == n * PARAMS + -(-n * GRADS // dp) + -(-n * ADAM // dp) + -(-n * PARAMS // dp)


def test_without_zero_and_under_zero_3_nothing_is_added():
    sizes, n = _sizes(0, 2)
    assert sizes.state_bytes(0, n) == n * (PARAMS + GRADS + ADAM)
    sizes, n = _sizes(3, 2)
    assert sizes.state_bytes(0, n) == -(-n * PARAMS // 2) + -(-n * GRADS // 2) + -(-n * ADAM // 2)
