"""executor.nn.optim against its oracle, torch.optim: bitwise the same parameters and state after every step, and
no ``torch._dynamo`` import (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from executor.nn.optim import SGD, Adam, make_optimizer
from sim.core.errors import SpecError

REPO = Path(__file__).resolve().parents[3]
SHAPES = [(4, 3), (5,), (), (2, 3, 2)]
STEPS = 6

#: (id, ours, torch's) over the same parameter list: make_optimizer's two (what the executor builds), and the
#: hyper-parameters it does not use (weight decay, momentum, other betas) so that every argument is checked.
CONFIGS = [
    ("adam", lambda ps: make_optimizer("adam", ps), lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False)),
    ("sgd", lambda ps: make_optimizer("sgd", ps), lambda ps: torch.optim.SGD(ps, lr=1e-2, foreach=False)),
    ("adam-decay", lambda ps: Adam(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)),
    ("sgd-momentum-decay", lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)),
]


def _params(seed: int) -> list[torch.Tensor]:
    """Parameters of several shapes, the last a plain leaf tensor like ZeRO-1's flat shard."""
    gen = torch.Generator().manual_seed(seed)
    params: list[torch.Tensor] = [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    params.append(torch.randn(7, generator=gen).requires_grad_(True))
    return params


def _assert_same(ours, theirs, mine: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(mine, reference, strict=True)):
        assert torch.equal(a, b), f"parameter {i}"
        assert (a in ours.state) == (b in theirs.state), f"parameter {i} has state in only one"
        if b in theirs.state:
            sa, sb = ours.state[a], theirs.state[b]
            assert list(sa) == list(sb), f"parameter {i}"
            for name in sb:
                assert sa[name].dtype == sb[name].dtype and sa[name].device == sb[name].device, (i, name)
                assert torch.equal(sa[name], sb[name]), (i, name)


@pytest.mark.parametrize(("build", "reference"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_updates_and_state_are_bitwise_torch_optim(build, reference):
    """Random gradients over 6 steps, a parameter without a gradient now and then (it keeps its value and gets no
    state, as in a csp subnet's step) and a learning rate changed half-way through ``param_groups``."""
    mine, theirs_params = _params(0), _params(0)
    ours, theirs = build(mine), reference(theirs_params)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        if step == STEPS // 2:
            for opt in (ours, theirs):
                opt.param_groups[0]["lr"] *= 0.5
        for i, (a, b) in enumerate(zip(mine, theirs_params, strict=True)):
            if (i + step) % 4 != 3:
                grad = torch.randn(a.shape, generator=gen)
                a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
        _assert_same(ours, theirs, mine, theirs_params)
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in mine)
    assert not any(torch.equal(a, b) for a, b in zip(mine, _params(0), strict=True))  # every parameter moved


def test_zero_grad_in_place_matches_torch():
    mine, theirs_params = _params(2), _params(2)
    ours, theirs = make_optimizer("sgd", mine), torch.optim.SGD(theirs_params, lr=1e-2, foreach=False)
    for a, b in zip(mine, theirs_params, strict=True):
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    ours.zero_grad(set_to_none=False)
    theirs.zero_grad(set_to_none=False)
    for a, b in zip(mine, theirs_params, strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad) and not a.grad.any()


def test_building_and_stepping_does_not_import_dynamo():
    """A fresh interpreter: ours leaves ``torch._dynamo`` unimported; the control, torch.optim.Adam, imports it."""
    script = (
        "import sys, torch\n"
        "from executor.nn.optim import make_optimizer\n"
        "for name in ('adam', 'sgd'):\n"
        "    p = torch.nn.Parameter(torch.ones(3))\n"
        "    opt = make_optimizer(name, [p])\n"
        "    for _ in range(2):\n"
        "        p.grad = torch.ones(3)\n"
        "        opt.step()\n"
        "        opt.zero_grad(set_to_none=True)\n"
        "    assert not torch.equal(p, torch.ones(3))\n"
        "ours = 'torch._dynamo' in sys.modules\n"
        "torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], foreach=False)\n"
        "print(ours, 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("name", ["adamw", "SGD", ""])
def test_unknown_optimizer_is_a_spec_error(name):
    with pytest.raises(SpecError, match="unknown optimizer"):
        make_optimizer(name, _params(0))


@pytest.mark.parametrize("lr", [0, -1e-3, float("inf"), float("nan"), "0.1"])
def test_bad_learning_rate_is_a_spec_error(lr):
    with pytest.raises(SpecError, match="learning rate"):
        make_optimizer("adam", _params(0), lr)


def test_empty_or_non_leaf_parameters_are_rejected_as_torch_does():
    with pytest.raises(ValueError, match="empty parameter list"):
        make_optimizer("adam", [])
    with pytest.raises(ValueError, match="non-leaf"):
        make_optimizer("sgd", [nn.Parameter(torch.ones(2)) * 2])
