"""The memory-bound kernels of a Llama-family block (``sim.cost.kernels.pointwise``, ``llama_block_kernels``) held
against what torch really dispatches: a block written as torchtitan writes it (``torchtitan/models/norms.py`` and
``models/llama/model.py`` at 9dec370) runs forward and backward under a ``TorchDispatchMode`` that records every aten
op that launches a kernel (not a view) with the bytes of its inputs and outputs; the eager inventory must list the
same ops, in the same order, with the same bytes. The compiled inventory has no such oracle on a CPU (inductor's CPU
code is not its GPU code): it is held to fusing only, never to more bytes, kernels or FLOPs than the eager one. The
per-op selective checkpointing policy is held against ``torch.utils.checkpoint`` running torchtitan's policy."""

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sim.cost.kernels.llama import LlamaBlockShape, llama_block_kernels
from sim.cost.kernels.record import FP8
from sim.models.llama import DecoderShape, block_saved_bytes, sac_recompute_flops, sac_saved_linears

#: The ops whose kernels the inventory costs elsewhere (GEMMs, SDPA) or that the test itself issues (the seed
#: gradient).
NOT_POINTWISE = ("aten.mm", "aten.addmm", "aten._scaled_dot_product", "aten.ones_like")


class _RMSNorm(nn.Module):
    """torchtitan's eager RMSNorm (norms.py at 9dec370): fp32 statistics, cast back, then the weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y.type_as(x) * self.weight


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """torchtitan's apply_rotary_emb for one tensor: complex multiply in fp32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(3).type_as(x)


def _repeat(x: torch.Tensor, times: int) -> torch.Tensor:
    """torchtitan's repeat_kv."""
    if times == 1:
        return x
    b, s, g, d = x.shape
    return x[:, :, :, None, :].expand(b, s, g, times, d).reshape(b, s, g * times, d)


class _Block(nn.Module):
    """torchtitan's TransformerBlock (model.py at 9dec370), biases optional (Qwen 2's q, k, v)."""

    def __init__(self, h: int, a: int, g: int, d: int, f: int, bias: bool = False) -> None:
        super().__init__()
        self.a, self.g, self.d = a, g, d
        self.attention_norm, self.ffn_norm = _RMSNorm(h), _RMSNorm(h)
        self.wq = nn.Linear(h, a * d, bias=bias)
        self.wk = nn.Linear(h, g * d, bias=bias)
        self.wv = nn.Linear(h, g * d, bias=bias)
        self.wo = nn.Linear(a * d, h, bias=False)
        self.w1, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        normed = self.attention_norm(x)
        q = self.wq(normed).view(b, s, -1, self.d)
        k = self.wk(normed).view(b, s, -1, self.d)
        v = self.wv(normed).view(b, s, -1, self.d)
        q, k = _rotate(q, rotation), _rotate(k, rotation)
        k, v = _repeat(k, self.a // self.g), _repeat(v, self.a // self.g)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))
        normed = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(normed)) * self.w3(normed))


