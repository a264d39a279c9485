"""executor.partime.partime_reference: PARTIME's rule against a hand-computed two-stage case, the lag of each stage's
gradient, delayed gradient descent on a constant stream, its step and op counts, and bit-equality with exact online SGD
for one stage."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from executor.nn.optim import SGD
from executor.nn.stages import build_stage, loss_fn
from executor.partime.partime_reference import exact_online_sgd, partime, recomputes_of, steps_of
from executor.partime.video import VideoSpec, frame
from sim.core.errors import SpecError


class Scale(nn.Module):
    """``w * x`` with one float64 scalar weight: a stage whose arithmetic is written out by hand."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))

    def forward(self, x):
        return self.w * x


def _scalar_frames(xs, ys):
    return lambda f: (torch.tensor([xs[f]], dtype=torch.float64), torch.tensor([ys[f]], dtype=torch.float64))


def _sgd(lr):
    return lambda stage: SGD(stage.parameters(), lr=lr)


def _weights(stages):
    return tuple(float(p.detach()) for stage in stages for p in stage.parameters())


def test_two_scalar_stages_three_frames_by_hand():
    # stage 0: h = a x, stage 1: o = b h, loss (o - y)^2, lr 1/4; every value below is a dyadic fraction, so float64
    # holds it exactly and the comparison is ==.
    #   step 0: s0 F(x0): h0 = a0 x0 = 1
    #   step 1: s0 F(x1): h1 = 2.  s1 F+B frame 0: o0 = b0 h0 = 0.5, L0 = 0.25, e0 = 2 (o0 - y0) = -1,
    #           d0 = e0 b0 = -0.5 (to stage 0), b1 = b0 - 1/4 e0 h0 = 0.75
    #   step 2: s0 F(x2): h2 = -1, B of d0 with its *current* input x2: a1 = a0 - 1/4 d0 x2 = 0.875
    #           s1 F+B frame 1: o1 = b1 h1 = 1.5, L1 = 2.25, e1 = 3, d1 = e1 b1 = 2.25, b2 = b1 - 1/4 e1 h1 = -0.75
    #   step 3: s0 R (no frame left): B of d1 with x2: a2 = a1 - 1/4 d1 x2 = 1.4375
    #           s1 F+B frame 2: o2 = b2 h2 = 0.75 (h2 made with a0), L2 = 0.0625, e2 = 0.5, d2 = e2 b2 = -0.375,
    #           b3 = b2 - 1/4 e2 h2 = -0.625
    #   step 4: s0 R: a3 = a2 - 1/4 d2 x2 = 1.34375
    xs, ys = [1.0, 2.0, -1.0], [1.0, 0.0, 0.5]
    stages = [Scale(1.0), Scale(0.5)]
    seen = []
    result = partime(stages, _sgd(0.25), _scalar_frames(xs, ys), 3, F.mse_loss,
                     on_step=lambda t, s: seen.append((t, _weights(s))))
    assert seen == [(0, (1.0, 0.5)), (1, (1.0, 0.75)), (2, (0.875, -0.75)), (3, (1.4375, -0.625)),
                    (4, (1.34375, -0.625))]
    assert result.losses == (0.25, 2.25, 0.0625)
    assert (result.steps, result.forwards, result.backwards, result.recomputes) == (5, (3, 3), (3, 3), (2, 0))
    # exact online SGD applies d0 with frame 0's own input x0 = 1 instead: a1 = 1 - 1/4 (-0.5)(1) = 1.125
    exact = [Scale(1.0), Scale(0.5)]
    exact_seen = []
    exact_online_sgd(exact, _sgd(0.25), _scalar_frames(xs, ys), 1, F.mse_loss,
                     on_step=lambda t, s: exact_seen.append(_weights(s)))
    assert exact_seen == [(1.125, 0.75)]


class Recorder:
    """An optimizer that records each gradient it is given and leaves the weights alone."""

    def __init__(self, stage):
        self.params = list(stage.parameters())
        self.grads = []

    def step(self):
        self.grads.append(tuple(float(p.grad) for p in self.params))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_gradient_at_stage_s_lags_2_n_minus_1_minus_s_frames_behind_its_input(n):
    # unit weights, y = 0: the upstream gradient of frame g is 2 x_g and stage s's weight gradient is that times its
    # current input, frame t - s's x (the last frame's in the drain): 2 x_g x_min(g + 2(N-1-s), T-1)
    T = 7
    xs = [float(f + 2) for f in range(T)]
    recorders = []

    def make(stage):
        recorders.append(Recorder(stage))
        return recorders[-1]

    partime([Scale(1.0) for _ in range(n)], make, _scalar_frames(xs, [0.0] * T), T, F.mse_loss)
    for s, recorder in enumerate(recorders):
        lag = 2 * (n - 1 - s)
        assert recorder.grads == [(2 * xs[g] * xs[min(g + lag, T - 1)],) for g in range(T)]


def _delayed_gradient_descent(w0, eta, delay, steps, c, x, y):
    """w_{n+1} = w_n - eta * dL/dw at w_{max(0, n - delay)} for L(w) = (c w x - y)^2: gradient descent whose n-th
    gradient is taken at the weights of ``delay`` updates before."""
    ws = [w0]
    for n in range(steps):
        stale = ws[max(0, n - delay)]
        ws.append(ws[-1] - eta * 2 * (c * stale * x - y) * c * x)
    return ws


