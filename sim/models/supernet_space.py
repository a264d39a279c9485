"""NASPipe search spaces (``c0`` .. ``c3``) as ``supernet`` specs, and the seeded subnet sampler.

What NASPipe's spaces are. Its artifact (hku-systems/naspipe, ``figure5.sh`` and README; ../shared/reference/
hardware.md §4.1) names the NLP spaces c0-c3 and runs them from ``config_4_4.json``, ``config_4_3.json``,
``config_4_2.json`` and ``config_4.json``; the files are not in the snapshot, so their exact sizes are unknown. Their
*order* is not: GPipe, which keeps the whole supernet on the GPUs, cannot run c0 at all ("N/A") and fits growing
micro-batches on c1, c2, c3 (32, 64, 128 in ``figure5.sh``), and NASPipe's time per 1K subnets grows from c0 to c3
(README: 0.129, 0.144, 0.153, 0.214 h) as more subnets collide. So **c0 is the largest supernet and c3 the
smallest**: the index counts *down* in size, and NASPipe's advantage over GPipe shrinks from c1 (8.0x) to c3 (2.8x).
We keep that meaning so our numbers line up with the paper's labels.

Our presets (:data:`SPACES`): K = 48, 16, 8, 4 candidates per block for c0, c1, c2, c3. 48 is the ``encoder_ops``
of NASPipe's ``reproducible/translation/config.py``, whose default run the README calls "search space c0"; the
smaller three halve (c1 -> c2 -> c3) and are our choice. Every space shares the rest of that config: 32 choice
blocks (``encoder_layers = decoder_layers = 16``), hidden 512 (NASPipe's embed dim), 8 heads; a vocabulary of 37000
(the WMT14 En-De shared BPE vocabulary of "about 37000 tokens", Vaswani et al. 2017 §5.1) and a window of 128 tokens
(NASPipe batches by token count, ``-b 3840``, which a fixed shape cannot mirror; 128 is our choice). Any key can be
overridden, e.g. ``space_spec("c1", hidden=64, blocks=8)`` for a small run.

Sampling. NASPipe draws each subnet's choice per layer with ``np.random.randint`` (uniform, independent;
``config.py``). :func:`sample_subnets` does the same from an explicit seed: it takes ``n * num_blocks`` raw 64-bit
outputs of ``numpy.random.PCG64(seed)`` in row-major order (subnet i, block b is output ``i * num_blocks + b``) and
maps each x to ``floor(x * K / 2^64)`` (Lemire's multiply-shift, without rejection: each index has
``floor(2^64 / K)`` or one more preimages, a relative bias below ``K / 2^64``). NEP 19 lets ``Generator`` methods
such as ``integers`` change algorithm between NumPy versions; the raw PCG64 stream is one fixed, integer-only
algorithm (tests/sim/models/test_supernet.py checks it against a pure-Python PCG64), so the subnet table is byte-stable
across runs and platforms, and subnet i does not depend on how many subnets are drawn after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from sim.core.errors import SpecError
from sim.models import build_model
from sim.models import supernet as supernet_model

__all__ = ["SearchSpace", "SPACES", "parse_space", "space_spec", "sample_subnets", "format_space_list"]


@dataclass(frozen=True)
class SearchSpace:
    """One preset search space: the ``supernet`` spec keys it sets.

    Attributes:
        name: ``"c0"`` .. ``"c3"``.
        choices: K, candidates per choice block.
        description: one line for listings.
        values: every other ``supernet`` key the space sets (blocks, hidden, heads, seq, vocab).
    """

    name: str
    choices: int
    description: str
    values: Mapping[str, int]

    def spec_values(self) -> dict[str, int]:
        """All keys of the space's ``supernet`` spec, ``choices`` included."""
        return {**self.values, "choices": self.choices}


# Shared by every preset: NASPipe's reproducible config (32 choice blocks, embed dim 512) at our fixed shape.
_NASPIPE_SCALE: Mapping[str, int] = MappingProxyType(
    {"blocks": 32, "hidden": 512, "heads": 8, "seq": 128, "vocab": 37000}
)

SPACES: Mapping[str, SearchSpace] = MappingProxyType(
    {
        space.name: space
        for space in (
            SearchSpace("c0", 48, "largest: the 48 ops per block of NASPipe's reproducible config.py; GPipe N/A "
                        "in the paper", _NASPIPE_SCALE),
            SearchSpace("c1", 16, "large: 16 candidates per block", _NASPIPE_SCALE),
            SearchSpace("c2", 8, "medium: 8 candidates per block", _NASPIPE_SCALE),
            SearchSpace("c3", 4, "smallest: 4 candidates per block, most subnet collisions", _NASPIPE_SCALE),
        )
    }
)


def parse_space(name: str) -> SearchSpace:
    """The preset named ``name``.

    Raises:
        SpecError: an unknown name; the message names it and lists the known ones.
    """
    space = SPACES.get(name.strip()) if isinstance(name, str) else None
    if space is None:
        raise SpecError(f"unknown search space {name!r} (known: {', '.join(sorted(SPACES))})")
    return space


def space_spec(name: str, **overrides: int) -> str:
    """The canonical ``supernet:...`` spec of search space ``name``, with ``overrides`` replacing its keys.

    >>> space_spec("c3", blocks=4, hidden=32, heads=4, seq=8, vocab=50)
    'supernet:blocks=4,choices=4,heads=4,hidden=32,seq=8,vocab=50'

    Raises:
        SpecError: an unknown space, an unknown key, or values the ``supernet`` model rejects.
    """
    values: dict[str, object] = {**parse_space(name).spec_values(), **overrides}
    text = f"{supernet_model.NAME}:" + ",".join(f"{key}={value}" for key, value in values.items())
    return build_model(text).spec


def _check_int(what: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise SpecError(f"{what} must be {bound}, got {value}")
    return value


def sample_subnets(num_blocks: int, num_choices: int, n: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """``n`` subnets, each one uniformly drawn candidate index per block; a pure function of its arguments.

    Args:
        num_blocks: B, choice blocks per subnet, >= 1.
        num_choices: K, candidates per block, 1 .. 2^32.
        n: number of subnets, >= 0.
        seed: the ``PCG64`` seed, >= 0.

    Returns:
        ``n`` tuples of B ints in ``[0, K)``; subnet i is the same whatever ``n > i`` is (module docstring).

    Raises:
        TypeError: a non-int argument.
        SpecError: an argument out of range; the message names it.
    """
    num_blocks = _check_int("num_blocks", num_blocks, 1)
    num_choices = _check_int("num_choices", num_choices, 1, 2**32)
    n = _check_int("n", n, 0)
    seed = _check_int("seed", seed, 0)
    raw = np.random.PCG64(seed).random_raw(n * num_blocks).astype(np.uint64)
    # floor(x * K / 2^64) without 128-bit integers: x = hi * 2^32 + lo, so
    # floor(x * K / 2^64) = floor((hi * K + floor(lo * K / 2^32)) / 2^32); for K <= 2^32 nothing overflows 64 bits.
    k = np.uint64(num_choices)
    shift = np.uint64(32)
    hi, lo = raw >> shift, raw & np.uint64(0xFFFF_FFFF)
    index = (hi * k + ((lo * k) >> shift)) >> shift
    return tuple(tuple(int(c) for c in row) for row in index.reshape(n, num_blocks).tolist())


def format_space_list() -> str:
    """One line per preset: its name, its full spec and its description."""
    return "\n".join(f"{name}: {space_spec(name)}  ({SPACES[name].description})" for name in sorted(SPACES))
