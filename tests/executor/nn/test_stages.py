"""Torch stage modules against the LayerGraph: counts, shapes, seeding, splits, training (executor/modules)."""

from __future__ import annotations

import math

import pytest
import torch

from executor.nn.seeds import derive_seed
from executor.nn.stages import TORCH_MODELS, Stage, build_layers, build_stage, loss_fn, synthetic_batch
from sim.core.errors import SpecError
from sim.models import build_model

# Small but not degenerate: several heads, d = h / a of 16..32, vocab not a power of two, an odd kernel of 1, a
# single block, non-square-friendly image sizes.
GPT_SPECS = [
    "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100",
    "gpt:layers=3,hidden=96,heads=3,seq=32,vocab=257",
    "gpt:layers=1,hidden=128,heads=8,seq=8,vocab=500",
]
CNN_SPECS = [
    "cnn:layers=3,features=4,kernel=3,size=8",
    "cnn:layers=3,features=8,kernel=5,size=11",
    "cnn:layers=5,features=2,kernel=1,size=5",
]
ALL_SPECS = GPT_SPECS + CNN_SPECS
SEEDS = [0, 1, 2**40 + 7]


pytestmark = pytest.mark.usefixtures("one_thread")


def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``min(parts, n)`` contiguous, nearly equal, non-empty ranges."""
    parts = min(parts, n)
    cuts = [round(k * n / parts) for k in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


def _merged_state(stages: list[Stage]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        state = stage.state_dict()
        assert not merged.keys() & state.keys()  # stages hold disjoint layers
        merged.update(state)
    return merged


# --- the graph is the oracle: counts and shapes -------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_one_module_per_graph_layer_with_the_graphs_parameter_count(spec):
    graph = build_model(spec)
    layers = build_layers(spec)
    assert len(layers) == len(graph)
    assert [sum(p.numel() for p in layer.parameters()) for layer in layers] == [
        graph.param_count(i) for i in range(len(graph))
    ]
    for layer in layers:
        assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in layer.parameters())
        assert all(torch.isfinite(p).all() for p in layer.parameters())  # every parameter was written


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_output_has_the_graphs_element_count_per_sample(spec):
    """Layer outputs are ``activation_bytes / dtype_bytes`` elements per sample (GPT's graph dtype is fp16, ours
    fp32: the element count is the contract). GPT's head is the exception the graph spells out: its
    ``activation_bytes`` is the 4-byte fp32 loss, which here is ``loss_fn``'s scalar, and its logits are the
    ``workspace_bytes / dtype_bytes = s * V`` elements."""
    graph = build_model(spec)
    n = 3
    inputs, targets = synthetic_batch(spec, n, seed=0, index=0)
    assert inputs.numel() * inputs.element_size() == n * graph.input_bytes  # int64 ids / fp32 frames, as the graph
    x = inputs
    with torch.no_grad():
        for i, layer in enumerate(build_layers(spec)):
            x = layer(x)
            assert x.dtype == torch.float32 and x.shape[0] == n
            per_sample = graph.layers[i]
            if per_sample.kind == "head":
                assert x.numel() == n * per_sample.workspace_bytes // graph.dtype_bytes
                loss = loss_fn(spec)(x, targets)
                assert loss.shape == () and loss.element_size() == per_sample.activation_bytes
            else:
                assert x.numel() == n * per_sample.activation_bytes // graph.dtype_bytes
    # The targets fit the network output: GPT logits (n, s, V) against ids (n, s); CNN maps of the same shape.
    assert (x.shape[:-1] if spec.startswith("gpt") else x.shape) == targets.shape


def test_stage_layers_are_keyed_by_graph_layer_names():
    spec = GPT_SPECS[0]
    stage = build_stage(spec, 1, 4, seed=0)
    assert (stage.spec, stage.start, stage.end) == (build_model(spec).spec, 1, 4)
    assert list(stage.layers) == ["block0", "block1", "head"]


# --- deterministic, split-independent initialisation ----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_parameters_are_bitwise_identical_whatever_the_split(spec, seed):
    n = len(build_model(spec))
    whole = build_stage(spec, 0, n, seed=seed).state_dict()
    for parts in (2, 4):
        if parts == 2:
            stages = [build_stage(spec, 0, 2, seed=seed), build_stage(spec, 2, n, seed=seed)]
        else:
            stages = [build_stage(spec, lo, hi, seed=seed) for lo, hi in _splits(n, parts)]
        merged = _merged_state(stages)
        assert merged.keys() == whole.keys()
        assert all(torch.equal(merged[key], whole[key]) for key in whole), (spec, seed, parts)
    # build_layers uses the same per-layer streams.
    layers = build_layers(spec, seed=seed)
    for i, layer in enumerate(layers):
        name = build_model(spec).layers[i].name
        for key, value in layer.state_dict().items():
            assert torch.equal(value, whole[f"layers.{name}.{key}"])


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_different_seeds_and_different_layers_get_different_weights(spec):
    a, b = (build_stage(spec, 0, len(build_model(spec)), seed=s).state_dict() for s in (0, 1))
    # Matrices and tables are random; LayerNorm (1, 0) and zero biases are the same by design.
    random_keys = [key for key, value in a.items() if value.dim() >= 2]
    assert random_keys and all(not torch.equal(a[key], b[key]) for key in random_keys)
    # The layer index enters the seed: two layers of the same shape differ.
    if "layers.block1.qkv.weight" in a:
        assert not torch.equal(a["layers.block0.qkv.weight"], a["layers.block1.qkv.weight"])
    if "layers.conv2.conv.weight" in a:
        assert not torch.equal(a["layers.conv1.conv.weight"], a["layers.conv2.conv.weight"])


def test_building_never_draws_from_the_global_rng():
    before = torch.random.get_rng_state()
    build_stage(GPT_SPECS[0], 0, 4, seed=3)
    build_layers(CNN_SPECS[0], seed=3)
    synthetic_batch(GPT_SPECS[0], 2, seed=3, index=0)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_gpt_init_follows_gpt2():
    """N(0, 0.02^2) weights, 1/sqrt(2L) on the two residual projections, LayerNorm (1, 0), zero biases."""
    spec = "gpt:layers=8,hidden=128,heads=4,seq=16,vocab=300"
    state = build_stage(spec, 0, 10, seed=0).state_dict()
    assert abs(state["layers.block3.qkv.weight"].std().item() - 0.02) < 0.001
    assert abs(state["layers.block3.down.weight"].std().item() - 0.02 / math.sqrt(16)) < 0.0003
    assert abs(state["layers.embed.token.weight"].std().item() - 0.02) < 0.001
    assert torch.equal(state["layers.head.ln.weight"], torch.ones(128))
    assert torch.equal(state["layers.block3.up.bias"], torch.zeros(512))


def test_cnn_init_is_he_normal():
    state = build_stage("cnn:layers=2,features=32,kernel=5,size=4", 0, 2, seed=0).state_dict()
    weight = state["layers.conv1.conv.weight"]  # fan_in = 32 * 5 * 5 = 800 over 25600 samples
    assert abs(weight.std().item() - math.sqrt(2 / 800)) < 0.002
    assert torch.equal(state["layers.conv1.conv.bias"], torch.zeros(32))


# --- stages compose into the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_stage_after_stage_equals_the_whole_model(spec):
    """Bitwise (torch.equal), not allclose: a split runs the very same CPU kernels on the very same tensors in the
    same order, so any difference at all would be a wrong weight or a skipped layer, never rounding."""
    n = len(build_model(spec))
    inputs, _ = synthetic_batch(spec, 2, seed=5, index=1)
    with torch.no_grad():
        expected = build_stage(spec, 0, n, seed=9)(inputs)
        two = build_stage(spec, 2, n, seed=9)(build_stage(spec, 0, 2, seed=9)(inputs))
        four = inputs
        for lo, hi in _splits(n, 4):
            four = build_stage(spec, lo, hi, seed=9)(four)
    assert torch.equal(two, expected)
    assert torch.equal(four, expected)


# --- synthetic data -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [GPT_SPECS[0], CNN_SPECS[0]])
def test_synthetic_batch_is_a_pure_function_of_seed_and_index(spec):
    x0, y0 = synthetic_batch(spec, 4, seed=1, index=0)
    x0_again, y0_again = synthetic_batch(spec, 4, seed=1, index=0)
    assert torch.equal(x0, x0_again) and torch.equal(y0, y0_again)
    for other in (synthetic_batch(spec, 4, seed=1, index=1), synthetic_batch(spec, 4, seed=2, index=0)):
        assert not torch.equal(x0, other[0]) and not torch.equal(y0, other[1])


def test_gpt_batch_is_token_ids_with_next_token_targets():
    ids, targets = synthetic_batch("gpt:layers=1,hidden=64,heads=4,seq=32,vocab=100", 5, seed=0, index=3)
    assert ids.shape == targets.shape == (5, 32) and ids.dtype == targets.dtype == torch.int64
    assert 0 <= ids.min() and ids.max() < 100 and 0 <= targets.min() and targets.max() < 100
    assert torch.equal(targets[:, :-1], ids[:, 1:])


def test_cnn_batch_is_rgb_frames_and_targets_shaped_like_the_last_output():
    images, targets = synthetic_batch("cnn:layers=2,features=6,kernel=3,size=9", 5, seed=0, index=0)
    assert images.shape == (5, 3, 9, 9) and targets.shape == (5, 6, 9, 9)
    assert images.dtype == targets.dtype == torch.float32
    assert images.min() < 0 < images.max() and 0 <= targets.min() and targets.max() < 1


# --- losses and training ------------------------------------------------------------------------------------------


def test_losses_are_means():
    spec = GPT_SPECS[0]
    logits = torch.zeros(2, 16, 100)  # uniform prediction: cross-entropy ln V at every token
    targets = torch.randint(100, (2, 16), generator=torch.Generator().manual_seed(0))
    assert loss_fn(spec)(logits, targets).item() == pytest.approx(math.log(100), rel=1e-6)
    out, goal = torch.full((2, 4, 8, 8), 3.0), torch.full((2, 4, 8, 8), 1.0)
    assert loss_fn(CNN_SPECS[0])(out, goal).item() == pytest.approx(4.0)


def test_gpt_initial_loss_is_near_uniform_prediction():
    """Small init gives near-uniform logits, so the starting loss is about ln V (checks the head/loss wiring)."""
    spec = GPT_SPECS[1]
    ids, targets = synthetic_batch(spec, 4, seed=0, index=0)
    with torch.no_grad():
        logits = build_stage(spec, 0, 5, seed=0)(ids)
    assert abs(loss_fn(spec)(logits, targets).item() - math.log(257)) < 0.1


@pytest.mark.parametrize("spec, lr", [(GPT_SPECS[0], 0.5), (CNN_SPECS[0], 0.05)])
def test_three_sgd_steps_lower_the_loss_and_every_parameter_gets_a_gradient(spec, lr):
    model = build_stage(spec, 0, len(build_model(spec)), seed=0)
    inputs, targets = synthetic_batch(spec, 4, seed=0, index=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(4):  # three updates, and the loss after the last one
        optimizer.zero_grad()
        loss = loss_fn(spec)(model(inputs), targets)
        losses.append(loss.item())
        if step == 3:
            break
        loss.backward()
        if step == 0:
            no_grad = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
            assert not no_grad, no_grad
        optimizer.step()
    assert losses[0] > losses[1] > losses[2] > losses[3], losses


# --- bad input ----------------------------------------------------------------------------------------------------

BAD_SPECS = [
    ("uniform:layers=2", "'uniform' has no torch implementation"),
    ("resnet:layers=2", "'resnet'"),
    ("gpt:hidden=0", "got 0"),
    ("gpt:hidden=64,heads=5", "heads (5)"),
    ("gpt:layer=2", "layer"),
    ("cnn:kernel=4", "kernel=4"),
    ("cnn:size=big", "'big'"),
]
ENTRY_POINTS = {
    "build_layers": lambda spec: build_layers(spec),
    "build_stage": lambda spec: build_stage(spec, 0, 1, seed=0),
    "synthetic_batch": lambda spec: synthetic_batch(spec, 1, seed=0, index=0),
    "loss_fn": lambda spec: loss_fn(spec),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("spec, fragment", BAD_SPECS)
def test_bad_or_unsupported_specs_raise_spec_error_naming_the_value(spec, fragment, entry):
    with pytest.raises(SpecError) as excinfo:
        ENTRY_POINTS[entry](spec)
    assert fragment in str(excinfo.value)


def test_torch_models_are_the_zoo_minus_uniform():
    assert TORCH_MODELS == ("cnn", "gpt", "llama", "moe", "supernet")


@pytest.mark.parametrize("start, end", [(2, 2), (3, 1), (-1, 2), (0, 5)])
def test_bad_stage_ranges_raise_value_error_naming_them(start, end):
    with pytest.raises(ValueError, match=rf"\[{start}, {end}\).*<= 4"):
        build_stage(GPT_SPECS[0], start, end, seed=0)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"num_samples": 0, "seed": 0, "index": 0}, ValueError, "num_samples must be >= 1, got 0"),
        ({"num_samples": 1, "seed": 0, "index": -1}, ValueError, "index must be >= 0, got -1"),
        ({"num_samples": 1, "seed": 0.5, "index": 0}, TypeError, "seed must be an int, got 0.5"),
        ({"num_samples": True, "seed": 0, "index": 0}, TypeError, "num_samples must be an int, got True"),
    ],
)
def test_bad_batch_arguments_name_the_value(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace(".", r"\.")):
        synthetic_batch(GPT_SPECS[0], **kwargs)


def test_derived_seeds_are_stable_and_separate_purposes():
    # A pinned value: weights and data must not change between runs, processes or Python versions (a salted
    # hash() or an RNG-dependent derivation would break this).
    assert derive_seed("layer", 0, 0) == 8566273251370329530
    assert len({derive_seed(p, s, i) for p in ("layer", "batch") for s in range(4) for i in range(4)}) == 32