@pytest.mark.parametrize(("n", "k"), [(2, 0), (3, 0), (3, 1), (4, 1), (4, 3)])
def test_a_constant_stream_trains_a_linear_stage_by_gradient_descent_delayed_2_n_minus_1_minus_k(n, k):
    # every frame is (x, y) and only stage k learns (the others have lr 0): its input is always the same, so the
    # current-input approximation is exact and only the stale weights remain. Its n-th update uses the gradient of
    # frame n, whose forward ran before its updates n - D .. n - 1 (D = 2(N-1-k)), and a linear stage's weight
    # gradient does not depend on its own weight: delayed gradient descent, in closed recurrence.
    T, x, y, eta = 12, 0.7, 0.3, 0.2
    others = [1.3, 0.8, 1.1, 0.9]
    stages = [Scale(0.5 if s == k else others[s]) for s in range(n)]
    c = 1.0
    for s in range(n):
        c *= 1.0 if s == k else others[s]
    trained = []
    partime(stages, lambda stage: SGD(stage.parameters(), lr=eta if stage is stages[k] else 0.0),
            _scalar_frames([x] * T, [y] * T), T, F.mse_loss,
            on_step=lambda t, s: trained.append(float(s[k].w.detach())))
    # stage k updates at steps 2(N-1) - k .. T - 1 + 2(N-1) - k: after its update i the weight is ws[i + 1]
    first = 2 * (n - 1) - k
    expected = _delayed_gradient_descent(0.5, eta, 2 * (n - 1 - k), T, c, x, y)
    assert trained[:first] == [0.5] * first
    assert trained[first:first + T] == pytest.approx(expected[1:], rel=1e-12, abs=1e-15)
    assert trained[first + T:] == [trained[first + T - 1]] * k  # the k steps the stages behind it still drain
    undelayed = _delayed_gradient_descent(0.5, eta, 0, T, c, x, y)
    if k < n - 1:  # the delay is visible; the last stage has none (its F and B are of the same frame)
        assert trained[first:first + T] != pytest.approx(undelayed[1:], rel=1e-6)
    else:
        assert trained[first:first + T] == pytest.approx(undelayed[1:], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("T", [1, 2, 6])
def test_steps_and_per_stage_counts(n, T):
    calls = []
    result = partime([Scale(1.0) for _ in range(n)], _sgd(0.01), _scalar_frames([1.0] * T, [0.0] * T), T,
                     F.mse_loss, on_step=lambda t, s: calls.append(t))
    assert result.steps == T + 2 * (n - 1) == steps_of(n, T)
    assert calls == list(range(T + 2 * (n - 1)))
    assert result.forwards == result.backwards == (T,) * n
    # stage s's B steps after its last F (step T-1+s) run to T-1+2(N-1)-s: 2(N-1-s) of them, or T if fewer frames
    assert result.recomputes == tuple(min(T, 2 * (n - 1 - s)) for s in range(n))
    assert result.recomputes == tuple(recomputes_of(n, T, s) for s in range(n))
    assert len(result.losses) == T


SPEC = "cnn:layers=3,features=4,kernel=3,size=8"


def test_one_stage_is_exact_online_sgd_bit_for_bit(one_thread):
    stream = VideoSpec(size=8, features=4, seed=1, drift=0.1, cut_at=4)
    after = {"partime": [], "exact": []}
    runs = {}
    for name, run in (("partime", partime), ("exact", exact_online_sgd)):
        stages = [build_stage(SPEC, 0, 3, seed=2)]
        runs[name] = run(stages, _sgd(0.05), lambda f: frame(stream, f), 8, loss_fn(SPEC),
                         on_step=lambda t, s, name=name: after[name].append(
                             [p.detach().clone() for p in s[0].parameters()]))
    assert runs["partime"].losses == runs["exact"].losses
    assert len(after["partime"]) == len(after["exact"]) == 8
    for mine, theirs in zip(after["partime"], after["exact"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert runs["exact"].losses[0] != runs["exact"].losses[1]  # it learned (and the stream moved)


def test_more_stages_are_not_exact_online_sgd(one_thread):
    # the same layers split in two: exact online SGD does not depend on the split, PARTIME does
    stream = VideoSpec(size=8, features=4, seed=1, drift=0.1)
    exact = exact_online_sgd([build_stage(SPEC, 0, 3, seed=2)], _sgd(0.05), lambda f: frame(stream, f), 6,
                             loss_fn(SPEC))
    split = [build_stage(SPEC, 0, 1, seed=2), build_stage(SPEC, 1, 3, seed=2)]
    exact_split = exact_online_sgd(split, _sgd(0.05), lambda f: frame(stream, f), 6, loss_fn(SPEC))
    assert exact_split.losses == pytest.approx(exact.losses, rel=1e-6)
    split = [build_stage(SPEC, 0, 1, seed=2), build_stage(SPEC, 1, 3, seed=2)]
    piped = partime(split, _sgd(0.05), lambda f: frame(stream, f), 6, loss_fn(SPEC))
    assert piped.losses[0] == pytest.approx(exact.losses[0], rel=1e-6)  # frame 0 sees the initial weights in both
    assert piped.losses[2:] != pytest.approx(exact.losses[2:], rel=1e-6)  # stage 0 learns 2 frames late


def test_no_stage_or_no_frame_is_a_spec_error():
    frames = _scalar_frames([1.0], [0.0])
    with pytest.raises(SpecError, match="at least one stage, got 0"):
        partime([], _sgd(0.1), frames, 1, F.mse_loss)
    with pytest.raises(SpecError, match="num_frames must be an int >= 1, got 0"):
        exact_online_sgd([Scale(1.0)], _sgd(0.1), frames, 0, F.mse_loss)
    with pytest.raises(SpecError, match="num_frames must be an int >= 1, got True"):
        partime([Scale(1.0)], _sgd(0.1), frames, True, F.mse_loss)
