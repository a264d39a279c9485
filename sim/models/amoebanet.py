"""``amoebanet``: AmoebaNet-D(L, D), the image model of GPipe's scaling tables, one layer per cell, bf16.

GPipe (Huang et al. 2019, Table 2; ../shared/reference/hardware.md §4.3) measures AmoebaNet-D(18, 256): L = 18 normal
cells and D = 256 filters. The cells are those of the public TPU implementation of AmoebaNet (tensorflow/tpu,
``models/official/amoeba_net``: ``model_specs.py`` for the cell, ``model_builder.py`` for the network), read for
their structure:

* stem: a 3 x 3 stride-2 'valid' convolution to 32 filters, then two reduction cells at D/4 and D/2 filters;
* L normal cells in three stacks, a reduction cell (filters doubled, stride 2) before cells ⌊L/3⌋ and ⌊2L/3⌋;
* head: ReLU, global average pooling and a dense layer to ``classes``; the auxiliary head is left out (GPipe's
  throughput tables do not say whether it ran).

A cell of F filters takes the two previous cells' outputs. Its base maps the newer one to F channels (1 x 1
convolution) and the older one too (a 1 x 1 convolution, or when its resolution is twice the newer one's, the
"factorized reduction": two stride-2 1 x 1 convolutions to F/2 each). Then five combinations each add two ops of a
fixed list applied to earlier states; the states no combination used are concatenated as the output. AmoebaNet-D's
normal cell (ops 1x1, max 3x3, none, 1x7+7x1, 1x1, 1x7+7x1, max 3x3, none, avg 3x3, 1x1) leaves four states, so
its output has 4F channels; its reduction cell (max 2x2, max 3x3, none, 3x3, 1x7+7x1, max 3x3, none, max 2x2, avg
3x3, 1x1) leaves three, 3F channels at half the resolution.

The channel plan (normal cells at D, 2D and 4D filters, four F-channel states concatenated) is also that of
kakaobrain/torchgpipe's AmoebaNet-D benchmark, the PyTorch reproduction of GPipe (its stem cells run at D/2 and D
rather than D/4 and D/2). Neither gives GPipe Table 1's parameter counts (82M at (18, 208); this graph has 237M):
GPipe ran Lingvo's implementation, which was not read.

Costs per sample: FLOPs are the convolutions' (2 per multiply-add, 'same' padding counted as data); pooling, batch
normalisation, ReLU, additions and the concatenation are memory-bound and counted as ``elementwise_bytes``, each op
reading its input and writing its output once. Parameters are convolution weights plus two batch-norm parameters
per output channel. A stage boundary after cell i carries cell i's output and cell i − 1's (the next cell reads
both). ``saved_bytes`` is every tensor a cell creates (the inputs of its convolutions, normalisations and
activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.core.spec import SpecParams
from sim.models.graph import Layer, LayerGraph, canonical_spec

__all__ = ["NAME", "DESCRIPTION", "DEFAULTS", "build", "NORMAL_OPS", "REDUCTION_OPS", "cell_costs", "CellCosts"]

NAME = "amoebanet"
DESCRIPTION = "AmoebaNet-D(cells, filters): GPipe's image model, one layer per cell, size x size RGB input, bf16"
DEFAULTS: dict[str, int | float] = {
    "cells": 18,  # GPipe Table 2: AmoebaNet-D(18, 256)
    "filters": 256,
    "size": 224,  # ImageNet crops (GPipe Table 1 trains AmoebaNet on 224 x 224; Table 2 does not say)
    "classes": 1000,
}

DTYPE_BYTES = 2  # bf16 activations on the TPU's matrix units
IN_CHANNELS = 3
STEM_FILTERS = 32  # tensorflow/tpu amoeba_net: stem_reduction_size

# The five combinations of each cell: (left op, left input state, right op, right input state), states 0 and 1 being
# the older and newer cell inputs after the base (tensorflow/tpu model_specs.py, 'amoeba_net_d'), and the states left
# unused, which the output concatenates.
NORMAL_OPS = (("1x1", 1, "max3", 1), ("none", 1, "1x7_7x1", 0), ("1x1", 0, "1x7_7x1", 0), ("max3", 2, "none", 2),
              ("avg3", 1, "1x1", 5))
NORMAL_OUTPUTS = 4  # states 0, 3, 4 and 6
REDUCTION_OPS = (("max2", 0, "max3", 0), ("none", 2, "3x3", 1), ("1x7_7x1", 2, "max3", 2), ("none", 3, "max2", 1),
                 ("avg3", 2, "1x1", 3))
REDUCTION_OUTPUTS = 3  # states 4, 5 and 6

# Convolution ops: (kernel area of each conv, number of convs). Each is ReLU -> conv -> batch norm, twice for the
# factorized 1x7 then 7x1 (with a ReLU between); the pools and "none" have no weights.
_CONV_OPS = {"1x1": (1, 1), "3x3": (9, 1), "1x7_7x1": (7, 2)}
_POOL_OPS = frozenset({"max2", "max3", "avg3"})


@dataclass(frozen=True, slots=True)
class CellCosts:
    """One cell's per-sample costs (see the module docstring for what each counts): FLOPs, parameters, the elements
    it keeps for the backward and those its elementwise ops read and write, and its output's channels and side."""

    flops: int
    params: int
    saved_elements: int
    elementwise_elements: int
    out_channels: int
    out_size: int


