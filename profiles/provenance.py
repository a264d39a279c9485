"""Provenance of a measured profile: which CPU and which library versions (``profiles/README.md``, ``machine`` and
``software``). Shared by the two writers of profiles, ``profiles.measure`` and ``executor.run --calibrate-out``, so
both describe a machine the same way.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "software_versions"]


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows, else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def software_versions() -> dict[str, Any]:
    """``python``, ``torch``, ``numpy`` versions and ``cuda`` (the CUDA version torch was built with; None on a
    CPU-only build)."""
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "cuda": torch.version.cuda}
