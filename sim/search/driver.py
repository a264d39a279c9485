"""Evaluating many candidates: in this process or a local process pool, under a time budget, with a progress bar.

:func:`evaluate_all` costs a list of candidates in a seeded order (so that a search stopped by its time budget has
covered a uniform sample of the list, not its first corner) and returns the evaluations in the list's own order,
so the result does not depend on the number of workers or on which finished first. Workers are started by
``spawn`` (no state forked from the caller) and die with the process that started them
(:func:`sim.core.lifetime.die_with_parent`); Ctrl-C reaches the caller only. Once the budget is spent or the caller
asks the search to stop (:mod:`sim.search.stopping`), no more work is handed out and the tasks still running are
abandoned with their workers, so the search answers within a fraction of a second of either; what finished is
kept. A caller with several short lists (the screen's proof, round after round) keeps one :func:`evaluation_pool`
for all of them, so that a worker's start-up is paid once and even a one-plan round runs in a worker, where a stop
abandons it.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass

from sim.core.errors import SpecError
from sim.core.lifetime import die_with_parent
from sim.search.evaluate import Evaluation, evaluate
from sim.search.ray_pool import ray_chunks, ray_map, ray_session
from sim.search.space import Candidate, SearchProblem
from sim.search.stopping import interrupted, share_with_worker, shared_flag

__all__ = ["Evaluated", "EvaluationPool", "evaluate_all", "evaluation_pool", "map_tasks", "CHUNK", "POLL_S"]

#: Candidates a worker costs per task: enough to make the pickling between processes negligible, few enough that a
#: time budget stops within a few evaluations.
CHUNK = 4


@dataclass(frozen=True)
class Evaluated:
    """The outcome of :func:`evaluate_all`.

    Attributes:
        evaluations: one per candidate costed, in the order of the list given (a subset when stopped early).
        listed: how many candidates were given.
        stopped_by_budget: the time budget ran out before every candidate was costed.
        elapsed_s: wall-clock time spent, s.
    """

    evaluations: tuple[Evaluation, ...]
    listed: int
    stopped_by_budget: bool
    elapsed_s: float


def _evaluate_chunk(problem: SearchProblem, chunk: Sequence[tuple[int, Candidate]]) -> list[tuple[int, Evaluation]]:
    return [(index, evaluate(problem, candidate)) for index, candidate in chunk]


def _worker_start(parent: int, stop_flag: object) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and stops the pool
    share_with_worker(stop_flag)  # ...through this flag, which the worker's own stages read (stopping.expired)


def evaluate_all(problem: SearchProblem, candidates: Sequence[Candidate], *, workers: int = 1,
                 time_budget_s: float | None = None, seed: int = 0,
                 progress: Callable[[Evaluation], None] | None = None, in_order: bool = False,
                 ray_address: str | None = None, pool: EvaluationPool | None = None) -> Evaluated:
    """Cost ``candidates`` (see the module docstring).

    Args:
        problem: the search problem.
        candidates: what to cost.
        workers: processes (1: this one); ignored when ``pool`` is given.
        time_budget_s: stop handing out work after this many seconds (``None``: cost everything).
        seed: seed of the evaluation order.
        progress: called with each evaluation as it arrives (the progress bar).
        in_order: cost the candidates in the order given (best first, for the planner) instead of a seeded one.
        ray_address: cost them on this Ray cluster instead (:mod:`sim.search.ray_pool`; ``workers`` is then unused).
        pool: cost them in these workers (:func:`evaluation_pool`), which outlive the call unless it is cut short;
            even a single candidate goes there, so that a stop abandons it rather than waiting for it.

    Raises:
        SpecError: ``workers`` < 1 or ``time_budget_s`` ≤ 0.
    """
    _check_workers(workers)
    if time_budget_s is not None and not time_budget_s > 0:
        raise SpecError(f"{{time_budget_s}} must be > 0 seconds, got {time_budget_s!r}", "time_budget_s")
    order = list(range(len(candidates)))
    if not in_order:
        random.Random(seed).shuffle(order)
    # In order (best first): one candidate a task, so that the workers share even a short list and take it in order.
    size = 1 if in_order else CHUNK
    chunks = [[(i, candidates[i]) for i in order[k:k + size]] for k in range(0, len(order), size)]
    start = time.monotonic()

    def out_of_time() -> bool:
        return interrupted() or (time_budget_s is not None and time.monotonic() - start >= time_budget_s)

    results: dict[int, Evaluation] = {}

    def take(pairs: list[tuple[int, Evaluation]]) -> None:
        for index, evaluation in pairs:
            results[index] = evaluation
            if progress is not None:
                progress(evaluation)

    stopped = False
    if ray_address is not None:
        with ray_session(ray_address) as ray:
            stopped = ray_chunks(ray, _evaluate_chunk, problem, chunks, take, out_of_time)
    elif pool is None and (workers == 1 or len(chunks) <= 1):
        for index, candidate in (pair for chunk in chunks for pair in chunk):  # one by one: a stop is heard sooner
            if out_of_time():
                stopped = True
                break
            take([(index, evaluate(problem, candidate))])
    elif pool is not None:
        stopped = _run_pool(problem, chunks, pool, out_of_time, take)
    else:
        with evaluation_pool(workers) as own:
            assert own is not None
            stopped = _run_pool(problem, chunks, own, out_of_time, take)
    ordered = tuple(results[i] for i in sorted(results))
    return Evaluated(ordered, len(candidates), stopped, time.monotonic() - start)


class EvaluationPool:
    """Spawned worker processes that die with this one (:func:`_worker_start`), started on first use and kept across
    several :func:`evaluate_all` calls (the proof's rounds: a worker's start-up, about a second of imports, is paid
    once). Made by :func:`evaluation_pool`, which stops them on leaving; :meth:`stop` stops them at once (a round
    abandoned with tasks still running), and a later use starts new ones."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None

    def executor(self) -> ProcessPoolExecutor:
        """The running pool, started now if it is not."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(max_workers=self.workers,
                                                 mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_worker_start, initargs=(os.getpid(), shared_flag()))
            _start_workers(self._executor, self.workers)
        return self._executor

    def stop(self) -> None:
        """Drop the queued tasks and stop the workers now, those computing included."""
        if self._executor is None:
            return
        # The processes first: shutdown forgets them (ProcessPoolExecutor sets _processes to None), and those still
        # computing would finish their tasks before the interpreter, which joins them, could exit. Stopped even when
        # every task has answered: the workers hold only their memos, which a graceful exit would spend tenths of a
        # second freeing object by object (0.3-0.4 s after the screen's slices, measured after a Ctrl-C).
        processes = _processes_of(self._executor)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None
        _stop_workers(processes)


@contextmanager
def evaluation_pool(workers: int) -> Iterator[EvaluationPool | None]:
    """An :class:`EvaluationPool` of ``workers`` processes for the block (``None`` for one worker: this process),
    stopped on leaving it, however it is left (Ctrl-C included)."""
    _check_workers(workers)
    if workers == 1:
        yield None
        return
    pool = EvaluationPool(workers)
    try:
        yield pool
    finally:
        pool.stop()


def _start_workers(pool: ProcessPoolExecutor, workers: int) -> None:
    """Start all of ``pool``'s workers now, with SIGINT blocked in this thread meanwhile. A spawn pool starts a worker
    per submission until it has them all, and a process inherits the signal mask of the thread that starts it, so
    the workers begin with SIGINT blocked: a terminal's Ctrl-C, which reaches the whole process group, cannot kill one
    still importing its modules (with a traceback) before its initializer ignores it. Blocked, not ignored, here: a
    Ctrl-C pressed while the workers start stays pending and is heard as soon as they have (an ignored one was lost)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for _ in range(workers):
            pool.submit(os.getpid)  # a task that does nothing: each submission starts one more worker
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _processes_of(pool: ProcessPoolExecutor) -> list:
    """The pool's worker processes (a private attribute of the standard library's pool, read defensively)."""
    return list((getattr(pool, "_processes", None) or {}).values())


