"""One rank of a run: join the process group, build this rank's stages, run the iterations, report to rank 0.

Started by the launcher (``executor.run`` through ``executor.launch.run_ranks``), or directly by a user's ``torchrun``
on several hosts; either way ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set, and the
rendezvous is the launcher's file or torchrun's ``MASTER_ADDR`` and ``MASTER_PORT`` (``executor.launch.join_world``).
The plan has been checked before launch, and is checked again here against the world size (a user's torchrun may
start any number of processes). A 3D plan runs ``plan.world_size`` processes, each placed, grouped and built by
``executor.parallel``.

Failure (DESIGN §7): if anything raises, the rank records ``rank R failed at op X: <the op's exception>`` (and its
traceback) in the failure directory the launcher gave it (``executor.failures.record_failure``), and leaves with
``os._exit(1)`` at once. The launcher then prints the first failure as the command's one ``error:`` line; the echoes
of it on the other ranks (a peer's "Connection reset by peer") go only to its log, ``--out/errors.log``. A rank
started by a user's ``torchrun`` has no launcher listening, so it prints its own ``error:`` line. Either way the rank
dies with the process that started it (``executor.launch.die_with_launcher``). Exiting without tearing the process
group down is deliberate: a clean shutdown would wait on peers that may never answer. The peers then either fail on
the closed connection or are stopped by the launcher (or torchrun's agent), which terminates the whole group when
one worker exits non-zero.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist

from executor.clock import measure_offsets
from executor.failures import record_failure
from executor.interpreter import RankInterpreter
from executor.launch import die_with_launcher, join_world, leave_worker
from executor.measured import RankReport
from executor.memory import PeakMemory
from executor.nn.context_parallel import ContextParallel, local_tokens
from executor.nn.stages import boundary_specs, synthetic_batch
from executor.options import RunOptions, host_cores
from executor.parallel import Place, ProcessModel, build_process, make_groups, microbatch_index, save_state
from executor.partime.partime_interpreter import PartimeInterpreter, partime_frames
from executor.pingpong import round_trip_times
from executor.restart import after_restart, die_if_failing, note_start, restart_count, restart_record
from sim.core.errors import SpecError
from sim.hw.topology import Topology
from sim.ir.plan import Plan

__all__ = ["worker_main", "p2p_sweep", "failure_message", "INJECT_SIGNAL_ENV"]

#: Test hook: with ``--inject-failure RANK:OP``, a signal name or number here (``SIGKILL``, ``9``) makes that rank
#: die of the signal at that op instead of raising, to check how the launcher reports a rank that left no record.
INJECT_SIGNAL_ENV = "PIPEDEJAVU_INJECT_SIGNAL"


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise SpecError(f"environment variable {name} must be set by the launcher (torchrun), got {value!r}")
    return int(value)


def failure_message(rank: int, exc: BaseException) -> str:
    """How a rank's failure reads after ``error: ``: ``rank R failed at op X: <Type>: <text>`` for an op that raised
    (the op's own exception, not its :class:`executor.interpreter.OpFailure` wrapper, whose text repeats the op id),
    ``rank R: <text>`` for bad input (the message already says what is wrong), else ``rank R failed: <Type>: <text>``.
    """
    op_id = getattr(exc, "op_id", None)
    if isinstance(exc, SpecError):
        return f"rank {rank}: {exc}"
    cause = exc.__cause__ if op_id and exc.__cause__ is not None else exc
    text = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return f"rank {rank} failed at op {op_id}: {text}" if op_id else f"rank {rank} failed: {text}"


def _record_failure(rank: int, exc: BaseException, status: int) -> None:
    """Leave the rank's failure where the launcher looks, or print it if no launcher listens; never raises."""
    message = failure_message(rank, exc)
    try:
        if record_failure(rank, message, op=getattr(exc, "op_id", None), status=status,
                          traceback_text="".join(traceback.format_exception(exc))):
            return
    except Exception:  # noqa: BLE001 - reporting must not mask the original failure; print it instead
        pass
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001
        pass


def _die_as_injected(options: RunOptions, rank: int, exc: BaseException) -> None:
    """Test hook: when :data:`INJECT_SIGNAL_ENV` names a signal and ``exc`` is the ``--inject-failure`` of this
    rank, the rank dies of that signal instead of reporting, as a process killed from outside (or crashed) would."""
    name = os.environ.get(INJECT_SIGNAL_ENV)
    injected = options.inject_failure is not None and options.inject_failure == (rank, getattr(exc, "op_id", None))
    if name and injected:
        sig = signal.Signals[name] if not name.isdigit() else signal.Signals(int(name))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # a signal that does not end the process (SIGCHLD, ...) falls through to the report


def p2p_sweep(rank: int, sizes: tuple[int, ...], *, repeats: int = 10, warmup: int = 3,
              device: torch.device | None = None) -> list[float]:
    """One-way message times between ranks 0 and 1 for each size in bytes, measured inside the run's group.

    Ping-pong (:func:`executor.pingpong.round_trip_times`: sizes interleaved, CUDA synchronised around each trip),
    median round trip over ``repeats`` after ``warmup``, halved. Ranks other than 0 and 1 take no part.

    Returns:
        On rank 0, the one-way time per size in s; elsewhere an empty list.
    """
    if rank > 1:
        return []
    device = device or torch.device("cpu")
    messages = [torch.zeros(max(1, size), dtype=torch.uint8, device=device) for size in sizes]
    times = round_trip_times(messages, 1 - rank, initiate=rank == 0, warmup=warmup, repeats=repeats)
    return [sorted(trips)[len(trips) // 2] / 2 for trips in times] if rank == 0 else []


def _threads(options: RunOptions, local_world_size: int) -> int:
    if options.threads is not None:
        return options.threads
    return max(1, host_cores() // local_world_size)


def _resume(options: RunOptions, model: ProcessModel, rank: int) -> int:
    """With ``--resume``, put the checkpoint's shard of this rank back (``executor.checkpoint``); the iteration the run
    starts at."""
    if options.resume_from is None:
        return 0
    from executor.checkpoint import read_shard, restore

    shard = read_shard(options.resume_from, rank)
    resumed = restore(model.stages, model.optimizers, shard, fully_sharded=model.fully_sharded is not None)
    if resumed != options.first_iteration:
        raise SpecError(f"rank {rank}'s shard of {options.resume_from} resumes at iteration {resumed}, its marker "
                        f"says {options.first_iteration}")
    return resumed


def _settle_parameters(plan: Plan, model: ProcessModel) -> None:
    """Under the plan's ``param_gather_overlap`` the parameters the last step updated are gathered at the next
    iteration's start: gather them now, before the state is saved or checkpointed (:meth:`DataParallel.settle`)."""
    if plan.layout.param_gather_overlap and model.data_parallel is not None:
        model.data_parallel.settle()


def _checkpoint_after(options: RunOptions, plan: Plan, model: ProcessModel, rank: int, done: int) -> float | None:
    """After ``done`` iterations, every ``--checkpoint-every``-th: write this rank's shard; once every rank has,
    rank 0 marks the checkpoint complete (``executor.checkpoint``). Returns the seconds it took (``None``: none due)."""
    if not options.checkpoint_every or done % options.checkpoint_every:
        return None
    started = time.perf_counter()
    from executor.checkpoint import capture, complete, write_shard

    _settle_parameters(plan, model)

    assert options.checkpoint_dir is not None
    state = capture(model.stages, model.optimizers, fully_sharded=model.fully_sharded is not None,
                    next_iteration=done)
    write_shard(options.checkpoint_dir, done, rank, state,
                die_midway=options.die_in_checkpoint == (rank, done) and options.attempt == 0)
    dist.barrier()  # every shard is in place before the marker says so
    if rank == 0:
        complete(options.checkpoint_dir, done, dict(options.identity))
    return time.perf_counter() - started


def _run(options: RunOptions, plan: Plan, topology: Topology, rank: int) -> None:
    world_size, local_rank = _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    options = after_restart(options, restart_count())  # a restarted group continues from its newest checkpoint
    if plan.weight_policy == "csp":  # no fixed program: each rank decides online (executor.csp)
        from executor.csp.csp_plan_run import run_csp_plan_rank

        if plan.num_ranks != world_size:
            raise SpecError(f"plan {options.plan_path} has {plan.num_ranks} ranks but the launcher started "
                            f"{world_size}")
        run_csp_plan_rank(options, plan, rank, world_size)
        return
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if plan.world_size != world_size:
        raise SpecError(f"plan {options.plan_path} has {plan.world_size} ranks but the launcher started {world_size}")
    if options.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        device_name = torch.cuda.get_device_name(device)
    else:
        device, device_name = torch.device("cpu"), "cpu"
    torch.set_num_threads(_threads(options, local_world_size))
    join_world(options.backend, options.timeout_s)

    place = Place.of(plan.layout, rank)  # a pure pipeline: pipeline rank = rank, one replica, one shard
    groups = make_groups(plan.layout, rank)
    model = build_process(plan, place, groups, seed=options.seed, optimizer=options.optimizer, lr=options.lr,
                          device=device, aggregate=options.aggregate, byzantine=options.byzantine,
                          data_seed=options.data_seed)
    vstages = plan.placement.vstages_of(place.pp)
    cuts = [start for start, _ in plan.placement.vstage_layers]
    specs = boundary_specs(plan.model, cuts, plan.microbatch_size, sequence_parts=plan.layout.cp)
    boundary = {v: specs[start] for v, (start, _) in enumerate(plan.placement.vstage_layers)}
    fail_at = options.inject_failure[1] if options.inject_failure and options.inject_failure[0] == rank else None
    # A stream plan (PARTIME) runs its backward through each stage's current forward
    # (executor.partime.partime_interpreter).
    interpreter_class = PartimeInterpreter if plan.weight_policy == "stream" else RankInterpreter
    interpreter = interpreter_class(plan, place.pp, model.stages, model.optimizers, model.loss, boundary,
                                    device=device, fail_at=fail_at, peer_of=place.peer, tp_comm=model.tp_comm,
                                    ep_comm=model.ep_comm, data_parallel=model.data_parallel,
                                    slowdown=options.slowdown_of(rank))
    first, last = 0 in vstages, plan.num_vstages - 1 in vstages
    m, replicas, cp = plan.num_microbatches, plan.layout.dp, plan.layout.cp
    # Under context parallelism the C processes of a replica read its microbatches and keep their own tokens.
    context = ContextParallel(None, place.dp % cp, cp) if cp > 1 else None

    offsets = measure_offsets(rank, world_size, device=device)
    timings, losses = [], []
    # The peak tensor memory of the measured iterations (executor.memory): CUDA's statistics, or on the CPU with
    # --measure-memory a count of every operator's storages, from those alive (weights, optimizer state) at the start.
    memory = PeakMemory(device, count_cpu=options.measure_memory)
    first_iteration = _resume(options, model, rank)
    if model.data_parallel is not None:
        model.data_parallel.start_at(first_iteration)
    checkpoint_times: list[float] = []
    iteration_spans: list[tuple[float, float]] = []  # (start, end) of each iteration, time.time(): for restarts
    with memory:
        for index in range(options.warmup + options.iterations):
            iteration = first_iteration + index  # the data position: a resumed run continues the same stream
            die_if_failing(options, rank, iteration)
            if index == options.warmup:
                memory.start_measured()
            if not (first or last):
                batches = []
            elif plan.weight_policy == "stream":  # frames of a seeded video, the iterations one continuing stream
                batches = partime_frames(plan, options.data_seed, iteration)
            else:
                batches = [synthetic_batch(plan.model, plan.microbatch_size, seed=options.data_seed,
                                           index=microbatch_index(iteration, j, m, place.dp // cp, replicas))
                           for j in range(m)]
                if context is not None:
                    batches = [(local_tokens(x, context), local_tokens(y, context)) for x, y in batches]
            inputs = [x.to(device) for x, _ in batches] if first else None
            targets = [y.to(device) for _, y in batches] if last else None
            dist.barrier()  # every rank starts the iteration together, as the simulation assumes
            began = time.time()
            records, iteration_losses = interpreter.run_iteration(inputs, targets)
            iteration_spans.append((began, time.time()))
            if index == 0:
                note_start(options, rank, iteration_spans[0])
            timings.append(tuple((r.op.id, r.start, r.end) for r in records))
            losses.append(tuple(iteration_losses))
            took = _checkpoint_after(options, plan, model, rank, iteration + 1)
            if took is not None:
                checkpoint_times.append(took)
    finished_at = time.time()
    sweep_sizes = tuple(2**k for k in range(10, 23, 2))
    sweep = p2p_sweep(rank, sweep_sizes, device=device) if options.calibrate_out and world_size > 1 else []

    if options.save_state:
        _settle_parameters(plan, model)
        save_state(options.save_state, plan, place, model, groups)
    report = RankReport(rank, device_name, torch.get_num_threads(), tuple(timings), tuple(losses),
                        peak_memory_bytes=memory.peak_bytes, memory_method=memory.method)
    gathered: list[RankReport] | None = [None] * world_size if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(report, gathered, dst=0)
    if rank == 0:
        from executor.run_outputs import finish_run  # rank 0 only: simulation, plotting, file output

        options = replace(options, restarts=restart_record(options, iteration_spans, finished_at, checkpoint_times))

        assert gathered is not None
        finish_run(plan, topology, options, gathered, offsets, (sweep_sizes, sweep) if sweep else None)
    dist.barrier()  # nobody leaves while rank 0 may still need the group
    dist.destroy_process_group()


def worker_main(options: RunOptions, plan: Plan, topology: Topology) -> int:
    """Run this process's rank to the end; on any error report it and exit the process with status 1.

    ``plan`` and its ``topology`` are those ``executor.run`` read from ``options.plan_path`` and checked in this
    process (``load_checked_plan``); the rank uses them as they are.
    """
    # Already done by the worker entry of executor.launch; again here for a rank started by a user's torchrun, which
    # should not outlive torchrun's agent either.
    die_with_launcher()
    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        _run(options, plan, topology, rank)
    except BaseException as exc:  # noqa: BLE001 - a rank must never hang its peers, whatever went wrong
        _die_as_injected(options, rank, exc)
        status = 2 if isinstance(exc, SpecError) else 1  # bad input keeps the CLI's status 2
        _record_failure(rank, exc, status)
        leave_worker(status)
    leave_worker(0)
    return 0  # not reached
