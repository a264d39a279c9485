"""Boundary shapes without a forward pass, and a stage build that stays off torch's slow paths
(executor/nn/stages.py: ``boundary_specs``, ``_build_layer``)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.nn import stages
from executor.nn.stages import _SkipInitialisers, boundary_specs, build_layers, synthetic_batch

ROOT = Path(__file__).resolve().parents[3]
SPECS = [
    "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100",
    "gpt:layers=1,hidden=128,heads=8,seq=8,vocab=500",
    "cnn:layers=3,features=8,kernel=5,size=11",
    "cnn:layers=5,features=2,kernel=1,size=5",
    "supernet:blocks=2,choices=16,hidden=32,heads=4,seq=8,vocab=50",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("spec", SPECS)
def test_boundary_specs_are_what_a_real_forward_pass_produces(spec):
    """The oracle is the modules' own forward on the CPU: the tensor entering every layer, and the output."""
    n = 3
    x, _ = synthetic_batch(spec, n, seed=0, index=0)
    seen = [(tuple(x.shape), x.dtype)]
    with torch.no_grad():
        for layer in build_layers(spec):
            x = layer(x)
            seen.append((tuple(x.shape), x.dtype))
    specs = boundary_specs(spec, list(range(len(seen))), n)
    assert [(specs[cut].shape, specs[cut].dtype) for cut in range(len(seen))] == seen


def test_boundary_specs_answer_only_the_cuts_asked_and_scale_with_the_microbatch():
    spec = SPECS[0]
    assert boundary_specs(spec, [], 1) == {}
    one, five = boundary_specs(spec, [2, 0], 1), boundary_specs(spec, [2, 0], 5)
    assert sorted(one) == [0, 2]
    assert (one[0].shape, one[2].shape, five[2].shape) == ((1, 16), (1, 16, 64), (5, 16, 64))
    assert five[2].nbytes == 5 * 16 * 64 * 4 and five[0].nbytes == 5 * 16 * 8  # fp32 states, int64 token ids


@pytest.mark.parametrize("cut", [-1, 5])
def test_a_cut_outside_the_graph_is_a_value_error_naming_it(cut):
    with pytest.raises(ValueError, match=rf"cut {cut} outside \[0, 4\]"):
        boundary_specs(SPECS[0], [cut], 1)


def test_a_shape_that_disagrees_with_the_graph_is_caught(monkeypatch):
    """The per-model shape rule is checked against the graph's bytes, so a drifted rule fails loudly."""
    gpt = stages._MODELS["gpt"]
    monkeypatch.setitem(stages._MODELS, "gpt", dataclasses.replace(gpt, hidden_shape=lambda values: (1, 2)))
    with pytest.raises(RuntimeError, match=r"boundary 1 of .*shape \(1, 2\) is 4 bytes .* graph says 2048"):
        boundary_specs(SPECS[0], [1], 1)
    assert boundary_specs(SPECS[0], [0, 4], 1)[4].shape == (1, 16, 100)  # cuts not using the rule still answer


def test_the_default_initialisers_of_the_zoos_torch_layers_are_skipped_while_building():
    """Linear, Embedding and Conv2d draw their default init through torch.nn.init's ``kaiming_uniform_``,
    ``uniform_`` and ``normal_``, which dispatch to the mode: skipped, so they draw nothing from the global RNG
    (without this the build would draw every default init for nothing, under fork_rng)."""
    tensor = torch.full((4, 4), 7.0)
    before = torch.random.get_rng_state()
    with _SkipInitialisers():
        torch.nn.init.normal_(tensor)
        torch.nn.init.uniform_(tensor=tensor)
        torch.nn.init.kaiming_uniform_(tensor)
        layers = [torch.nn.Linear(8, 8), torch.nn.Embedding(10, 4), torch.nn.Conv2d(3, 4, 3)]
        added = tensor.add(1.0)  # other ops run as usual
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(tensor, torch.full((4, 4), 7.0)) and torch.equal(added, torch.full((4, 4), 8.0))
    assert all(p.shape for layer in layers for p in layer.parameters())


_PROBE = """
import sys
from executor.nn.stages import boundary_specs, build_stage, loss_fn, synthetic_batch
from sim.models import build_model
for spec in sys.argv[1:]:
    n = len(build_model(spec))
    stage = build_stage(spec, 0, n, seed=1)
    specs = boundary_specs(spec, list(range(n + 1)), 2)
    x, y = synthetic_batch(spec, 2, seed=0, index=0)
    loss_fn(spec)(stage(x), y).backward()
print("torch._dynamo" in sys.modules)
import torch
torch.empty(2, device="meta").normal_()  # the control: a meta-device op, as the stages were once built
print("torch._dynamo" in sys.modules)
"""


def test_building_a_stage_never_imports_torch_dynamo():
    """A worker's stage build, boundary shapes and a training step's forward and backward stay off the ``meta``
    device, whose Python kernels import ``torch._dynamo`` (1.5-2 s of every worker's start). Fresh process, so that
    nothing else imported it first; the control shows this torch still imports it from a meta op, i.e. that the
    check can fail."""
    models = ["gpt:layers=2,hidden=32,heads=2,seq=8,vocab=50", "cnn:layers=2,features=4,kernel=3,size=6",
              "supernet:blocks=2,choices=4,hidden=32,heads=4,seq=8,vocab=50"]
    done = subprocess.run([sys.executable, "-c", _PROBE, *models], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"], done.stdout