def _conv(c_in: int, c_out: int, pixels: int, k2: int = 1) -> tuple[int, int]:
    """FLOPs and parameters (weights + 2 batch-norm parameters per output channel) of a k x k convolution."""
    return 2 * k2 * c_in * c_out * pixels, k2 * c_in * c_out + 2 * c_out


def cell_costs(reduction: bool, filters: int, new: tuple[int, int], old: tuple[int, int]) -> CellCosts:
    """Costs of one AmoebaNet-D cell of ``filters`` (F) channels per sample.

    Args:
        reduction: a reduction cell (stride 2) or a normal one.
        filters: F.
        new: (channels, size) of the newer input (the previous cell's output).
        old: (channels, size) of the older input (the cell before that).
    """
    f = filters
    (c_new, s_new), (c_old, s_old) = new, old
    s_out = math.ceil(s_new / 2) if reduction else s_new
    in_px, out_px = s_new * s_new, s_out * s_out
    flops, params = _conv(c_new, f, in_px)  # base: newer input to F channels
    # ReLU of the input, conv output and BN output are kept; ReLU and BN each read and write their tensor.
    saved_px, ew = (c_new + 2 * f) * in_px, (2 * c_new + 4 * f) * in_px
    if s_old != s_new or c_old != f:
        # The older input to F channels at the newer one's resolution: a 1x1 conv, or where the older input has twice
        # the resolution the factorized reduction, two stride-2 1x1 convs to F/2 each, which cost the same. Its ReLU
        # runs at the older input's own resolution.
        old_px = s_old * s_old
        fl, pa = _conv(c_old, f, in_px)
        flops, params = flops + fl, params + pa
        saved_px += c_old * old_px + 2 * f * in_px
        ew += 2 * c_old * old_px + 4 * f * in_px
    ops = REDUCTION_OPS if reduction else NORMAL_OPS
    for left, i_left, right, i_right in ops:
        for op, state in ((left, i_left), (right, i_right)):
            # Ops on the two original inputs of a reduction cell run with stride 2, from the input resolution to the
            # output one; every later state is already at the output resolution.
            src_px = in_px if state < 2 else out_px
            if op in _CONV_OPS:
                k2, convs = _CONV_OPS[op]
                for _ in range(convs):
                    fl, pa = _conv(f, f, out_px, k2)
                    flops, params = flops + fl, params + pa
                # ReLU of the input (read, write), each conv's output and its batch norm (read, write); a second
                # conv adds the ReLU between the two.
                saved_px += f * src_px + 2 * convs * f * out_px + (convs - 1) * f * out_px
                ew += 2 * f * src_px + 2 * convs * f * out_px + 2 * (convs - 1) * f * out_px
            elif op in _POOL_OPS:
                saved_px += f * out_px
                ew += f * (src_px + out_px)
            elif op != "none":
                raise ValueError(f"unknown AmoebaNet op {op!r}")
        saved_px += f * out_px  # the sum of the two ops
        ew += 3 * f * out_px  # read both, write the sum
    outputs = REDUCTION_OUTPUTS if reduction else NORMAL_OUTPUTS
    ew += 2 * outputs * f * out_px  # the concatenation reads and writes every output state
    saved_px += outputs * f * out_px
    return CellCosts(flops, params, saved_px, ew, outputs * f, s_out)


