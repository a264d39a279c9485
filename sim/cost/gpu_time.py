"""Seconds of a transformer layer on a GPU, from the kernels it runs: the kernel-level cost model.

A layer's forward or backward on a GPU is not one roofline. It is a sequence of kernels (:mod:`sim.cost.kernels`)
that a host thread issues one after another and the GPU runs in order; at the sizes people train small and
medium models at, the host is often the slower of the two. So the time of a sequence is the finish time of this
recurrence over its kernels k = 1..n (a CPU thread feeding an in-order GPU queue):

    issued_k = issued_(k-1) + host_k                  (the framework's CPU time to issue kernel k)
    done_k   = max(done_(k-1), issued_k) + gpu_k      (the GPU starts k once it is issued and k-1 is done)

which is ``max(Σ host, Σ gpu)`` at the extremes and smooth in between. A kernel's GPU time:

* a GEMM (M × N × K, ``batch`` times; a grouped GEMM, the experts of a mixture, as one launch of products with
  their own M each): its output is cut into ``tile × tile`` tiles (each product's apart), which fill the device's
  compute units in waves, so the work done is ``waves · units · 2 · tile² · (K + k_overhead)`` FLOPs (tile and wave
  quantisation; ``k_overhead`` is the tile's prologue and epilogue in K-steps, the small-K falloff), at
  ``peak_flops · matmul_efficiency`` (the catalog's measured large-GEMM ceiling); or its bytes at the achieved
  memory bandwidth, whichever is longer;
* attention (FlashAttention) the same roofline over its FLOPs and bytes; every other kernel (norms, softmax,
  dropout, GELU, adds, copies, the loss, the optimizer) its bytes at ``memory_bandwidth · memory_efficiency``;
* plus ``kernel_gap_s``, the GPU's own launch latency and tail between two kernels.

Tensor-parallel collectives are costed by :mod:`sim.cost.collectives` on the topology (the engine's TP ops); their
host side, ``host_collective_s`` per NCCL call, is issued inside the layer's sequence here (their device side,
NCCL's protocol latencies, is :mod:`sim.cost.nccl`'s). Each optimizer step pays ``step_overhead_s`` of
framework time (the loss-scale overflow check, gradient clipping's norm, zeroing, bookkeeping), and each microbatch
on each pipeline rank ``microbatch_overhead_s`` (the framework's per-microbatch work: fetching and copying the
batch, the pipeline engine's instructions, gradient-accumulation bookkeeping), added to the rank's forward.

The device numbers come from the catalog only (peak FLOP/s, matmul efficiency, memory bandwidth, compute units),
so the model carries to another GPU; the constants of :class:`KernelModel` describe the software (framework,
cuBLAS, NCCL), not a device, and are fitted on the fit half of the vTrain runs (``profiles/hardware/
kernel_model.yaml`` says how; ``python -m experiments.run vtrain --fit`` refits them). Each layer is a sequence of
its own: the queue a layer leaves behind is not carried into the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache, lru_cache
from importlib.resources import files

from sim.core.errors import SpecError
from sim.cost.context_parallel import KvExchange, exposed_seconds
from sim.cost.kernels.block import layer_step_kernels
from sim.cost.kernels.llama import (
    LLAMA_COLLECTIVE_AFTER,
    LlamaBlockShape,
    llama_block_kernels,
    llama_embedding_kernels,
    llama_head_kernels,
)
from sim.cost.kernels.moe import MOE_COLLECTIVE_AFTER, MoeBlockShape, expert_all_to_alls, moe_block_kernels
from sim.cost.kernels.optimizer import optimizer_kernels
from sim.cost.kernels.record import Kernel, Narrow, gemm
from sim.cost.kernels.vocab import embedding_kernels, head_kernels
from sim.hw.catalog import DeviceSpec, load_yaml
from sim.models.graph import TransformerPart

__all__ = ["KernelModel", "default_kernel_model", "load_kernel_model", "kernel_seconds", "sequence_seconds",
           "transformer_layer_seconds", "optimizer_seconds", "LayerSeconds", "ASYNC_TP_GEMMS", "async_tp_gemm_seconds"]


@dataclass(frozen=True)
class KernelModel:
    """Software constants of the kernel-level GPU cost (units in the names; module docstring for each role).

    Attributes:
        host_issue_s: CPU time the framework spends issuing one kernel, s.
        host_collective_s: CPU time of issuing one NCCL collective, s.
        kernel_gap_s: GPU time between two kernels of a stream, s.
        memory_efficiency: achieved / peak memory bandwidth of memory-bound kernels, in (0, 1].
        gemm_k_overhead: a GEMM tile's prologue and epilogue, in K-steps (elements of K), ≥ 0.
        gemm_tile: edge of a GEMM's output tile, elements.
        step_overhead_s: framework time per optimizer step outside its kernels, s.
        microbatch_overhead_s: framework time per microbatch per pipeline rank outside its kernels, s.
        source: how the figures were obtained.
    """

    host_issue_s: float
    host_collective_s: float
    kernel_gap_s: float
    memory_efficiency: float
    gemm_k_overhead: float
    gemm_tile: int
    step_overhead_s: float
    microbatch_overhead_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "source":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise SpecError(f"kernel model: {item.name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.memory_efficiency <= 1:
            raise SpecError(f"kernel model: memory_efficiency must be in (0, 1], got {self.memory_efficiency!r}")
        if not isinstance(self.gemm_tile, int) or self.gemm_tile < 1:
            raise SpecError(f"kernel model: gemm_tile must be a positive integer, got {self.gemm_tile!r}")


#: Fields of ``kernel_model.yaml``: the dataclass's, with units in the names.
_FIELDS = tuple(item.name for item in fields(KernelModel))


def load_kernel_model(text: str, where: str) -> KernelModel:
    """Parse a kernel-model YAML document (``profiles/hardware/kernel_model.yaml``'s format); SpecError naming
    ``where`` and the field on anything missing, unknown or out of range."""
    data = load_yaml(text)
    if not isinstance(data, dict) or not isinstance(data.get("kernel_model"), dict):
        raise SpecError(f"{where}: expected a top-level 'kernel_model:' mapping")
    entry = data["kernel_model"]
    missing = [name for name in _FIELDS if name not in entry]
    unknown = sorted(set(entry) - set(_FIELDS))
    if missing or unknown:
        raise SpecError(f"{where}: missing field(s) {missing} / unknown field(s) {unknown}")
    try:
        return KernelModel(**{name: (entry[name].strip() if name == "source" else entry[name]) for name in _FIELDS})
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


@cache
def default_kernel_model() -> KernelModel:
    """The built-in constants, ``profiles/hardware/kernel_model.yaml`` (loaded once)."""
    path = files("profiles") / "hardware" / "kernel_model.yaml"
    return load_kernel_model(path.read_text(encoding="utf-8"), str(path))


def kernel_seconds(kernel: Kernel, device: DeviceSpec, model: KernelModel) -> float:
    """GPU time of one kernel on ``device``, s (module docstring), including the gap after it."""
    memory = kernel.bytes / (device.memory_bandwidth * model.memory_efficiency)
    compute = 0.0
    throughput = device.peak_flops * device.matmul_efficiency  # FLOP/s
    if kernel.narrow is not None:  # narrow operands run on their tensor cores, at their measured ceiling
        throughput = (device.fp4_throughput if kernel.narrow.tensor_cores == "fp4" else
                      device.peak_fp8_flops * device.fp8_matmul_efficiency) * kernel.narrow.gemm_share
    if kernel.kind == "gemm" and kernel.gemm is not None:
        m, n, k = kernel.gemm
        units = max(device.compute_units, 1)
        work = []
        for tile_m, tile_n in _tile_shapes(model.gemm_tile):
            if kernel.group:  # a grouped GEMM: each product's rows are cut into tiles of their own
                tiles = sum(math.ceil(rows / tile_m) for rows in kernel.group) * math.ceil(n / tile_n)
            else:
                tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * kernel.batch
            work.append(math.ceil(tiles / units) * units * tile_m * tile_n)
        compute = min(work) * 2.0 * (k + model.gemm_k_overhead) / throughput
    elif kernel.kind == "attention":
        compute = kernel.flops / device.attention_throughput
    return max(compute, memory) + model.kernel_gap_s


def _tile_shapes(tile: int) -> tuple[tuple[int, int], ...]:
    """The output tiles a GEMM library picks among for a shape (cuBLAS's heuristics choose the kernel whose waves
    fill the device best): ``tile × tile``, and the halved and doubled rectangles around it."""
    half = max(tile // 2, 1)
    return ((tile, tile), (2 * tile, tile), (tile, 2 * tile), (tile, half), (half, tile))


def sequence_seconds(steps: list[tuple[float, float]]) -> float:
    """Finish time in s of ``(host s, gpu s)`` steps issued by one thread into one in-order GPU queue."""
    issued = done = 0.0
    for host, gpu in steps:
        issued += host
        done = max(done, issued) + gpu
    return done


@dataclass(frozen=True)
class LayerSeconds:
    """One transformer layer's times for one microbatch on one device, s."""

    fwd: float
    bwd: float


#: Kernels after which a Megatron block calls its tensor-parallel collective (the row-parallel linears' outputs
#: in the forward, the column-parallel linears' input gradients in the backward).
_BLOCK_COLLECTIVE_AFTER = {"attention_output", "mlp_down", "qkv_wgrad", "mlp_up_wgrad"}


def _steps(kernels: tuple[Kernel, ...], device: DeviceSpec, model: KernelModel, tp: int,
           collective_after: set[str] | frozenset[str], extra_collectives: int = 0) -> list[tuple[float, float]]:
    steps = []
    for kernel in kernels:
        steps.append((model.host_issue_s, kernel_seconds(kernel, device, model)))
        if tp > 1 and kernel.name in collective_after:
            steps.append((model.host_collective_s, 0.0))  # the device time is the engine's TP op
    steps.extend([(model.host_collective_s, 0.0)] * (extra_collectives if tp > 1 else 0))
    return steps


@lru_cache(maxsize=4096)  # a model's blocks are identical: cost one, reuse it (every argument is frozen)
def transformer_layer_seconds(part: TransformerPart, microbatch_size: int, device: DeviceSpec,
                              model: KernelModel, *, selective_recompute: bool = False,
                              narrow: Narrow | None = None, compiled: bool = False,
                              kv_exchange: KvExchange | None = None) -> LayerSeconds:
    """Forward and backward time of one transformer layer shard for one microbatch of ``microbatch_size`` on
    ``device`` (full recomputation re-runs the forward as its own op; selective recomputation's work is in the
    backward here: gpt's attention core, or what torchtitan's per-op policy did not keep of a Llama-family block);
    ``narrow``: a Llama- or MoE-family block's linears in that low-precision format (FP8, MXFP8, NVFP4);
    ``compiled``: its blocks under ``torch.compile``;
    ``kv_exchange``: under context parallelism, how the block's attention receives the other ranks' keys and values
    (:mod:`sim.cost.context_parallel`; the time it does not hide under the attention steps is added after them)."""
    b, s, h, a, t = microbatch_size, part.seq, part.hidden, part.heads, part.tp
    sp, vocab = part.sequence_parallel, part.vocab
    if part.family == "moe" and part.part == "block":
        return _moe_block_seconds(part, b, device, model, narrow, compiled, kv_exchange)
    if part.family in ("llama", "moe"):  # the MoE family's ends are a Llama's
        return _llama_layer_seconds(part, b, device, model, narrow, compiled, selective_recompute, kv_exchange)
    if part.part == "block":
        fwd_k, bwd_k = layer_step_kernels(b, s, h, a, t, sequence_parallel=sp,
                                            recompute="selective" if selective_recompute else "none")
        fwd = _steps(fwd_k, device, model, t, _BLOCK_COLLECTIVE_AFTER)
        bwd = _steps(bwd_k, device, model, t, _BLOCK_COLLECTIVE_AFTER)
    elif part.part == "embedding":
        fwd = _steps(embedding_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=False), device, model, t,
                     set(), extra_collectives=1)
        bwd = _steps(embedding_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=True), device, model, t,
                     set())
    else:  # the head: the vocabulary-parallel cross entropy's three all-reduces, the input gradient's one
        fwd = _steps(head_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=False), device, model, t,
                     set(), extra_collectives=3)
        bwd = _steps(head_kernels(b, s, h, vocab, t, sequence_parallel=sp, backward=True), device, model, t,
                     set(), extra_collectives=1)
    return LayerSeconds(sequence_seconds(fwd), sequence_seconds(bwd))


