"""Evaluating a search's candidates on a Ray cluster (``--ray ADDRESS``, the optional extra ``pip install -e
'.[ray]'``), for searches too large for one machine.

The work is what the local pool does (:mod:`sim.search.driver`): chunks of candidates, each costed by the one
prediction path in a worker, the results put back in the list's order, so a search over Ray gives the same result as
a local one with the same seed (a test runs both). ``ADDRESS`` is whatever ``ray.init`` takes (``auto``, a
``host:port`` of a running cluster, ``ray://host:10001``), or ``local`` for a Ray instance of this machine started for
the search and stopped after it. Ray is imported only here, and only when asked for.

Under a time budget, chunks not yet finished when it ends are cancelled (a running evaluation may be cut off; the
ones that finished are kept), as in the local pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from sim.core.errors import SpecError

__all__ = ["ray_session", "ray_map", "ray_chunks", "LOCAL"]

#: ``--ray local``: start a Ray instance on this machine for the search.
LOCAL = "local"
#: Object store of a local instance, bytes (Ray's default is 30 % of the machine's memory).
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


@contextmanager
def ray_session(address: str):
    """Connect to ``address`` (or start a local instance for ``local``) and disconnect after; yields the module.
    Inside a session already open (a search whose stages each map work onto the cluster), it is that session.

    Raises:
        SpecError: Ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise SpecError("{ray} needs Ray, an optional extra: pip install -e '.[ray]'", "ray") from None
    if ray.is_initialized():  # the caller's session: neither started nor stopped here
        yield ray
        return
    # Ray's own INFO lines would interleave with the command's output; its warnings and errors still show.
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if address == LOCAL:
            # Candidates and evaluations are small: a modest object store leaves this machine's memory alone.
            ray.init(object_store_memory=LOCAL_OBJECT_STORE_BYTES, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise SpecError(f"{{ray}} {address}: cannot connect ({str(exc).splitlines()[0] if str(exc) else exc})",
                        "ray") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def ray_map(ray: Any, function: Callable, tasks: Sequence[tuple]) -> list:
    """``[function(*task) for task in tasks]`` on the cluster, in the tasks' order."""
    remote = ray.remote(function)
    return ray.get([remote.remote(*task) for task in tasks])


def ray_chunks(ray: Any, function: Callable, problem: Any, chunks: Sequence[list], take: Callable[[list], None],
               out_of_time: Callable[[], bool]) -> bool:
    """Run ``function(problem, chunk)`` for every chunk on the cluster, handing each result to ``take`` as it
    arrives; whether the time budget stopped it before every chunk was costed."""
    remote = ray.remote(function)
    shared = ray.put(problem)  # sent once, not with every chunk
    pending = [remote.remote(shared, chunk) for chunk in chunks]
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        for ref in done:
            take(ray.get(ref))
        if pending and out_of_time():
            for ref in pending:
                ray.cancel(ref, force=True)
            return True
    return False
