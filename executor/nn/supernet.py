"""Torch layers of the ``supernet`` model: GPT embedding and head around choice blocks of candidate ops.

Mirrors ``sim/models/supernet.py`` layer for layer: ``embed`` and ``head`` are :mod:`executor.nn.gpt`'s modules
(parameters ``V*h + s*h`` and ``2h + V*h``), and block b is a :class:`ChoiceBlock` holding the K candidates of
:func:`sim.models.supernet.candidate_kinds` in an ``nn.ModuleList``; each candidate has exactly
:func:`sim.models.supernet.candidate_params` parameters (``tests/executor/nn/test_supernet.py`` checks every
kind). Batches and loss are GPT's: (n, s) token ids, next-token cross-entropy.

Which candidate runs. A :class:`ChoiceBlock` runs ``candidates[choice]``; NASPipe's stage sets ``m.idx`` on each
layer the same way before a subnet's forward (../shared/reference/schedules.md §7). :func:`set_subnet` sets every
block of a stage (or any module) from one subnet. Candidates that do not run get no gradient (``grad is None``),
which is how an optimizer step touches only the subnet's layers.

Notation: n = samples, s = sequence length, h = hidden size, B = choice blocks, K = candidates per block.

As in :mod:`executor.nn.gpt`: fp32 on CPU (the graph's fp16 is for GPU costing; counts are what match), no
dropout, deterministic CPU kernels only (Linear, Conv1d, LayerNorm, scaled_dot_product_attention on CPU).

Initialisation. ``init_parameters(generator)`` of a ChoiceBlock draws one 62-bit base from the layer's generator
(seeded from ``(seed, layer index)`` by :mod:`executor.nn.stages`, so split-independent), then initialises candidate
k from its own ``torch.Generator`` seeded with ``derive_seed("candidate", base, k)``. So candidate k's weights
depend only on (seed, block, k, its kind and sizes, B): not on the stage split, not on the subnet order, not on
which other candidates exist (``choices=4`` gives the same first four candidates as ``choices=8``). Within a
candidate, GPT-2's scheme: every weight N(0, 0.02^2), biases 0, LayerNorm (1, 0), and the last weight of each
residual branch (the one writing into the residual stream) N(0, (0.02 / sqrt(2B))^2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.nn import gpt as models_gpt
from executor.nn.seeds import derive_seed
from sim.models.supernet import KIND_SHAPES, candidate_heads, candidate_kinds

__all__ = [
    "INIT_STD", "ChoiceBlock", "CausalConv", "SeparableConv", "Attention", "FeedForward", "GatedFeedForward",
    "Identity", "make_candidate", "make_layer", "make_batch", "loss", "set_subnet", "freeze_shared", "trainable",
]

INIT_STD = models_gpt.INIT_STD  # 0.02, GPT-2's weight init standard deviation


def _normal(weight: Tensor, std: float, generator: torch.Generator) -> None:
    weight.normal_(0.0, std, generator=generator)


class _Residual(nn.Module):
    """Base of the candidates with parameters: ``x + branch(LN(x))``.

    Args:
        hidden: h.
        n_blocks: B, for the 1/sqrt(2B) scale of the branch's last weight.
    """

    def __init__(self, hidden: int, n_blocks: int) -> None:
        super().__init__()
        self.n_blocks = n_blocks
        self.ln = nn.LayerNorm(hidden)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        """``(module with .weight/.bias, is the branch's last)`` in a fixed init order."""
        raise NotImplementedError

    def init_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator`` (module docstring), in a fixed order."""
        residual_std = INIT_STD / math.sqrt(2 * self.n_blocks)
        with torch.no_grad():
            self.ln.weight.fill_(1.0)
            self.ln.bias.zero_()
            for module, last in self._weights():
                _normal(module.weight, residual_std if last else INIT_STD, generator)
                if module.bias is not None:
                    module.bias.zero_()

    def branch(self, y: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """(n, s, h) fp32 -> (n, s, h) fp32."""
        return x + self.branch(self.ln(x))


def _causal_conv(conv: nn.Conv1d, y: Tensor) -> Tensor:
    """Apply ``conv`` along the sequence of (n, s, h) ``y``, left-padded by k - 1 so position t sees only <= t."""
    k = conv.kernel_size[0]
    return conv(F.pad(y.transpose(1, 2), (k - 1, 0))).transpose(1, 2)


class CausalConv(_Residual):
    """``conv{k}``: ``x + ReLU(Conv1d(h, h, k)(LN(x)))``, causal; k*h^2 + 3h parameters."""

    def __init__(self, hidden: int, kernel: int, n_blocks: int) -> None:
        super().__init__(hidden, n_blocks)
        self.conv = nn.Conv1d(hidden, hidden, kernel)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        return [(self.conv, True)]

    def branch(self, y: Tensor) -> Tensor:
        return F.relu(_causal_conv(self.conv, y))


class SeparableConv(_Residual):
    """``dwconv{k}``: ``x + ReLU(Linear(h, h)(depthwise Conv1d(h, h, k)(LN(x))))``, causal; h^2 + (k + 4)h params."""

    def __init__(self, hidden: int, kernel: int, n_blocks: int) -> None:
        super().__init__(hidden, n_blocks)
        self.depthwise = nn.Conv1d(hidden, hidden, kernel, groups=hidden)
        self.pointwise = nn.Linear(hidden, hidden)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        return [(self.depthwise, False), (self.pointwise, True)]

    def branch(self, y: Tensor) -> Tensor:
        return F.relu(self.pointwise(_causal_conv(self.depthwise, y)))


class Attention(_Residual):
    """``attn`` / ``attn_few``: causal multi-head self-attention, fused QKV, with biases; 4h^2 + 6h parameters."""

    def __init__(self, hidden: int, heads: int, n_blocks: int) -> None:
        super().__init__(hidden, n_blocks)
        assert hidden % heads == 0, (hidden, heads)  # the spec parser enforces it
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        return [(self.qkv, False), (self.proj, True)]

    def branch(self, y: Tensor) -> Tensor:
        n, s, h = y.shape
        q, k, v = self.qkv(y).split(h, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, h // self.heads)).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(n, s, h))


class FeedForward(_Residual):
    """``ffn{m}``: ``x + Linear(mh, h)(GELU(Linear(h, mh)(LN(x))))``; 2m*h^2 + (m + 3)h parameters."""

    def __init__(self, hidden: int, width: int, n_blocks: int) -> None:
        super().__init__(hidden, n_blocks)
        self.up = nn.Linear(hidden, width * hidden)
        self.down = nn.Linear(width * hidden, hidden)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        return [(self.up, False), (self.down, True)]

    def branch(self, y: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(y), approximate="tanh"))


class GatedFeedForward(_Residual):
    """``glu{m}``: ``x + Linear(mh, h)(GLU(Linear(h, 2mh)(LN(x))))``, GLU(a, b) = a * sigmoid(b) (Dauphin et al.
    2017); 3m*h^2 + (2m + 3)h parameters."""

    def __init__(self, hidden: int, width: int, n_blocks: int) -> None:
        super().__init__(hidden, n_blocks)
        self.up = nn.Linear(hidden, 2 * width * hidden)
        self.down = nn.Linear(width * hidden, hidden)

    def _weights(self) -> list[tuple[nn.Module, bool]]:
        return [(self.up, False), (self.down, True)]

    def branch(self, y: Tensor) -> Tensor:
        return self.down(F.glu(self.up(y), dim=-1))


class Identity(nn.Module):
    """``identity``: returns its input (the very same tensor); no parameters."""

    def init_parameters(self, generator: torch.Generator) -> None:
        """Nothing to fill."""

    def forward(self, x: Tensor) -> Tensor:
        return x


def make_candidate(kind: str, hidden: int, heads: int, n_blocks: int) -> nn.Module:
    """The uninitialised candidate module of ``kind`` (an entry of :data:`sim.models.supernet.KIND_CYCLE`).

    Args:
        kind: e.g. ``"conv5"``, ``"attn_few"``.
        hidden: h.
        heads: the spec's ``heads``; attention candidates take :func:`~sim.models.supernet.candidate_heads`.
        n_blocks: B.
    """
    family, size = KIND_SHAPES[kind]
    if family == "conv":
        return CausalConv(hidden, size, n_blocks)
    if family == "dwconv":
        return SeparableConv(hidden, size, n_blocks)
    if family == "attn":
        return Attention(hidden, candidate_heads(kind, heads), n_blocks)
    if family == "ffn":
        return FeedForward(hidden, size, n_blocks)
    if family == "glu":
        return GatedFeedForward(hidden, size, n_blocks)
    assert family == "identity", family
    return Identity()


class ChoiceBlock(nn.Module):
    """Layer ``block{b}``: the K candidates of choice block b; :attr:`choice` selects the one that runs.

    Args:
        block: b, the block's index among the choice blocks (graph layer ``b + 1``).
        kinds: the candidates' kinds, in candidate order.
        hidden: h.
        heads: the spec's ``heads``.
        n_blocks: B.

    Attributes:
        block: b.
        candidates: ``nn.ModuleList`` of the K candidates; state-dict keys ``candidates.{k}.*``.
        choice: the index of the candidate :meth:`forward` runs (default 0); setting it checks the range.
    """

    def __init__(self, block: int, kinds: Sequence[str], hidden: int, heads: int, n_blocks: int) -> None:
        super().__init__()
        self.block = block
        self.kinds = tuple(kinds)
        self.candidates = nn.ModuleList(make_candidate(kind, hidden, heads, n_blocks) for kind in self.kinds)
        self._choice = 0

    @property
    def choice(self) -> int:
        return self._choice

    @choice.setter
    def choice(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(self.candidates):
            raise ValueError(f"block {self.block}: choice must be an int in [0, {len(self.candidates)}), got {value!r}")
        self._choice = value

    def init_parameters(self, generator: torch.Generator) -> None:
        """Initialise every candidate from its own generator (module docstring), whatever :attr:`choice` is."""
        base = int(torch.randint(2**62, (1,), generator=generator).item())
        for k, candidate in enumerate(self.candidates):
            own = torch.Generator(device="cpu").manual_seed(derive_seed("candidate", base, k))
            candidate.init_parameters(own)  # type: ignore[operator]

    def forward(self, x: Tensor) -> Tensor:
        """Run the chosen candidate: (n, s, h) fp32 -> (n, s, h) fp32."""
        return self.candidates[self._choice](x)

    def extra_repr(self) -> str:
        return f"block={self.block}, choice={self._choice}, kinds={','.join(self.kinds)}"


def make_layer(values: dict[str, int], i: int) -> nn.Module:
    """The uninitialised module of graph layer ``i`` (0 = embed, 1..B = choice blocks, B + 1 = head).

    Args:
        values: the canonical spec's keys: ``blocks``, ``choices``, ``hidden``, ``heads``, ``seq``, ``vocab``.
        i: layer index in ``[0, B + 2)``.
    """
    n_blocks, h = values["blocks"], values["hidden"]
    if i == 0:
        return models_gpt.GPTEmbedding(values["vocab"], values["seq"], h)
    if i <= n_blocks:
        return ChoiceBlock(i - 1, candidate_kinds(values["choices"]), h, values["heads"], n_blocks)
    assert i == n_blocks + 1, (i, n_blocks)
    return models_gpt.GPTHead(h, values["vocab"])


make_batch = models_gpt.make_batch  # (n, s) token ids and next-token targets
loss = models_gpt.loss  # mean next-token cross-entropy


def set_subnet(module: nn.Module, choices_by_block: Mapping[int, int] | Sequence[int]) -> None:
    """Select one subnet: set :attr:`ChoiceBlock.choice` of every ChoiceBlock inside ``module`` by its block index.

    Args:
        module: a :class:`~executor.nn.stages.Stage`, a whole model, or a single ChoiceBlock.
        choices_by_block: ``{block: candidate}``, or a whole subnet as a sequence (``subnet[b]`` for block b).
            Blocks the module does not hold are ignored, so the same subnet can be passed to every stage.

    Raises:
        KeyError: a ChoiceBlock in ``module`` whose block has no entry.
        ValueError: a choice out of range; nothing is changed then.
    """
    if not isinstance(choices_by_block, Mapping):
        choices_by_block = dict(enumerate(choices_by_block))
    blocks = [m for m in module.modules() if isinstance(m, ChoiceBlock)]
    missing = sorted(m.block for m in blocks if m.block not in choices_by_block)
    if missing:
        raise KeyError(f"no choice for block(s) {missing} of the module (given blocks {sorted(choices_by_block)})")
    for m in blocks:  # validate all before changing any
        value = choices_by_block[m.block]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(m.candidates):
            raise ValueError(f"block {m.block}: choice must be an int in [0, {len(m.candidates)}), got {value!r}")
    for m in blocks:
        m.choice = choices_by_block[m.block]


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters CSP trains (the choice blocks; frozen shared layers excluded)."""
    return [p for p in module.parameters() if p.requires_grad]


def freeze_shared(module: nn.Module, shared_names: Sequence[str]) -> None:
    """Freeze the layers every subnet uses (embedding, head), by submodule name prefix."""
    for name, param in module.named_parameters():
        if any(name.startswith(prefix) for prefix in shared_names):
            param.requires_grad_(False)