def _llama_layer_seconds(part: TransformerPart, b: int, device: DeviceSpec, model: KernelModel,
                         narrow: Narrow | None, compiled: bool, selective: bool,
                         exchange: KvExchange | None) -> LayerSeconds:
    """:func:`transformer_layer_seconds` of a Llama-family layer shard (:mod:`sim.cost.kernels.llama`); the LM head
    stays in the training dtype under FP8 (torchtitan's converter skips ``output``)."""
    s, h, vocab, t = part.seq // part.cp, part.hidden, part.vocab, part.tp
    if part.part == "block":
        shape = LlamaBlockShape(b, part.seq, h, part.heads, part.kv_heads, part.head_dim, part.ffn, t,
                                qkv_bias=part.qkv_bias, qk_norm=part.qk_norm, window=part.window, cp=part.cp,
                                sequence_parallel=part.sequence_parallel)
        options = dict(narrow=narrow, compiled=compiled)
        forward = llama_block_kernels(shape, backward=False, **options)
        backward = llama_block_kernels(shape, backward=True, selective_recompute=selective, **options)
        fwd = _with_exchange(_steps(forward, device, model, t, LLAMA_COLLECTIVE_AFTER), forward, part, exchange,
                             False, LLAMA_COLLECTIVE_AFTER)
        bwd = _with_exchange(_steps(backward, device, model, t, LLAMA_COLLECTIVE_AFTER), backward, part, exchange,
                             True, LLAMA_COLLECTIVE_AFTER)
    elif part.part == "embedding":
        fwd = _steps(llama_embedding_kernels(b, s, h, vocab, t, backward=False), device, model, t, set(),
                     extra_collectives=1)
        bwd = _steps(llama_embedding_kernels(b, s, h, vocab, t, backward=True), device, model, t, set())
    else:
        sp = part.sequence_parallel
        scored = 1 + part.mtp  # the shared output head scores each multi-token-prediction module's output too
        fwd = _steps(llama_head_kernels(b, s, h, vocab, t, backward=False, sequence_parallel=sp), device, model, t,
                     set(), extra_collectives=3) * scored
        bwd = _steps(llama_head_kernels(b, s, h, vocab, t, backward=True, sequence_parallel=sp), device, model, t,
                     set(), extra_collectives=1) * scored
    return LayerSeconds(sequence_seconds(fwd), sequence_seconds(bwd))


