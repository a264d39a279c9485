"""The kernel inventory against closed forms from the papers and tensor sizes written from the architecture.

Oracles: Narayanan et al. 2021 §5.1 (forward GEMM FLOPs 24·b·s·h² + 4·b·s²·h per block, 2·b·s·h·V for the logits,
backward twice the forward, full recompute one more forward); Korthikanti et al. 2022 §4 (which tensors each
memory-bound kernel reads and writes, 1-byte dropout masks, what tensor and sequence parallelism split) and §5
(selective recompute re-runs the attention core); FlashAttention (no b·a·s² tensor, backward 2.5× the forward's
FLOPs); GPT-2 small's published per-block parameter count.
"""

import pytest

from sim.core.errors import SpecError
from sim.cost.kernels.attention import fused_softmax_available
from sim.cost.kernels.block import block_kernels, block_parameters, layer_step_kernels
from sim.cost.kernels.optimizer import optimizer_kernels
from sim.cost.kernels.record import KINDS
from sim.cost.kernels.vocab import embedding_kernels, head_kernels

# (b, s, h, a, t): small, GPT-2-like, vTrain-like and GPT-3 175B-like shards
SHAPES = [(1, 128, 64, 4, 1), (2, 1024, 768, 12, 1), (4, 2048, 1024, 16, 2), (1, 2048, 2048, 16, 4),
          (1, 2048, 12288, 96, 8)]


def block(b, s, h, a, t, sp=False, backward=False, db=2, flash=False):
    return block_kernels(b, s, h, a, t, sequence_parallel=sp, backward=backward, dtype_bytes=db, flash=flash)


def gemm_flops(kernels):
    return sum(k.flops for k in kernels if k.kind == "gemm")


def by_name(kernels):
    named = {k.name: k for k in kernels}
    assert len(named) == len(kernels), "kernel names are unique within a pass"
    return named


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("b, s, h, a, t", SHAPES)
def test_block_gemm_flops_are_narayanans_closed_form_and_backward_is_twice(b, s, h, a, t, sp):
    forward = (24 * b * s * h * h + 4 * b * s * s * h) / t
    assert gemm_flops(block(b, s, h, a, t, sp)) == forward
    assert gemm_flops(block(b, s, h, a, t, sp, backward=True)) == 2 * forward
    # flash: the attention core's FLOPs move into one kernel, the backward recomputes the scores (5 matmuls vs 2)
    flash_fwd, flash_bwd = block(b, s, h, a, t, sp, flash=True), block(b, s, h, a, t, sp, backward=True, flash=True)
    attention = 4 * b * s * s * h / t
    assert sum(k.flops for k in flash_fwd if k.kind == "attention") == attention
    assert gemm_flops(flash_fwd) == forward - attention
    assert sum(k.flops for k in flash_bwd if k.kind == "attention") == 2.5 * attention
    assert gemm_flops(flash_bwd) == 2 * (forward - attention)


@pytest.mark.parametrize("b, s, h, a, t", SHAPES)
def test_every_gemm_shape_multiplies_back_to_its_flops_and_moves_at_least_its_operands(b, s, h, a, t):
    for backward in (False, True):
        gemms = [k for k in block(b, s, h, a, t, backward=backward) if k.gemm is not None]
        assert gemms and all(k.kind == "gemm" for k in gemms)
        for k in gemms:
            m, n, kk = k.gemm
            assert k.flops == 2 * k.batch * m * n * kk, k.name
            assert k.bytes >= 2 * k.batch * (m * kk + kk * n + m * n), k.name