def _check_workers(workers: object) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SpecError(f"{{workers}} must be an integer >= 1, got {workers!r}", "workers")


#: How often the caller looks at the clock and the stop flag while its workers compute, s: a Ctrl-C's answer waits
#: up to this long for the look (waking 50 times a second costs nothing measurable beside the workers).
POLL_S = 0.02


def _run_pool(problem: SearchProblem, chunks: list, pool: EvaluationPool, out_of_time: Callable[[], bool],
              take: Callable[[list[tuple[int, Evaluation]]], None]) -> bool:
    """Cost ``chunks`` in ``pool``, keeping two tasks per worker in flight; whether the time budget (or a request to
    stop) ended it before every chunk was costed. Tasks still running then are abandoned with the pool's workers:
    waiting for them would overrun the budget by a chunk's evaluations."""
    queue = iter(chunks)
    try:
        executor = pool.executor()
        pending: set[Future] = set()
        for chunk in queue:
            pending.add(executor.submit(_evaluate_chunk, problem, chunk))
            if len(pending) >= 2 * pool.workers:
                break
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for future in done:
                take(future.result())
            if out_of_time():
                if pending or next(queue, None) is not None:
                    pool.stop()
                    return True
                return False  # everything was costed: the budget stopped nothing
            for chunk in queue:
                pending.add(executor.submit(_evaluate_chunk, problem, chunk))
                if len(pending) >= 2 * pool.workers:
                    break
    except BaseException:
        pool.stop()
        raise
    return False


def map_tasks(function: Callable, tasks: Sequence[tuple], workers: int, ray_address: str | None = None) -> list:
    """``[function(*task) for task in tasks]``, in a pool of ``workers`` spawned processes when there are several (the
    same workers, lifetime and Ctrl-C handling as :func:`evaluate_all`), or on the Ray cluster ``ray_address``;
    results in the tasks' order.

    Raises:
        SpecError: ``workers`` < 1.
    """
    _check_workers(workers)
    if ray_address is not None:
        with ray_session(ray_address) as ray:
            return ray_map(ray, function, tasks)
    if workers == 1 or len(tasks) <= 1:
        return [function(*task) for task in tasks]
    with evaluation_pool(min(workers, len(tasks))) as pool:
        assert pool is not None
        executor = pool.executor()
        futures = [executor.submit(function, *task) for task in tasks]
        return [future.result() for future in futures]


def _stop_workers(processes: list) -> None:
    """Terminate ``processes`` now (Ctrl-C, a spent budget, an error): nothing is left running behind the command."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
    if sys.platform.startswith("linux"):
        killed = [process for process in processes if process.is_alive()]
        for process in killed:
            process.kill()
        for process in killed:  # reaped, so that none is left a zombie or still counted alive by a caller
            process.join(timeout=5)