def _moe_block_seconds(part: TransformerPart, b: int, device: DeviceSpec, model: KernelModel, narrow: Narrow | None,
                       compiled: bool, exchange: KvExchange | None) -> LayerSeconds:
    """:func:`transformer_layer_seconds` of a MoE-family block (:mod:`sim.cost.kernels.moe`): its kernels, the host
    calls of its tensor-parallel collectives and of its expert all-to-alls (their device time is the engine's)."""
    t, mla = part.tp, part.mla
    qk = part.head_dim + mla.rope_dim if mla else part.head_dim
    attention = LlamaBlockShape(b, part.seq, part.hidden, part.heads, part.kv_heads, qk, part.ffn, t,
                                qkv_bias=part.qkv_bias, qk_norm=part.qk_norm, window=part.window, cp=part.cp,
                                sequence_parallel=part.sequence_parallel, o_bias=part.o_bias,
                                value_dim=mla.v_dim if mla else 0)
    shape = MoeBlockShape(attention, mla, part.moe, mtp=bool(part.mtp))
    forward = moe_block_kernels(shape, backward=False, narrow=narrow, compiled=compiled)
    backward = moe_block_kernels(shape, backward=True, narrow=narrow, compiled=compiled,
                                 recomputed=part.recomputed)
    exchanges = [(model.host_collective_s, 0.0)] * expert_all_to_alls(part.moe)
    fwd = _with_exchange(_steps(forward, device, model, t, MOE_COLLECTIVE_AFTER), forward, part, exchange, False,
                         MOE_COLLECTIVE_AFTER) + exchanges
    bwd = _with_exchange(_steps(backward, device, model, t, MOE_COLLECTIVE_AFTER), backward, part, exchange, True,
                         MOE_COLLECTIVE_AFTER) + exchanges
    return LayerSeconds(sequence_seconds(fwd), sequence_seconds(bwd))


