"""``python -m sim.search``: see :mod:`sim.search.cli`."""

import sys

from sim.search.cli import main

if __name__ == "__main__":
    sys.exit(main())
