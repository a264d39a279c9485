"""``python -m sim.search``: see :mod:`sim.search.cli`."""

import time

STARTED = time.monotonic()  # before the imports: a --time-budget counts them too (about a second)

from sim.core.errors import exit_on_interrupt_while_starting, exit_without_teardown  # noqa: E402

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

from sim.search.cli import main  # noqa: E402

if __name__ == "__main__":  # a large search's teardown is a fifth of the second a Ctrl-C may take
    exit_without_teardown(main(started=STARTED))