def _with_exchange(steps: list[tuple[float, float]], kernels: tuple[Kernel, ...], part: TransformerPart,
                   exchange: KvExchange | None, backward: bool,
                   collective_after: frozenset[str]) -> list[tuple[float, float]]:
    """``steps`` (:func:`_steps` of a block's ``kernels``), under context parallelism with the key/value exchange's
    exposed time added on the GPU right after the last attention kernel (:func:`sim.cost.context_parallel.
    exposed_seconds`); unchanged without it."""
    if part.cp == 1:
        return steps
    if exchange is None or exchange.cp != part.cp:
        raise ValueError(f"a block split over cp={part.cp} ranks needs their key/value exchange")
    tp = part.tp

    def position(j: int) -> int:  # _steps puts a host-only step after each kernel that calls a TP collective
        return j + (tp > 1) * sum(k.name in collective_after for k in kernels[:j])

    attention = [j for j, kernel in enumerate(kernels) if kernel.kind == "attention"]
    step_s = [steps[position(j)][1] for j in attention]
    at = position(attention[-1]) + 1
    return steps[:at] + [(0.0, exposed_seconds(exchange, step_s, backward))] + steps[at:]


@lru_cache(maxsize=4096)  # a model's blocks update the same share each: cost it once (every argument is frozen)
def optimizer_seconds(params: float, device: DeviceSpec, model: KernelModel, dtype_bytes: int) -> float:
    """Time of the mixed-precision Adam step's kernels over ``params`` parameters (a layer's, or its ZeRO-1 share),
    s; 0 for none. The step's framework overhead is :attr:`KernelModel.step_overhead_s`, once per stage."""
    count = math.ceil(params)
    if count <= 0:
        return 0.0
    kernels = optimizer_kernels(count, dtype_bytes=dtype_bytes)
    return sequence_seconds([(model.host_issue_s, kernel_seconds(k, device, model)) for k in kernels])


