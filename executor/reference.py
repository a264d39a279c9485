"""Single-process training of the same model on the same data: the oracle a pipeline run must reproduce.

A synchronous pipeline (GPipe, 1F1B with a flush) is only a reordering of the arithmetic of plain mini-batch
training: every microbatch's forward and backward with the weights of the step, gradients summed over the
microbatches, one optimizer step (GPipe, Huang et al. 2019 §2.2; PipeDream-Flush, Narayanan et al. 2021 §2.2). This
module is that plain training, written as directly as possible and sharing nothing with the interpreter but the
modules, the data and the optimizer factory, so that agreeing with it means the interpreter is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from executor.nn.optim import DEFAULT_LR, make_optimizer
from executor.nn.stages import build_layers, loss_fn, synthetic_batch

__all__ = ["ReferenceResult", "train_reference", "train_pipedream_reference", "train_subnets_sequentially"]


@dataclass(frozen=True)
class ReferenceResult:
    """What single-process training ended with.

    Attributes:
        state: parameter name → tensor, named as in the executor's stage state dicts (``layers.<layer>.<param>``).
        losses: per step, the loss of each microbatch, in microbatch order.
    """

    state: dict[str, Tensor]
    losses: tuple[tuple[float, ...], ...]


def train_reference(spec: str, *, steps: int, num_microbatches: int, microbatch_size: int, seed: int = 0,
                    data_seed: int = 0, optimizer: str = "adam", lr: float | None = None,
                    replicas: int = 1, routing: str | None = "balanced",
                    capacity_factor: float = 0.0, byzantine: tuple[tuple[int, str, float], ...] = (),
                    zeno: tuple[int, float] | None = None) -> ReferenceResult:
    """Train ``spec`` for ``steps`` steps of ``num_microbatches`` microbatches each, in one process.

    Step ``k`` uses microbatches ``k * num_microbatches + j`` of :func:`executor.nn.stages.synthetic_batch`, as the
    executor does. Each microbatch's loss is divided by ``num_microbatches`` before its backward, so the accumulated
    gradient is the mean over the step's samples.

    With ``replicas`` = D > 1 it is the same training on a global batch of D·m microbatches (m =
    ``num_microbatches``), step k using microbatches ``k·D·m + i`` for i < D·m, written the way data parallelism
    adds it up: the gradients of each consecutive run of m microbatches (a replica's share, each loss divided by m)
    are accumulated on their own, the D sums are added in order and divided by D. That is the mean gradient over the
    global batch; with D = 2 a two-process all-reduce adds the same two sums (addition commutes), so a data-parallel
    run can equal it bit for bit.

    Args:
        spec: model spec.
        steps: optimizer steps, >= 1.
        num_microbatches: microbatches per step, >= 1.
        microbatch_size: samples per microbatch, >= 1.
        seed: parameter seed.
        data_seed: data seed.
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: learning rate (``None``: the optimizer's default).
        replicas: D, data-parallel replicas (above).
        routing, capacity_factor: a mixture's routing forced as a plan's ``routing`` option spells it, and its
            capacity factor (``executor.nn.forced_routing``): the executor forces them on every moe plan, balanced and
            dropless when the plan names none, and so does this by default; ``None``: the router's own top-k. A
            model without mixtures ignores them.
        byzantine: ``(replica, mode, strength)`` of replicas whose gradient sum is replaced by its corruption
            (``executor.byzantine.corrupt`` of the sum flattened in parameter order, zero-padded to a multiple of D).
        zeno: ``(B, ρ)``: instead of averaging the D sums, score each on the step's validation batch
            (``executor.zeno.validation_batch``): the loss now minus the loss after a step of ``lr`` along it, less
            ρ times its squared norm; drop the B lowest, average the rest in replica order (Zeno, written out).
    """
    layers = build_layers(spec, seed=seed)
    if routing is not None:
        from executor.nn.moe import force_routing
        from sim.models.routing import parse_routing

        for layer in layers:
            force_routing(layer, parse_routing(routing), capacity_factor)
    model = torch.nn.Sequential(*layers)
    names = [layer.name for layer in _graph_layers(spec)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = make_optimizer(optimizer, params, lr)
    loss = loss_fn(spec)
    losses = []
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    for step in range(steps):
        step_losses = []
        sums: list[list[Tensor]] = []
        for replica in range(replicas):
            for j in range(num_microbatches):
                index = (step * replicas + replica) * num_microbatches + j
                inputs, targets = synthetic_batch(spec, microbatch_size, seed=data_seed, index=index)
                value = loss(model(inputs), targets)
                (value / num_microbatches).backward()
                step_losses.append(float(value.detach()))
            if replicas > 1:  # this replica's sum, set aside; the next replica accumulates from nothing
                sums.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
                for p in params:
                    p.grad = None
        if replicas > 1:
            for replica, mode, strength in byzantine:
                sums[replica] = _corrupted(sums[replica], replicas, replica, mode, strength, step)
            chosen = list(range(replicas))
            if zeno is not None:
                chosen = _zeno_kept(model, params, sums, zeno, spec, microbatch_size, data_seed, step,
                                    lr if lr is not None else DEFAULT_LR[optimizer], loss)
            for k, p in enumerate(params):
                total = sums[chosen[0]][k]
                for replica in chosen[1:]:
                    total = total + sums[replica][k]
                p.grad = total / len(chosen)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(tuple(step_losses))
    state = {f"layers.{names[i]}.{key}": tensor.detach().clone()
             for i, layer in enumerate(layers) for key, tensor in layer.state_dict().items()}
    return ReferenceResult(state, tuple(losses))


def _corrupted(sums: list[Tensor], replicas: int, replica: int, mode: str, strength: float, step: int
               ) -> list[Tensor]:
    """A Byzantine replica's sum as it sends it: corrupted flattened (padded as the executor's buffer is), split."""
    from executor.byzantine import Byzantine, corrupt

    flat = torch.cat([t.reshape(-1) for t in sums])
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % replicas)])
    sent = corrupt(flat, Byzantine(replica, mode, strength), step)
    out, offset = [], 0
    for t in sums:
        out.append(sent[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _zeno_kept(model: nn.Module, params: list[Tensor], sums: list[list[Tensor]], zeno: tuple[int, float],
               spec: str, samples: int, data_seed: int, step: int, lr: float, loss) -> list[int]:
    """The replicas Zeno keeps: each sum scored on the step's validation batch, the ``B`` lowest dropped."""
    from executor.zeno import validation_batch

    drop, rho = zeno
    inputs, targets = validation_batch(spec, samples, data_seed, step)
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        now = float(loss(model(inputs), targets))
        scores = []
        for candidate in sums:
            stepped = {name: p - lr * u for name, p, u in zip(names, params, candidate, strict=True)}
            after = float(loss(torch.func.functional_call(model, stepped, (inputs,)), targets))
            scores.append(now - after - rho * sum(float(u.double().pow(2).sum()) for u in candidate))
    order = sorted(range(len(sums)), key=lambda i: (-scores[i], i))
    return sorted(order[:len(sums) - drop])


def _graph_layers(spec: str):
    from sim.models import build_model

    return build_model(spec).layers


def train_pipedream_reference(spec: str, *, stage_layers: Sequence[tuple[int, int]],
                              version: Callable[[int, int], int], iterations: int, minibatches: int,
                              microbatch_size: int, seed: int = 0, data_seed: int = 0, optimizer: str = "sgd",
                              lr: float | None = None) -> ReferenceResult:
    """Single-process PipeDream with weight stashing: the delayed-update rule, written out directly.

    Minibatch k of an iteration runs stage s with the weights after ``version(s, k)`` of that iteration's updates
    (the caller gives this in closed form, e.g. ``max(0, k - (p - s - 1))`` for 1F1B without vertical sync); its
    gradient is then applied to stage s's latest weights, in minibatch order (Narayanan et al., SOSP'19 §3.3). The
    pipeline drains between iterations, so every iteration starts from the previous one's final weights.

    Args:
        spec: model spec.
        stage_layers: ``(start, end)`` layer range of each stage.
        version: ``(stage, minibatch in the iteration) -> updates`` in the weights it uses; at most the minibatch.
        iterations: iterations (pipeline fills and drains).
        minibatches: minibatches per iteration (the plan's microbatches).
        microbatch_size: samples per minibatch.
        seed, data_seed: as in :func:`train_reference`.
        optimizer, lr: the update rule.

    Returns:
        The final live weights and, per iteration, each minibatch's loss.
    """
    layers = build_layers(spec, seed=seed)
    names = [layer.name for layer in _graph_layers(spec)]
    stages = [torch.nn.Sequential(*layers[start:end]) for start, end in stage_layers]
    optimizers = [make_optimizer(optimizer, stage.parameters(), lr) for stage in stages]
    loss = loss_fn(spec)
    losses = []
    for iteration in range(iterations):
        # history[s][u]: stage s's weights after u updates of this iteration.
        history = [[{n: p.detach().clone() for n, p in stage.named_parameters()}] for stage in stages]
        step_losses = []
        for k in range(minibatches):
            inputs, targets = synthetic_batch(spec, microbatch_size, seed=data_seed,
                                              index=iteration * minibatches + k)
            used = []
            h = inputs
            for s, stage in enumerate(stages):
                u = version(s, k)
                if not 0 <= u <= k:
                    raise ValueError(f"version({s}, {k}) = {u} is not in 0..{k}")
                params = {n: t.clone().requires_grad_(True) for n, t in history[s][u].items()}
                used.append(params)
                h = torch.func.functional_call(stage, params, (h,))
            value = loss(h, targets)
            value.backward()
            step_losses.append(float(value.detach()))
            for s, stage in enumerate(stages):
                for n, p in stage.named_parameters():
                    p.grad = used[s][n].grad
                optimizers[s].step()
                optimizers[s].zero_grad(set_to_none=True)
                history[s].append({n: p.detach().clone() for n, p in stage.named_parameters()})
        losses.append(tuple(step_losses))
    state = {}
    for start, stage in zip((a for a, _ in stage_layers), stages, strict=True):
        for i, layer in enumerate(stage):
            for key, tensor in layer.state_dict().items():
                state[f"layers.{names[start + i]}.{key}"] = tensor.detach().clone()
    return ReferenceResult(state, tuple(losses))


def train_subnets_sequentially(stage: nn.Module, num_subnets: int, choose: Callable[[int], None],
                               optimizer: torch.optim.Optimizer, batch: Callable[[int], tuple[Tensor, Tensor]],
                               loss: Callable[[Tensor, Tensor], Tensor]) -> dict[int, float]:
    """The oracle: the same subnets one by one in one process, each updating the layers it used; their losses."""
    losses = {}
    for subnet in range(num_subnets):
        inputs, targets = batch(subnet)
        choose(subnet)
        value = loss(stage(inputs), targets)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[subnet] = float(value.detach())
    return losses
