"""Provenance of a measured profile: which CPU, which device and which library versions (``profiles/README.md``,
``device``, ``machine`` and ``software``). Shared by the two writers of profiles, ``profiles.measure`` and
``executor.run --calibrate-out``, so both describe a machine the same way.

Importing this module does not import torch (:func:`software_versions` does, when called): ``executor.compare``
looks up catalog ids here on every run.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any

__all__ = ["catalog_id_for_gpu", "cpu_model", "software_versions"]

# torch.cuda.get_device_name() → catalog id of profiles/hardware/devices.yaml. First match wins, so the more
# specific pattern of a family comes first. Names not listed (H100 NVL, H200, A10G, ...) need --device-name.
_GPU_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h100.*nvl", ""),  # a different part (94 GB, two cards bridged): not in the catalog
    (r"h100.*pcie", "h100-pcie-80gb"),
    (r"h100", "h100-sxm5-80gb"),  # "NVIDIA H100 80GB HBM3" is the SXM5 board
    (r"a100.*(pcie.*80|80.*pcie)", "a100-pcie-80gb"),
    (r"a100.*pcie", "a100-pcie-40gb"),
    (r"a100.*80", "a100-sxm4-80gb"),
    (r"a100", "a100-sxm4-40gb"),
    (r"v100s", ""),  # V100S has a faster clock and memory than the catalog's V100s
    (r"v100.*pcie.*32", "v100-pcie-32gb"),
    (r"v100.*pcie", "v100-pcie-16gb"),
    (r"v100.*32", "v100-sxm2-32gb"),
    (r"v100", "v100-sxm2-16gb"),
    (r"\bt4\b", "t4-16gb"),
    (r"\ba10\b", "a10-24gb"),
    (r"rtx 3090", "rtx3090-24gb"),
    (r"rtx 4090", "rtx4090-24gb"),
)


def catalog_id_for_gpu(gpu_name: str) -> str | None:
    """The catalog id (``profiles/hardware/devices.yaml``) of a CUDA device name, or None if it has none.

    >>> catalog_id_for_gpu("NVIDIA A100-SXM4-80GB")
    'a100-sxm4-80gb'
    """
    lowered = gpu_name.lower()
    for pattern, catalog_id in _GPU_NAME_PATTERNS:
        if re.search(pattern, lowered):
            return catalog_id or None
    return None


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