def build(params: SpecParams) -> LayerGraph:
    """Build ``amoebanet:cells=..,filters=..,size=..,classes=..``.

    Raises:
        SpecError: fewer than 3 cells, filters not a multiple of 8 (the stem cells run at F/4 and the factorized
            reduction halves that), a size below 32 (three stride-2 steps and a valid 3 x 3), or an unknown key.
    """
    values = {key: params.int(key, int(default)) for key, default in DEFAULTS.items()}
    params.finish()
    cells, filters, size, classes = (values[key] for key in ("cells", "filters", "size", "classes"))
    spec = canonical_spec(NAME, values)
    if cells < 3:
        raise SpecError(f"cells must be at least 3 (one per stack), got cells={cells} in {spec!r}")
    if filters < 8 or filters % 8:
        raise SpecError(f"filters must be a positive multiple of 8, got filters={filters} in {spec!r}")
    if size < 32:
        raise SpecError(f"size must be at least 32 pixels, got size={size} in {spec!r}")

    def act(channels: int, side: int) -> int:
        return DTYPE_BYTES * channels * side * side

    stem_side = (size - 3) // 2 + 1
    stem_flops, stem_params = _conv(IN_CHANNELS, STEM_FILTERS, stem_side * stem_side, 9)
    stem_out = (STEM_FILTERS, stem_side)
    layers = [Layer(name="stem", kind="conv", flops_fwd=float(stem_flops), flops_bwd=float(2 * stem_flops),
                    param_bytes=DTYPE_BYTES * stem_params, activation_bytes=act(*stem_out),
                    saved_bytes=2 * act(*stem_out), elementwise_bytes=2 * act(*stem_out))]
    # (name, reduction, filter scale) in order: two stem reduction cells, then the stacks (tensorflow/tpu
    # calc_reduction_layers: reductions before normal cells int(L/3) and int(2L/3)).
    plan = [("stem_cell0", True, 0.25), ("stem_cell1", True, 0.5)]
    scale, reductions = 1.0, (int(cells / 3), int(2 * cells / 3))
    for i in range(cells):
        if i in reductions:
            scale *= 2
            plan.append((f"reduction{reductions.index(i)}", True, scale))
        plan.append((f"cell{i}", False, scale))
    older, newer = stem_out, stem_out
    for name, reduction, cell_scale in plan:
        costs = cell_costs(reduction, int(filters * cell_scale), newer, older)
        out = (costs.out_channels, costs.out_size)
        layers.append(Layer(name=name, kind="reduction_cell" if reduction else "normal_cell",
                            flops_fwd=float(costs.flops), flops_bwd=float(2 * costs.flops),
                            param_bytes=DTYPE_BYTES * costs.params, activation_bytes=act(*out) + act(*newer),
                            saved_bytes=DTYPE_BYTES * costs.saved_elements,
                            elementwise_bytes=DTYPE_BYTES * costs.elementwise_elements))
        older, newer = newer, out
    channels, side = newer
    head_flops = 2 * channels * classes
    layers.append(Layer(name="head", kind="head", flops_fwd=float(head_flops), flops_bwd=float(2 * head_flops),
                        param_bytes=DTYPE_BYTES * (channels * classes + classes),
                        activation_bytes=DTYPE_BYTES * classes, saved_bytes=DTYPE_BYTES * (channels + classes),
                        elementwise_bytes=DTYPE_BYTES * 2 * channels * side * side))
    return LayerGraph(spec, layers, dtype_bytes=DTYPE_BYTES, input_bytes=act(IN_CHANNELS, size))
