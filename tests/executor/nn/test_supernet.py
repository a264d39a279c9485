"""Torch supernet against the sim supernet: candidate counts, shapes, causality, seeding, subnet selection
(executor/nn/supernet.py)."""

from __future__ import annotations

import pytest
import torch

from executor.nn.stages import TORCH_MODELS, boundary_specs, build_layers, build_stage, loss_fn, synthetic_batch
from executor.nn.supernet import ChoiceBlock, Identity, set_subnet
from sim.models import build_model
from sim.models.supernet import KIND_CYCLE, build_supernet

SMALL = "supernet:blocks=4,choices=4,hidden=32,seq=8,vocab=50"
ALL_KINDS = "supernet:blocks=2,choices=16,hidden=32,heads=4,seq=8,vocab=50"  # every kind once per block


pytestmark = pytest.mark.usefixtures("one_thread")


def _whole(spec: str, seed: int = 0):
    return build_stage(spec, 0, len(build_model(spec)), seed=seed)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_supernet_is_a_torch_model():
    assert "supernet" in TORCH_MODELS


@pytest.mark.parametrize("spec", [SMALL, ALL_KINDS, "supernet:blocks=1,choices=20,hidden=24,heads=3,seq=5,vocab=7"])
def test_every_candidate_has_the_sim_parameter_count(spec):
    sn = build_supernet(spec)
    layers = build_layers(spec)
    assert [_count(layer) for layer in layers] == [sn.graph.param_count(i) for i in range(len(sn.graph))]
    for b, cands in enumerate(sn.candidates):
        block = layers[b + 1]
        assert isinstance(block, ChoiceBlock) and block.block == b
        assert [_count(module) for module in block.candidates] == [c.params for c in cands]
        assert block.kinds == tuple(c.kind for c in cands)
    if "choices=16" in spec:
        assert set(layers[1].kinds) == set(KIND_CYCLE)


def test_every_candidate_maps_n_s_h_to_the_graphs_activation_size_and_is_causal():
    """Each kind returns (n, s, h), i.e. activation_bytes / dtype_bytes elements per sample, and position t of the
    output depends only on positions <= t of the input (causal convs and attention, for a next-token LM)."""
    sn = build_supernet(ALL_KINDS)
    block = build_layers(ALL_KINDS, seed=1)[1]
    n, s, h = 3, 8, 32
    x = torch.randn(n, s, h, generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 5:] += 1.0  # perturb positions 5.. only
    with torch.no_grad():
        for k, cand in enumerate(sn.candidates[0]):
            block.choice = k
            y = block(x)
            assert y.shape == (n, s, h) and y.dtype == torch.float32, cand.kind
            assert y.numel() == n * cand.activation_bytes // sn.graph.dtype_bytes
            y2 = block(changed)
            assert torch.equal(y2[:, :5], y[:, :5]), cand.kind  # no look-ahead
            assert not torch.equal(y2[:, 5:], y[:, 5:]), cand.kind


def test_stage_boundaries_and_loss_are_gpts():
    graph = build_model(SMALL)
    specs = boundary_specs(SMALL, list(range(len(graph) + 1)), 2)
    assert specs[0].shape == (2, 8) and specs[0].dtype == torch.int64
    assert all(specs[i].shape == (2, 8, 32) for i in range(1, len(graph)))
    assert specs[len(graph)].shape == (2, 8, 50)
    ids, targets = synthetic_batch(SMALL, 2, seed=0, index=0)
    assert torch.equal(targets[:, :-1], ids[:, 1:])
    with torch.no_grad():
        loss = loss_fn(SMALL)(_whole(SMALL)(ids), targets)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.2


# --- deterministic initialisation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 5])
def test_weights_are_bitwise_identical_whatever_the_split(seed):
    n = len(build_model(ALL_KINDS))
    whole = _whole(ALL_KINDS, seed).state_dict()
    for cuts in ([0, 2, n], [0, 1, 2, 3, n]):
        merged = {}
        for lo, hi in zip(cuts, cuts[1:]):
            merged.update(build_stage(ALL_KINDS, lo, hi, seed=seed).state_dict())
        assert merged.keys() == whole.keys()
        assert all(torch.equal(merged[key], whole[key]) for key in whole), cuts


