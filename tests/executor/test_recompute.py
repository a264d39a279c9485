"""Per-layer recomputation (``executor.recompute``): the same gradients as plain autograd, one layer alive at a time,
and the R span drawn from the backward's rebuild time."""

import pytest
import torch
from torch import nn

from executor.interpreter import RankInterpreter
from executor.memory import StorageCounter, live_tensors
from executor.nn.optim import make_optimizer
from executor.nn.stages import boundary_specs, build_stage, loss_fn, synthetic_batch
from executor.recompute import checkpointed_forward, rebuild_and_backward
from sim.ir.plan import Op, OpKind
from sim.plan.validate import PlanError
from tests.executor.runs import SPEC
from tests.executor.test_interpreter import _assert_matches_reference, _handbuilt_plan, _run_plan_in_process

WIDTH, LAYERS, ROWS = 64, 4, 32


def _stack(seed: int = 0) -> list[nn.Module]:
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        linear = nn.Linear(WIDTH, 4 * WIDTH)
        down = nn.Linear(4 * WIDTH, WIDTH)
        for p in (*linear.parameters(), *down.parameters()):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
        layers.append(nn.Sequential(linear, nn.GELU(), down))
    return layers


def _no_collectives() -> float:
    return 0.0


@pytest.mark.parametrize("with_head", [False, True])
def test_gradients_equal_plain_autograd_bitwise(with_head):
    # Oracle: one autograd graph over the whole stack, the same inputs and weights.
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad_out = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(2))
    head = (lambda y: (y ** 2).mean()) if with_head else None

    plain = _stack()
    y = x
    for layer in plain:
        y = layer(y)
    torch.autograd.backward(head(y) if head else y, None if head else grad_out)

    rebuilt = _stack()
    leaf = x.detach().requires_grad_(True)
    output, checkpoints = checkpointed_forward(rebuilt, leaf)
    assert not output.requires_grad and len(checkpoints) == LAYERS and checkpoints[0] is leaf
    input_gradient, time_split = rebuild_and_backward(rebuilt, checkpoints, None if head else grad_out, head=head,
                                                      sync=lambda: None, take_collective_seconds=_no_collectives)
    assert checkpoints == [None] * LAYERS  # each checkpoint dropped once its layer's backward is done
    assert torch.equal(input_gradient, x.grad)
    for want, got in zip((p for m in plain for p in m.parameters()), (p for m in rebuilt for p in m.parameters()),
                         strict=True):
        assert torch.equal(got.grad, want.grad)
    assert time_split.rebuild_s > 0 and time_split.rebuild_collective_s == 0 == time_split.backward_collective_s


def _primed_stack() -> list[nn.Module]:
    """The stack with every parameter's gradient already allocated (zeroed in place), so that a backward only
    accumulates into it and what a counter sees on top is activations and transients."""
    layers = _stack()
    y = torch.randn(ROWS, WIDTH)
    for layer in layers:
        y = layer(y)
    y.sum().backward()
    for layer in layers:
        for parameter in layer.parameters():
            parameter.grad.zero_()
    return layers


def _backward_peak(run) -> int:
    """Bytes the most that ``run`` held at once on top of what was alive before it (``executor.memory``)."""
    counter = StorageCounter()
    counter.track(live_tensors())
    before = counter.live_bytes
    with counter:
        run()
    return counter.peak_bytes - before


def test_one_layer_is_rebuilt_at_a_time():
    # Oracle: building the whole stack's graph at once holds every layer's saved activations when its backward
    # starts; each layer keeps at least its linear output and its GELU output (ROWS × 4·WIDTH fp32 each). Rebuilding
    # one layer at a time holds one layer's, so it saves at least (LAYERS − 1) of them, both measured here.
    x, grad_out = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    one_layer = 2 * ROWS * 4 * WIDTH * 4

    layers = _primed_stack()
    _, checkpoints = checkpointed_forward(layers, x)
    per_layer = _backward_peak(lambda: rebuild_and_backward(
        layers, checkpoints, grad_out, sync=lambda: None, take_collective_seconds=_no_collectives))

    whole_layers = _primed_stack()

    def whole() -> None:
        y = x.requires_grad_(True)
        for layer in whole_layers:
            y = layer(y)
        torch.autograd.backward(y, grad_out)

    whole_stage = _backward_peak(whole)
    assert 0 < per_layer <= whole_stage - (LAYERS - 1) * one_layer, (per_layer, whole_stage)


def _forwards_then_rebuilt_backwards(m: int) -> tuple[Op, ...]:
    """One rank's program: m forwards, then each microbatch's R right before its B."""
    program = [Op(OpKind.F, 0, mb) for mb in range(m)]
    for mb in range(m):
        program += [Op(OpKind.R, 0, mb), Op(OpKind.B, 0, mb)]
    return tuple(program)


def test_r_is_drawn_with_the_rebuild_time_right_before_its_backward():
    m = 2
    plan = _handbuilt_plan((_forwards_then_rebuilt_backwards(m),), (((0, 4),), (0,)), m)
    stage = build_stage(SPEC, 0, 4, seed=0)
    interpreter = RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())},
                                  loss_fn(SPEC), {0: boundary_specs(SPEC, [0], 1)[0]})
    batches = [synthetic_batch(SPEC, 1, seed=0, index=j) for j in range(m)]
    records, _ = interpreter.run_iteration([x for x, _ in batches], [y for _, y in batches])
    spans = {r.op.id: r for r in records}
    for mb in range(m):
        recompute, backward = spans[f"0R{mb}"], spans[f"0B{mb}"]
        assert recompute.end > recompute.start  # the rebuild's seconds, not the empty handler's
        assert recompute.end == backward.start and backward.end > backward.start


def test_recompute_on_one_rank_equals_single_process_training():
    m = 3
    plan = _handbuilt_plan((_forwards_then_rebuilt_backwards(m),), (((0, 4),), (0,)), m)
    state, losses = _run_plan_in_process(plan, steps=2)
    _assert_matches_reference(state, losses, 2, m)


def test_an_r_away_from_its_backward_is_refused():
    program = (Op(OpKind.F, 0, 0), Op(OpKind.R, 0, 0), Op(OpKind.F, 0, 1), Op(OpKind.B, 0, 0), Op(OpKind.B, 0, 1))
    plan = _handbuilt_plan((program,), (((0, 4),), (0,)), 2)
    stage = build_stage(SPEC, 0, 4, seed=0)
    with pytest.raises(PlanError, match="0R0 must come right before the backward"):
        RankInterpreter(plan, 0, {0: stage}, {0: make_optimizer("sgd", stage.parameters())}, loss_fn(SPEC), {})
