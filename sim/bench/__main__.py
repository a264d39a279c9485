"""``python -m sim.bench``: see :mod:`sim.bench.cli`."""

import sys

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

from sim.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
