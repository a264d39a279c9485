"""Starting worker processes on this host with PyTorch's own launcher (the machinery of ``torchrun --standalone``).

``executor.run`` and ``executor.naspipe`` both re-enter their own module once per rank; this is the one place that
knows how: a single-node c10d rendezvous on a free port, no restarts (a failed training step is not retried behind
the user's back), and a 0.1 s monitor interval so that one failing worker stops the others promptly.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

__all__ = ["launch_local", "leave_worker"]


def launch_local(module: str, argv: list[str], num_ranks: int) -> None:
    """Run ``python -u -m module argv`` as ``num_ranks`` ranks on this host and wait for them.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed; every other worker has
            been stopped by then.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchelastic logs every worker failure with a long traceback; the workers' own error lines say it better.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=num_ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    elastic_launch(config, sys.executable)("-u", "-m", module, *argv)


def leave_worker(status: int) -> None:
    """End a worker process at once with ``status``, after flushing its output; never returns.

    A worker that has finished (process groups destroyed, outputs written atomically) skips the interpreter's
    finalization on purpose. There, gloo's C++ threads may still drop the last reference to a tensor; that needs the
    GIL, which a finalizing CPython refuses by ending the thread, and the forced unwind through a ``noexcept`` frame
    aborts the process ("terminate called without an active exception", SIGABRT). We saw it in about 1 in 25
    two-rank CSP runs on a loaded 2-core machine, always with no Python frame on the stack; PyTorch discusses the
    same race in its pull request 179291 (an atexit hook destroying process groups, abandoned).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