class _Dispatched(TorchDispatchMode):
    """Records each kernel-launching aten op: its name and the bytes it reads plus writes, each tensor counted at
    its distinct storage (a broadcast view at the size of what it views)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        if outputs and all(t.untyped_storage().data_ptr() in storages for t in outputs):
            return out  # a view: no kernel
        nbytes = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in inputs + outputs)
        self.ops.append((str(func), nbytes))
        return out


def _dispatched(b, s, h, a, g, d, f) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The forward's and the backward's pointwise ops of one bf16 block, as torch dispatches them."""
    torch.manual_seed(0)
    block = _Block(h, a, g, d, f).to(torch.bfloat16)
    rotation = torch.polar(torch.ones(s, d // 2), torch.rand(s, d // 2))[None, :, None, :]
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    recorder = _Dispatched()
    with recorder:
        y = block(x, rotation)
    forward = recorder.ops
    recorder.ops = []
    with recorder:
        y.backward(torch.ones_like(y))

    def pointwise(ops):
        return [op for op in ops if not op[0].startswith(NOT_POINTWISE)]

    return pointwise(forward), pointwise(recorder.ops)


def _inventory(kernels) -> list[int]:
    return [int(k.bytes) for k in kernels if k.kind not in ("gemm", "attention")
            and not k.name.startswith("flash_attention")]


@pytest.mark.parametrize("a, g", [(4, 2), (4, 4)])  # grouped-query (the repeat copies) and multi-head
def test_eager_kernels_are_the_ops_torch_dispatches(a, g):
    b, s, h, d, f = 2, 48, 64, 16, 160
    forward, backward = _dispatched(b, s, h, a, g, d, f)
    shape = LlamaBlockShape(b, s, h, a, g, d, f, 1)
    sim_forward = _inventory(llama_block_kernels(shape, backward=False))
    sim_backward = _inventory(llama_block_kernels(shape, backward=True))
    assert sim_forward == [nbytes for _, nbytes in forward], forward
    assert sim_backward == [nbytes for _, nbytes in backward], backward


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("qk_norm, bias", [(False, False), (True, True)])
def test_compiled_kernels_fuse_only(fp8, qk_norm, bias):
    # Oracle: fusion removes passes over memory and launches, never work: the GEMMs and attention are the same
    # kernels, the memory-bound kernels fewer and lighter.
    shape = LlamaBlockShape(2, 256, 512, 8, 2, 64, 1408, 1, qk_norm=qk_norm, qkv_bias=bias)
    for backward in (False, True):
        eager = llama_block_kernels(shape, backward=backward, narrow=FP8 if fp8 else None)
        compiled = llama_block_kernels(shape, backward=backward, narrow=FP8 if fp8 else None, compiled=True)
        assert [k for k in eager if k.kind in ("gemm", "attention")] == \
            [k for k in compiled if k.kind in ("gemm", "attention")]
        rest_eager = [k for k in eager if k.kind not in ("gemm", "attention")]
        rest_compiled = [k for k in compiled if k.kind not in ("gemm", "attention")]
        assert len(rest_compiled) < len(rest_eager)
        assert sum(k.bytes for k in rest_compiled) < sum(k.bytes for k in rest_eager)


def _policy_saved(bias: bool) -> list[int]:
    """The output widths of the ``aten.mm`` calls torchtitan's per-op policy saves, in forward order, from a real
    ``torch.utils.checkpoint`` run of the block (the policy's rule copied from torchtitan's description: save mm,
    SDPA and max outputs except every second mm)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved: list[int] = []

    def context():
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                counts[mode] += 1
                if counts[mode] % 2 == 1:
                    if mode == "forward":
                        saved.append(args[1].shape[1])
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    h, a, g, d, f, s = 64, 4, 2, 24, 160, 32  # q 96, k and v 48, gate/up 160, o and down 64: widths tell them apart
    block = _Block(h, a, g, d, f, bias=bias)
    rotation = torch.polar(torch.ones(s, d // 2), torch.rand(s, d // 2))[None, :, None, :]
    x = torch.randn(1, s, h, requires_grad=True)
    checkpoint(block, x, rotation, use_reentrant=False, context_fn=context).sum().backward()
    return saved


@pytest.mark.parametrize("bias", [False, True])
def test_selective_policy_saves_what_torch_checkpoint_saves(bias):
    widths = {"wq": 96, "wk": 48, "wv": 48, "wo": 64, "w1": 160, "w3": 160, "w2": 64}
    assert [widths[name] for name in sac_saved_linears(bias)] == _policy_saved(bias)
    assert sac_saved_linears(bias, fp8=True) == ()


def test_selective_recompute_reruns_the_unsaved_gemms():
    # Oracle: the recomputed GEMMs' FLOPs are those of the linears the policy does not keep, down excepted
    # (2·tokens·weights each), and their bytes move into the backward; the forward is unchanged.
    b, s, h, a, g, d, f = 2, 512, 512, 8, 2, 64, 1408
    shape = LlamaBlockShape(b, s, h, a, g, d, f, 1)
    plain = llama_block_kernels(shape, backward=True)
    selective = llama_block_kernels(shape, backward=True, selective_recompute=True)
    again = selective[:len(selective) - len(plain)]
    assert selective[len(again):] == plain and all(k.name.startswith("recompute_") for k in again)
    assert sum(k.flops for k in again if k.kind == "gemm") == b * sac_recompute_flops(DecoderShape(1, h, a, g, d, f,
                                                                                                   100, s))
    assert sum(k.flops for k in again if k.kind == "gemm") == 2 * b * s * (h * g * d + a * d * h + h * f)
    assert not any(k.kind == "attention" for k in again)
    fp8 = llama_block_kernels(shape, backward=True, narrow=FP8, selective_recompute=True)
    fp8_again = [k for k in fp8 if k.name.startswith("recompute_") and k.kind == "gemm"]
    assert [k.name for k in fp8_again] == ["recompute_" + n for n in ("wq", "wk", "wv", "wo", "w1", "w3")]


def test_selective_keeps_less_than_no_recompute():
    shape = DecoderShape(32, 4096, 32, 8, 128, 14336, 128256, 8192)
    s, h, q, kv, f = 8192, 4096, 4096, 1024, 14336
    # output, q, v, gate, down outputs and SDPA's output in bf16, its fp32 log-sum-exp
    assert block_saved_bytes(shape, 1, True) == 2 * s * (h + q + kv + f + h + q) + 4 * s * 32
    assert block_saved_bytes(shape, 1, True) < block_saved_bytes(shape, 1) / 2
    assert block_saved_bytes(shape, 8, True) < block_saved_bytes(shape, 1, True)
