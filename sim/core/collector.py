"""Pausing CPython's cyclic garbage collector around work that makes many objects and no reference cycles.

The collector runs whenever allocations outnumber frees by a threshold, and each run walks the objects of the
generations it collects; a search holds millions of long-lived objects (memoised costs, candidates, bounds), so a
burst of short-lived ones (encoding 23,700 records, assembling them) sets off full collections that find nothing to
free: 0.05-0.1 s each on the 2-core machine (2026-12-07), where a Ctrl-C's answer has a second. Reference counting
still frees every object as before; only the search for cycles waits until the block ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with the cyclic collector off, which is back as it was afterwards (on, unless the caller had
    turned it off). For blocks whose objects form no cycles: a cycle made inside is freed only by a later
    collection."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