def test_candidate_weights_do_not_depend_on_how_many_candidates_exist_or_on_the_choice():
    four = _whole(SMALL, 3)
    sixteen = _whole(SMALL.replace("choices=4", "choices=16"), 3)
    state16 = sixteen.state_dict()
    for key, value in four.state_dict().items():
        assert torch.equal(value, state16[key]), key
    set_subnet(four, (3, 2, 1, 0))  # selecting a subnet changes which candidate runs, never a weight
    assert all(torch.equal(v, state16[k]) for k, v in four.state_dict().items())


def test_candidates_and_blocks_get_different_weights():
    state = _whole(ALL_KINDS).state_dict()
    # attn (candidate 1) and attn_few (7) share a shape but not their weights, nor do the same candidate of two blocks
    attn = state["layers.block0.candidates.1.qkv.weight"]
    assert not torch.equal(attn, state["layers.block0.candidates.7.qkv.weight"])
    assert not torch.equal(attn, state["layers.block1.candidates.1.qkv.weight"])
    assert torch.equal(state["layers.block0.candidates.1.ln.weight"], torch.ones(32))


def test_building_never_draws_from_the_global_rng():
    before = torch.random.get_rng_state()
    _whole(SMALL, 2)
    assert torch.equal(torch.random.get_rng_state(), before)


# --- subnet selection ---------------------------------------------------------------------------------------------


def test_set_subnet_selects_the_candidate_and_identity_passes_its_input_through():
    stage = build_stage(SMALL, 1, 5, seed=0)  # the four choice blocks
    blocks = [stage.layers[f"block{b}"] for b in range(4)]
    set_subnet(stage, {0: 3, 1: 3, 2: 3, 3: 3, 9: 1})  # candidate 3 is identity; block 9 is not here: ignored
    assert [b.choice for b in blocks] == [3, 3, 3, 3]
    assert all(isinstance(b.candidates[3], Identity) for b in blocks)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(stage(x), x)
        set_subnet(stage, (0, 1, 2, 0))  # a whole subnet as a sequence
        expected = x
        for b, k in enumerate((0, 1, 2, 0)):
            expected = blocks[b].candidates[k](expected)
        assert torch.equal(stage(x), expected)
    assert [b.choice for b in blocks] == [0, 1, 2, 0]


def test_set_subnet_errors_change_nothing():
    stage = build_stage(SMALL, 1, 3, seed=0)  # block0, block1
    with pytest.raises(KeyError, match=r"block\(s\) \[1\]"):
        set_subnet(stage, {0: 1})
    with pytest.raises(ValueError, match="block 1: choice must be an int in \\[0, 4\\), got 4"):
        set_subnet(stage, {0: 2, 1: 4})
    assert [stage.layers[name].choice for name in ("block0", "block1")] == [0, 0]
    with pytest.raises(ValueError, match="got -1"):
        stage.layers["block0"].choice = -1


def test_training_one_subnet_updates_only_its_candidates():
    model = _whole(SMALL)
    set_subnet(model, (0, 1, 2, 3))
    ids, targets = synthetic_batch(SMALL, 4, seed=0, index=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(SMALL)(model(ids), targets)
        losses.append(loss.item())
        loss.backward()
        if step == 0:
            with_grad = {tuple(name.split(".")[1:4:2]) for name, p in model.named_parameters()
                         if name.startswith("layers.block") and p.grad is not None}
            # (block, candidate) pairs; block3 chose the parameter-free identity
            assert with_grad == {("block0", "0"), ("block1", "1"), ("block2", "2")}
            for b, k in enumerate((0, 1, 2)):
                own = model.layers[f"block{b}"].candidates[k]
                assert all(p.grad is not None and p.grad.any() for p in own.parameters())
        optimizer.step()
    assert losses[0] > losses[1] > losses[2], losses
