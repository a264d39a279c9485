"""The kernels one GPT layer shard really runs: each with its FLOPs, bytes moved and (for GEMMs) its M, N, K.

An inventory, not a cost: :mod:`sim.cost.gpu_time` costs it, kernel by kernel, instead of one roofline for a whole
layer, and so needs to know what a layer launches. The modules here list, for one tensor-parallel rank of a
Megatron-LM GPT model, the forward and backward kernels in execution order, one module per family:

* :mod:`~sim.cost.kernels.record`: the :class:`~sim.cost.kernels.record.Kernel` record, its two builders (a GEMM, a
  memory-bound kernel) and the byte sizes every family shares;
* :mod:`~sim.cost.kernels.elementwise`: LayerNorm, Megatron's fused bias + dropout + residual add, the residual
  gradient's sum;
* :mod:`~sim.cost.kernels.attention`: the attention core, unfused (QKᵀ, softmax, dropout, attention over V) or one
  FlashAttention kernel, and which softmax Megatron runs;
* :mod:`~sim.cost.kernels.block`: a decoder block (its linears and the families above in order), its parameters,
  and what a recompute mode adds to its backward;
* :mod:`~sim.cost.kernels.vocab`: the vocabulary-parallel ends, the input embedding and the head with its cross
  entropy;
* :mod:`~sim.cost.kernels.optimizer`: the mixed-precision Adam step.

Communication (the tensor-parallel all-reduces, or all-gathers and reduce-scatters under sequence parallelism) is
not listed: it is costed by :mod:`sim.cost.collectives`.

Sources:

* Megatron-LM (``megatron/model/transformer.py``, ``ParallelAttention``/``ParallelMLP``/``ParallelTransformerLayer``;
  ``megatron/mpu/layers.py`` for column- and row-parallel linears and the vocab-parallel embedding;
  ``megatron/mpu/cross_entropy.py``; ``megatron/core/tensor_parallel/`` in later versions): a pre-LN block:
  LN → QKV GEMM (column-parallel) → QKᵀ batched GEMM → fused
  scale+causal-mask+softmax (``ScaledUpperTriangMaskedSoftmax``, one kernel, the mask generated not read) → dropout
  → attention over V batched GEMM → output projection GEMM (row-parallel) → fused bias+dropout+residual add → LN →
  MLP up GEMM (column-parallel, 4h) → fused bias+GELU → MLP down GEMM (row-parallel) → bias+dropout+residual add.
  Logits are cast to fp32 before the vocab-parallel cross entropy (``fp16_lm_cross_entropy`` off, the default).
* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21
  (arXiv 2104.04473) §5.1: a block's forward GEMMs are 24·b·s·h² + 4·b·s²·h FLOPs, the logit GEMM 2·b·s·h·V, and
  the backward pass twice the forward.
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198) §4: which
  tensors exist (softmax output and dropout mask of b·a·s², 1-byte dropout masks, LayerNorm and dropout on the
  full b·s·h on every tensor-parallel rank unless sequence parallel splits them by t, §4.2.2) and §5 (selective
  recomputation re-runs QKᵀ, softmax, softmax dropout and attention over V).
* Dao et al., FlashAttention (arXiv 2205.14135) §3 and FlashAttention-2 (arXiv 2307.08691) §3, Algorithms 1-2:
  one fused kernel that never writes the b·a·s² score matrix, keeps a per-row log-sum-exp (fp32) for the backward,
  regenerates the dropout mask from the RNG state and streams K, V once per 128-row query tile (§3.3's block
  sizes); its backward streams Q, dO and an fp32 dQ accumulator once per key tile and recomputes the scores:
  5 matmuls against the forward's 2, 2.5× its FLOPs. HBM traffic is counted as the algorithms state it; the GPU's
  L2 cache may serve some of the re-reads.

Conventions: ``bytes`` counts every tensor a kernel reads plus every tensor it writes, once, in the training dtype
(``dtype_bytes``) unless stated (1-byte dropout masks, fp32 LayerNorm statistics, 8-byte token ids, fp32 loss).
Memory-bound kernels carry an approximate FLOP count (a few operations per element); they are bound by their bytes.
The softmax is Megatron's fused kernel where its conditions hold (:func:`~sim.cost.kernels.attention.
fused_softmax_available`: 16-bit activations, the sequence within the kernel's limit, the attention batches a
multiple of 4); otherwise the five kernels PyTorch runs in its place (an fp32 softmax between casts, a scale and a
mask). FLOPs of attention count the full s×s score matrix, as Megatron's unfused kernels compute it (a causal
FlashAttention skips the tiles above the diagonal; a cost model may halve those).
"""
