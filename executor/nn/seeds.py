"""Seeds of every random stream of a run: weights per layer and candidate, synthetic data per microbatch.

One pure function, so that a layer's weights do not depend on which rank builds it or how the model is split, and
a supernet candidate's weights do not depend on which other candidates exist (executor.nn.supernet).
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(purpose: str, seed: int, index: int) -> int:
    """A 63-bit seed for one generator stream, a pure function of ``(purpose, seed, index)``.

    Args:
        purpose: which stream, e.g. ``"layer"`` or ``"batch"``; different purposes never share a stream.
        seed: the run's seed (any int).
        index: the layer index or microbatch index.

    Returns:
        An int in ``[0, 2^63)``, fit for ``torch.Generator.manual_seed``; stable across runs, processes and
        platforms (unlike Python's salted ``hash``).
    """
    digest = hashlib.blake2b(f"pipedejavu/{purpose}/{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