def test_forward_gemm_shapes_are_megatrons_column_and_row_parallel_linears():
    b, s, h, a, t = 2, 512, 1024, 16, 4
    tokens, d = b * s, h // a
    shapes = {k.name: (k.gemm, k.batch) for k in block(b, s, h, a, t) if k.kind == "gemm"}
    assert shapes == {
        "qkv": ((tokens, 3 * h // t, h), 1),  # column-parallel: output split
        "attention_scores": ((s, s, d), b * a // t),  # Q·Kᵀ per local head
        "attention_over_values": ((s, d, s), b * a // t),
        "attention_output": ((tokens, h, h // t), 1),  # row-parallel: input split
        "mlp_up": ((tokens, 4 * h // t, h), 1),
        "mlp_down": ((tokens, h, 4 * h // t), 1),
    }
    nbytes = {k.name: k.bytes for k in block(b, s, h, a, t) if k.kind == "gemm"}
    # reads X and W, writes Y (2 bytes each); only the QKV GEMM adds its bias, the others skip it (Megatron's
    # skip_bias_add) for the fused bias+GELU and bias+dropout+add kernels
    assert nbytes["qkv"] == 2 * (tokens * h + h * 3 * h // t + tokens * 3 * h // t + 3 * h // t)
    assert nbytes["mlp_up"] == 2 * (tokens * h + h * 4 * h // t + tokens * 4 * h // t)
    assert nbytes["attention_scores"] == 2 * (b * a // t) * (s * d + d * s + s * s)
    backward = {k.name: k.gemm for k in block(b, s, h, a, t, backward=True) if k.kind == "gemm"}
    for name in ("qkv", "attention_output", "mlp_up", "mlp_down"):
        m, n, kk = shapes[name][0]  # Y[M×N] = X[M×K]·W[K×N]
        assert backward[name + "_dgrad"] == (m, kk, n)  # dX = dY·Wᵀ
        assert backward[name + "_wgrad"] == (kk, n, m)  # dW = Xᵀ·dY


def test_forward_runs_megatrons_pre_ln_block_in_order_and_backward_reverses_it():
    kinds = [k.kind for k in block(2, 256, 256, 4, 2)]
    assert kinds == ["norm", "gemm", "gemm", "softmax", "dropout", "gemm", "elementwise", "gemm", "dropout", "norm",
                     "gemm", "elementwise", "gemm", "dropout"]  # the elementwise after P·V: the context permute copy
    forward = [k.name for k in block(2, 256, 256, 4, 2)]
    stems = []
    for k in block(2, 256, 256, 4, 2, backward=True):
        stem = k.name.removesuffix("_bwd")
        for suffix in ("_dgrad", "_wgrad", "_bias_grad", "_vgrad", "_qgrad", "_kgrad"):
            stem = stem.removesuffix(suffix)
        if stem in forward and stem not in stems:
            stems.append(stem)
    assert stems == forward[::-1]
    assert all(k.kind in KINDS for k in block(2, 256, 256, 4, 2, backward=True))


@pytest.mark.parametrize("sp", [False, True])
def test_memory_bound_kernels_move_the_tensors_they_touch(sp):
    b, s, h, a, t, db = 2, 256, 512, 8, 4, 2
    bsh = b * s * h // (t if sp else 1)  # LayerNorm and dropout tensors: split only under sequence parallelism
    rows = b * s // (t if sp else 1)
    scores = b * (a // t) * s * s  # this rank's heads' score matrix
    ffn = b * s * 4 * h // t
    fwd, bwd = by_name(block(b, s, h, a, t, sp)), by_name(block(b, s, h, a, t, sp, backward=True))
    # LayerNorm: reads x, γ, β; writes y and fp32 mean and 1/σ per row. Backward reads dy, x, γ and the statistics;
    # writes dx, dγ, dβ
    assert fwd["input_layernorm"].bytes == (2 * bsh + 2 * h) * db + 2 * rows * 4
    assert bwd["input_layernorm_bwd"].bytes == (3 * bsh + 3 * h) * db + 2 * rows * 4
    # softmax reads the scores and writes the probabilities; backward reads dY and Y, writes dX
    assert fwd["scale_mask_softmax"].bytes == 2 * scores * db
    assert bwd["scale_mask_softmax_bwd"].bytes == 3 * scores * db
    # attention dropout reads and writes b·a·s² values and writes a 1-byte mask; backward reads dY and the mask
    assert fwd["attention_dropout"].bytes == 2 * scores * db + scores
    assert bwd["attention_dropout_bwd"].bytes == 2 * scores * db + scores
    # bias + dropout + residual add: reads x, residual and the bias, writes the sum and the mask
    assert fwd["mlp_dropout_add"].bytes == (3 * bsh + h) * db + bsh
    assert bwd["mlp_dropout_add_bwd"].bytes == 2 * bsh * db + bsh
    # bias + GELU on the 4h/t split: reads the GEMM output and the bias, writes the activation; backward reads dY and
    # the saved input, writes dX
    assert fwd["bias_gelu"].bytes == (2 * ffn + 4 * h // t) * db
    assert bwd["bias_gelu_bwd"].bytes == 3 * ffn * db
    assert bwd["mlp_down_bias_grad"].bytes == (b * s * h + h) * db  # row-parallel bias: whole output, every rank
    assert bwd["mlp_up_bias_grad"].bytes == (ffn + 4 * h // t) * db


def test_tensor_parallelism_splits_what_megatron_splits():
    b, s, h, a = 2, 512, 1024, 16
    one, four = by_name(block(b, s, h, a, 1)), by_name(block(b, s, h, a, 4))
    four_sp = by_name(block(b, s, h, a, 4, sp=True))
    for name in ("qkv", "attention_scores", "attention_over_values", "attention_output", "mlp_up", "mlp_down",
                 "scale_mask_softmax", "attention_dropout", "bias_gelu"):
        assert four[name].flops * 4 == one[name].flops, name
    for name in ("scale_mask_softmax", "attention_dropout"):
        assert four[name].bytes * 4 == one[name].bytes, name
    for name in ("input_layernorm", "post_attention_layernorm", "attention_dropout_add", "mlp_dropout_add"):
        assert four[name] == one[name], name  # replicated on every rank without sequence parallelism
        assert four_sp[name].flops * 4 == one[name].flops, name
        assert four_sp[name].bytes < one[name].bytes / 3.9, name  # /t up to the unsplit γ, β and bias
    assert four_sp["qkv"] == four["qkv"]  # the GEMMs see the whole sequence after the all-gather


def test_flash_attention_never_holds_the_score_matrix():
    b, s, h, a, t, db = 1, 8192, 1024, 16, 1, 2
    scores_bytes = b * a * s * s * db
    qkv, rows = b * s * h // t, b * a // t * s  # elements of Q (or K, V, O); query rows of all local heads
    tiles = s // 128  # FlashAttention-2's 128-row tiles
    for backward in (False, True):
        kernels = block(b, s, h, a, t, backward=backward, flash=True)
        assert not [k for k in kernels if k.kind in ("softmax", "gemm") and k.batch > 1]
        assert not [k for k in kernels if "attention_dropout" in k.name and "add" not in k.name]  # in the kernel
        assert max(k.bytes for k in kernels if k.kind != "attention") < scores_bytes / 10
        (core,) = [k for k in kernels if k.kind == "attention"]
        named = by_name(kernels)
        assert named["flash_qkv_transpose" + "_bwd" * backward].bytes == 2 * 3 * qkv * db  # Megatron's layout copy
        if not backward:
            # Algorithm 1: Q read once, K and V once per query tile, O written once, fp32 log-sum-exp per row
            assert core.bytes == (2 + 2 * tiles) * qkv * db + rows * 4
        else:
            # Algorithm 2: K, V read and dK, dV written once; per key tile Q and dO read, the fp32 dQ accumulator
            # read and written, L and D read
            assert core.bytes == 4 * qkv * db + tiles * (2 * qkv * db + 2 * qkv * 4 + 2 * rows * 4)
            assert named["flash_attention_bwd_preprocess"].bytes == 2 * qkv * db + rows * 4  # D = rowsum(dO ⊙ O)
            assert named["flash_attention_dq_convert"].bytes == qkv * (4 + db)
    # a score tensor of b·a·s² would grow 4× with twice the sequence; the flash kernel's traffic does too (tiles
    # re-read), but every other kernel only 2×
    short = block(b, s // 2, h, a, t, flash=True)
    for k, k2 in zip(short, block(b, s, h, a, t, flash=True)):
        if k.kind != "attention" and k.kind != "gemm":
            assert k2.bytes <= 2 * k.bytes, k.name


@pytest.mark.parametrize("flash", [False, True])
def test_recompute_modes_add_what_they_rerun(flash):
    b, s, h, a, t = 2, 1024, 1024, 16, 2
    forward = (24 * b * s * h * h + 4 * b * s * s * h) / t
    attention = 4 * b * s * s * h / t

    def flops(kernels):
        return sum(k.flops for k in kernels if k.kind in ("gemm", "attention"))

    base_bwd = flops(block(b, s, h, a, t, backward=True, flash=flash))
    for mode, extra in (("none", 0), ("full", forward), ("selective", 0 if flash else attention)):
        fwd, bwd = layer_step_kernels(b, s, h, a, t, sequence_parallel=False, recompute=mode, flash=flash)
        assert flops(fwd) == forward
        assert flops(bwd) == base_bwd + extra, mode
    _, full = layer_step_kernels(b, s, h, a, t, sequence_parallel=False, recompute="full")
    assert gemm_flops(full) == 3 * forward  # Narayanan §5.1: with recompute, 4× the forward per iteration in all
    with pytest.raises(SpecError, match="'some'"):
        layer_step_kernels(b, s, h, a, t, sequence_parallel=False, recompute="some")


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [1, 2, 8])
def test_head_logits_are_2bshv_over_t_and_the_loss_reads_fp32_logits(t, sp):
    b, s, h, vocab, db = 2, 1024, 1024, 51200, 2
    fwd = by_name(head_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=False))
    bwd = by_name(head_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=True))
    assert fwd["logits"].gemm == (b * s, vocab // t, h)
    assert fwd["logits"].flops == 2 * b * s * h * vocab / t
    assert gemm_flops(bwd.values()) == 2 * fwd["logits"].flops
    assert bwd["logits_wgrad"].gemm == (vocab // t, h, b * s)  # the tied embedding table's gradient
    logits = b * s * vocab // t
    assert fwd["logits_to_fp32"].bytes == logits * (db + 4)
    # fp32 passes over this rank's logits: max (read), subtract (read, write), exp (read, write), sum (read),
    # normalise (read, write); the per-token terms are far smaller
    loss = [k for k in fwd.values() if k.kind == "loss"]
    assert sum(k.bytes for k in loss if "target" not in k.name) == 8 * logits * 4
    assert sum(k.bytes for k in loss if "target" in k.name) < logits / 100
    assert sum(k.bytes for k in bwd.values() if k.kind == "loss" and "target" not in k.name) == 2 * logits * 4
    rows = b * s // (t if sp else 1)
    assert fwd["final_layernorm"].bytes == (2 * rows * h + 2 * h) * db + 2 * rows * 4


def test_embedding_is_vocab_parallel_and_its_dropout_follows_sequence_parallelism():
    b, s, h, vocab, t, db = 2, 512, 1024, 51200, 4, 2
    bsh = b * s * h
    plain = by_name(embedding_kernels(b, s, h, vocab, t, sequence_parallel=False, backward=False))
    sp = by_name(embedding_kernels(b, s, h, vocab, t, sequence_parallel=True, backward=False))
    assert list(plain) == ["word_embedding_lookup", "word_embedding_mask", "position_embedding_lookup",
                           "embedding_add", "embedding_transpose", "embedding_dropout"]
    # every rank looks up every token (reads the ids and the rows, writes b·s·h), then zeroes the 3/4 it does not own
    assert plain["word_embedding_lookup"].bytes == b * s * 8 + 2 * bsh * db
    assert plain["word_embedding_mask"].bytes == b * s + bsh * 3 // 4 * db
    assert plain["embedding_add"].bytes == 3 * bsh * db
    assert plain["word_embedding_lookup"] == sp["word_embedding_lookup"]
    assert plain["embedding_dropout"].bytes == 2 * bsh * db + bsh
    assert sp["embedding_dropout"].bytes * t == plain["embedding_dropout"].bytes
    one = embedding_kernels(b, s, h, vocab, 1, sequence_parallel=False, backward=False)
    assert "word_embedding_mask" not in by_name(one)  # one rank owns the whole vocabulary
    bwd = by_name(embedding_kernels(b, s, h, vocab, t, sequence_parallel=False, backward=True))
    # dense vocab/t × h gradient zeroed and scatter-added: reads ids and dY, writes and updates the local table
    assert bwd["word_embedding_grad"].bytes == b * s * 8 + (bsh + 2 * vocab // t * h) * db
    assert bwd["embedding_dropout_bwd"].bytes == plain["embedding_dropout"].bytes
    assert not [k for k in bwd.values() if k.kind == "gemm"]


def test_block_parameters_match_gpt2_and_split_across_ranks():
    assert block_parameters(768, 1) == 7_087_872  # GPT-2 small: 85,054,464 parameters in its 12 blocks
    for h, t in ((1024, 2), (12288, 8)):
        # weights and column-parallel biases split; row-parallel biases and LayerNorms repeat on every rank
        assert t * block_parameters(h, t) == 12 * h * h + 7 * h + t * 6 * h


def test_optimizer_step_moves_the_mixed_precision_adam_states():
    n = 1000
    fp16 = optimizer_kernels(n, dtype_bytes=2)
    assert [k.kind for k in fp16] == ["optimizer"] * 3
    # unscale (fp32 grad read + written) + Adam (grad, master, m, v read; master, m, v written) + master → fp16 copy
    assert sum(k.bytes for k in fp16) == n * (8 + 28 + 6)
    assert sum(k.bytes for k in optimizer_kernels(n, dtype_bytes=2, loss_scaling=False)) == n * (28 + 6)
    assert sum(k.bytes for k in optimizer_kernels(n, dtype_bytes=4)) == n * 28


@pytest.mark.parametrize("call, value", [
    (lambda: block(1, 128, 100, 3, 1), "100"),  # h not divisible by heads
    (lambda: block(1, 128, 96, 6, 4), "6"),  # heads not divisible by t
    (lambda: block(1, 130, 96, 4, 4, sp=True), "130"),  # sequence not divisible by t under SP
    (lambda: block(0, 128, 96, 4, 1), "0"),
    (lambda: block(1, 128, 96, 4, 1, db=1.5), "1.5"),
    (lambda: head_kernels(1, 128, 96, 50257, 2, sequence_parallel=False, backward=False), "50257"),
    (lambda: embedding_kernels(1, 128, -96, 512, 2, sequence_parallel=False, backward=False), "-96"),
    (lambda: block_parameters(100, 3), "100"),
    (lambda: optimizer_kernels(0), "0"),
])
def test_bad_shapes_are_refused_with_the_offending_value(call, value):
    with pytest.raises(SpecError, match=value.replace(".", r"\.")):
        call()


def test_fused_softmax_follows_megatrons_availability_rule():
    # 16 heads at s = 1024: a block of 128 threads takes 4 rows (warps of 32 lanes, one row each), so b·heads must be
    # a multiple of 4: every tensor-parallel degree up to 4 qualifies at b = 1, t = 8 (2 heads per rank) only from b = 2
    assert [fused_softmax_available(1, 16 // t, 1024) for t in (1, 2, 4, 8)] == [True, True, True, False]
    assert fused_softmax_available(2, 2, 1024)
    # short rows: s = 64 rounds to 64 lanes → warps of 32 lanes taking 2 rows each, 8 rows per block
    assert not fused_softmax_available(1, 4, 64) and fused_softmax_available(2, 4, 64)
    assert not fused_softmax_available(4, 4, 1024, dtype_bytes=4)  # fp32 input
    assert not fused_softmax_available(4, 4, 16) and not fused_softmax_available(4, 4, 8192)  # outside 16 < s ≤ 4096
    assert not fused_softmax_available(4, 4, 1022)  # s not a multiple of 4


def test_unfused_softmax_runs_five_fp32_kernels_each_way_over_the_same_scores():
    b, s, h, a, t = 1, 1024, 1024, 16, 8  # 2 attention batches: unfused
    scores = b * (a // t) * s * s
    forward = [k for k in block(b, s, h, a, t) if k.name.startswith("softmax_")]
    backward = [k for k in block(b, s, h, a, t, backward=True) if k.name.startswith("softmax_")]
    assert [k.name for k in forward] == ["softmax_cast_fp32", "softmax_scale", "softmax_mask_fill", "softmax_fp32",
                                         "softmax_cast_half"]
    assert [k.name.removesuffix("_bwd") for k in backward] == [k.name for k in forward][::-1]
    # bytes: casts move 2 + 4 per score, the fp32 passes 8 (12 for the softmax backward), the mask s² once per pass
    assert sum(k.bytes for k in forward) == scores * (6 + 8 + 8 + 8 + 6) + s * s
    assert sum(k.bytes for k in backward) == scores * (6 + 12 + 8 + 8 + 6) + s * s
    fused = [k for k in block(2, s, h, a, t) if "softmax" in k.name]
    assert [k.name for k in fused] == ["scale_mask_softmax"]
