"""``--candidates FILE``: restrict a search to listed (TP, DP, PP, microbatch size) settings.

The file is CSV with a header naming the columns ``tp``, ``dp``, ``pp`` and ``microbatch_size`` (in any order; other
columns are ignored, so a table of measured runs can be given as is, e.g. vTrain's with ``tensor``/``data``/
``pipeline``/``micro_batch`` under the aliases below). Each row is one setting; the search combines each with the
rest of its space (schedules, recompute, ...). Used to rank exactly the configurations someone measured
(``experiments.run search_vtrain``).
"""

from __future__ import annotations

import csv
import io
import os

from sim.core.errors import SpecError
from sim.core.fileio import read_text

__all__ = ["Setting", "load_settings", "COLUMN_ALIASES"]

#: (tp, dp, pp, microbatch size).
Setting = tuple[int, int, int, int]

#: Accepted header names of each column.
COLUMN_ALIASES = {
    "tp": ("tp", "tensor", "tensor_parallel"),
    "dp": ("dp", "data", "data_parallel"),
    "pp": ("pp", "pipeline", "pipeline_parallel"),
    "microbatch_size": ("microbatch_size", "micro_batch", "micro_batch_size", "mbs", "b"),
}


def load_settings(path: str | os.PathLike, num_devices: int | None = None) -> tuple[Setting, ...]:
    """The distinct settings listed in ``path``, in file order.

    Args:
        path: the CSV file.
        num_devices: when given, every row's tp · dp · pp must equal it (a search uses every device).

    Raises:
        SpecError: unreadable, over the size limit, missing a column, a value that is not an integer >= 1, a row on
            another device count, or no rows; the message names the file, line and value.
    """
    text = read_text(path, "candidates file")
    reader = csv.reader(io.StringIO(text.lstrip("\ufeff")))
    header = [name.strip().lower() for name in next(reader, [])]
    where: dict[str, int] = {}
    for key, aliases in COLUMN_ALIASES.items():
        found = [i for i, name in enumerate(header) if name in aliases]
        if not found:
            raise SpecError(f"candidates file {os.fspath(path)} has no {key} column (its header names one of "
                            f"{', '.join(aliases)}); the header is {','.join(header) or 'empty'}")
        where[key] = found[0]
    settings: dict[Setting, None] = {}
    for line, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row):
            continue
        values = []
        for key in COLUMN_ALIASES:
            cell = row[where[key]].strip() if where[key] < len(row) else ""
            if not cell.isdigit() or int(cell) < 1:
                raise SpecError(f"candidates file {os.fspath(path)} line {line}: {key} must be an integer >= 1, "
                                f"got {cell!r}")
            values.append(int(cell))
        tp, dp, pp, b = values
        if num_devices is not None and tp * dp * pp != num_devices:
            raise SpecError(f"candidates file {os.fspath(path)} line {line}: tp {tp} × dp {dp} × pp {pp} = "
                            f"{tp * dp * pp} devices, the topology has {num_devices}")
        settings[(tp, dp, pp, b)] = None
    if not settings:
        raise SpecError(f"candidates file {os.fspath(path)} lists no settings")
    return tuple(settings)
