"""What the loss over the vocabulary holds on a device, by how the framework computes it (``--loss``).

A language model's last layer scores every token against the whole vocabulary: s x V logits per sample (V the
device's share of the vocabulary under a vocabulary-parallel head). At a 128k vocabulary these are the largest tensors
of a step (Llama 3 8B at 16k tokens: 2.1 G logits, 8.4 GB in fp32), and how the cross entropy keeps and frees them
decides a step's peak, which comes at the start of the backward, when every layer's activations are still held.
Three implementations are in use, each per sample of s tokens and V vocabulary columns (bytes):

``fused`` (the default): Megatron-LM's ``vocab_parallel_cross_entropy`` (``megatron/core/tensor_parallel/
cross_entropy.py``): the bf16 logits 2sV are cast to fp32 once, exponentiated in place and kept as the softmax 4sV;
the backward turns that buffer into the gradient in place, so only the gradient's bf16 copy 2sV for the LM head's
backward is new. Saved 4sV, forward transient 2sV (the bf16 logits until the cast), backward transient 2sV.

``eager``: ``torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels)`` in eager PyTorch, torchtitan's
loss (``train.py`` at 9dec370, the Dec-2024 benchmarks' commit; ``torchtitan/components/loss.py`` from bbb1b616e,
pull request #1033, whenever ``training.compile`` is off). The forward holds the bf16 logits 2sV (the training loop
frees ``pred`` only after the loss), their fp32 copy 4sV and ``log_softmax``'s fp32 output 4sV, which autograd keeps;
the backward makes ``nll_loss``'s fp32 gradient 4sV and ``log_softmax``'s 4sV beside the kept output before casting
back. Saved 4sV, forward transient 6sV, backward transient 8sV. Over a vocabulary-parallel head torchtitan runs it
under ``loss_parallel`` (its default with tensor parallelism), whose DTensor handlers (``torch/distributed/tensor/
parallel/loss.py``, read at torch 2.13.0) compute the log-softmax by hand: the fp32 input, its shifted copy and that
copy's exponential 4sV each before the kept output exists (10sV beyond the kept 4sV, the bf16 logits included), and
in the backward ``(grad_input + exp(x)) * grad_output`` with ``grad_input`` a zeroed 4sV: three fp32 tensors beside
the kept output at once. Saved 4sV, forward transient 10sV, backward transient 12sV.

``compiled``: the same loss under ``torch.compile`` (torchtitan compiles it with the model from pull request #1033,
2025-04-02; before that a TODO kept it eager). Inductor fuses the cast, the log-sum-exp and the gather; what it keeps
for the backward is the graph's input, the bf16 logits 2sV, and the fp32 log-sum-exp per token 4s, and the backward
writes the input's gradient 2sV in one fused kernel ("memory-wise it's ~0 for just fwd and ~d_input for fw+bw",
a PyTorch compiler developer on Dao-AILab/quack issue 48, 2025-10-07). Saved 2sV + 4s, forward transient 0, backward
transient 2sV.

Each figure counts the loss's tensors only; the final norm's output (the LM head's input) and its statistics are the
head layer's own (``sim.models.llama``, ``gpt``, ``moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOSSES", "LossBytes", "loss_bytes"]

#: The loss implementations ``--loss`` takes, the default first.
LOSSES = ("fused", "eager", "compiled")

FP32_BYTES = 4
BF16_BYTES = 2


@dataclass(frozen=True)
class LossBytes:
    """What the loss over one sample's logits holds (bytes; module docstring).

    Attributes:
        saved: kept from the forward until the head's backward.
        forward_transient: alive only while the head's forward runs, beyond ``saved``.
        backward_transient: alive only while the head's backward runs, beyond ``saved``.
    """

    saved: int
    forward_transient: int
    backward_transient: int


def loss_bytes(loss: str, tokens: int, vocab_columns: int, *, vocab_parallel: bool = False) -> LossBytes:
    """The bytes the loss ``loss`` (one of :data:`LOSSES`) holds for one sample of ``tokens`` tokens scored against
    ``vocab_columns`` vocabulary columns (the device's share under a vocabulary-parallel head, ``vocab_parallel``:
    tensor parallelism splits the head).

    Raises:
        ValueError: ``loss`` is not one of :data:`LOSSES`.
    """
    logits = tokens * vocab_columns
    if loss == "fused":
        return LossBytes(FP32_BYTES * logits, BF16_BYTES * logits, BF16_BYTES * logits)
    if loss == "eager" and vocab_parallel:  # loss_parallel's hand-written log-softmax and its backward
        return LossBytes(FP32_BYTES * logits, (BF16_BYTES + 2 * FP32_BYTES) * logits, 3 * FP32_BYTES * logits)
    if loss == "eager":
        return LossBytes(FP32_BYTES * logits, (BF16_BYTES + FP32_BYTES) * logits, 2 * FP32_BYTES * logits)
    if loss == "compiled":
        return LossBytes(BF16_BYTES * logits + FP32_BYTES * tokens, 0, BF16_BYTES * logits)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
