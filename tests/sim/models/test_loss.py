"""The loss's memory (sim.models.loss) against the byte counts of each implementation's tensors, and the heads that
carry it."""

from dataclasses import astuple

import pytest

from sim.models import build_model
from sim.models.loss import LOSSES, loss_bytes
from sim.models.sharding import Sharding

S, V = 8, 100  # tokens and vocabulary columns of one sample


def test_each_implementation_holds_its_tensors():
    # fused (Megatron): fp32 softmax kept; the bf16 logits before the cast; the bf16 gradient copy
    assert astuple(loss_bytes("fused", S, V)) == (4 * S * V, 2 * S * V, 2 * S * V)
    # eager: log-probs kept; bf16 logits + fp32 copy; nll's and log_softmax's fp32 gradients
    assert astuple(loss_bytes("eager", S, V)) == (4 * S * V, 6 * S * V, 8 * S * V)
    # eager over a vocabulary-parallel head (loss_parallel): + the shifted copy and its exponential, 3 fp32 grads
    assert astuple(loss_bytes("eager", S, V, vocab_parallel=True)) == (4 * S * V, 10 * S * V, 12 * S * V)
    # compiled: the bf16 input and the fp32 log-sum-exp kept; the input's gradient
    assert astuple(loss_bytes("compiled", S, V)) == (2 * S * V + 4 * S, 0, 2 * S * V)
    with pytest.raises(ValueError, match="fused, eager, compiled"):
        loss_bytes("chunked", S, V)


def _head(spec, **sharding):
    return build_model(spec, Sharding(**sharding)).layers[-1]


@pytest.mark.parametrize("spec", ["llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=512,seq=32",
                                  "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512"])
def test_the_head_carries_the_loss_and_nothing_else_changes(spec):
    fused = build_model(spec, Sharding(loss="fused"))
    assert fused == build_model(spec)  # the default builds the model as before
    for loss in LOSSES[1:]:
        other = build_model(spec, Sharding(loss=loss))
        assert other.layers[:-1] == fused.layers[:-1]  # only the head's memory differs
        expected, default = loss_bytes(loss, 32, 512), loss_bytes("fused", 32, 512)
        head, base = other.layers[-1], fused.layers[-1]
        assert head.saved_bytes - base.saved_bytes == expected.saved - default.saved
        assert (head.workspace_bytes, head.backward_transient_bytes) == (expected.forward_transient,
                                                                         expected.backward_transient)
        assert (head.flops_fwd, head.param_bytes) == (base.flops_fwd, base.param_bytes)


def test_a_vocabulary_parallel_head_under_eager_is_loss_parallels():
    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=512,seq=32"
    head = _head(spec, tp=2, loss="eager")
    assert head.backward_transient_bytes == loss_bytes("eager", 32, 256, vocab_parallel=True).backward_transient


def test_a_model_without_a_vocabulary_refuses_another_loss():
    from sim.core.errors import SpecError

    with pytest.raises(SpecError, match="eager loss"):
        build_model("uniform:layers=4,fwd_ms=1,bwd_ms=2,act_mb=1,param_mb=10", Sharding(loss="eager"))
