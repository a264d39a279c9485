"""``python -m sim.bench``: see :mod:`sim.bench.cli`."""

import sys

from sim.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