#: The GEMMs a Llama block's tensor-parallel collectives run beside under async TP, per direction, in the order the
#: block calls the collectives under sequence parallelism (all-gather before the column-parallel projections,
#: reduce-scatter after the row-parallel one; the backward the mirror: the gathered output gradient feeds the
#: row-parallel projection's dgrad and wgrad, the column-parallel dgrads' partial sums are reduce-scattered).
ASYNC_TP_GEMMS = {
    False: (("all_gather", ("wq", "wk", "wv")), ("reduce_scatter", ("wo",)),
            ("all_gather", ("w1", "w3")), ("reduce_scatter", ("w2",))),
    True: (("all_gather", ("w2_dgrad", "w2_wgrad")), ("reduce_scatter", ("w3_dgrad", "w1_dgrad")),
           ("all_gather", ("wo_dgrad", "wo_wgrad")), ("reduce_scatter", ("wv_dgrad", "wk_dgrad", "wq_dgrad"))),
}


def async_tp_gemm_seconds(part: TransformerPart, b: int, device: DeviceSpec, model: KernelModel,
                          narrow: Narrow | None, compiled: bool,
                          backward: bool) -> tuple[tuple[str, float, float], ...]:
    """Under async TP, each tensor-parallel collective of a Llama block's forward or ``backward`` with the GPU time
    of the GEMMs it is decomposed with: ``(collective, whole, chunked)``, s, in the block's order
    (:data:`ASYNC_TP_GEMMS`). ``whole``: the GEMMs as the block runs them; ``chunked``: the same GEMMs cut into
    ``tp`` parts along the tokens (the rows of a forward or dgrad GEMM, the reduction of a wgrad), each a kernel of
    its own, so the smaller parts' tile and wave quantisation and launch gaps are this module's kernel model's. Only
    for a ``llama`` block under sequence parallelism."""
    if part.part != "block" or part.family != "llama" or not part.sequence_parallel:
        raise SpecError("async TP is modelled for the llama family's blocks under sequence parallelism")
    shape = LlamaBlockShape(b, part.seq, part.hidden, part.heads, part.kv_heads, part.head_dim, part.ffn, part.tp,
                            qkv_bias=part.qkv_bias, qk_norm=part.qk_norm, window=part.window, cp=part.cp,
                            sequence_parallel=True)
    kernels = llama_block_kernels(shape, backward=backward, narrow=narrow, compiled=compiled)
    t, gap = part.tp, model.kernel_gap_s
    db = 2  # the blocks' training dtype, bf16 (llama_block_kernels' default)
    whole, chunked = {}, {}
    for k in kernels:
        if k.kind != "gemm" or k.gemm is None:
            continue
        m, n, depth = k.gemm
        rows, reduction = (m, -(-depth // t)) if k.name.endswith("_wgrad") else (-(-m // t), depth)
        part_kernel = gemm(k.name, rows, n, reduction, db, narrow=k.narrow)
        whole[k.name] = kernel_seconds(k, device, model) - gap
        chunked[k.name] = t * kernel_seconds(part_kernel, device, model) - gap
    return tuple((name, sum(whole[g] for g in gemms), sum(chunked[g] for g in gemms))
                 for name, gemms in ASYNC_TP_GEMMS[backward])
