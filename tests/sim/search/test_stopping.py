"""sim.search.stopping: what Ctrl-C does to a search (the first asks it to stop, the second interrupts), and when a
stage must stop. The whole command under a real terminal's Ctrl-C is tests/test_terminal.py's."""

import os
import signal
import time

import pytest

from sim.search import stopping


def _deliver_sigint() -> None:
    """SIGINT to this process, handled before returning (Python runs the handler at the next check; the sleep is
    interrupted by the signal)."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)


def test_the_first_ctrl_c_asks_to_stop_and_the_second_interrupts(capsys):
    before = signal.getsignal(signal.SIGINT)
    try:
        with stopping.stop_on_interrupt("stopping"):
            assert not stopping.interrupted() and not stopping.expired(None)
            _deliver_sigint()
            assert stopping.interrupted() and stopping.expired(None) and stopping.seconds_left(None) == 0.0
            with pytest.raises(KeyboardInterrupt):
                _deliver_sigint()
        assert signal.getsignal(signal.SIGINT) is before  # put back on leaving
        assert capsys.readouterr().err == "stopping\n"
    finally:
        stopping.clear()
    assert not stopping.interrupted()


def test_a_new_search_starts_without_an_earlier_interruption():
    stopping.request_stop()
    with stopping.stop_on_interrupt():
        assert not stopping.interrupted()
    stopping.clear()


def test_a_deadline_expires_on_the_wall_clock():
    now = time.time()
    assert stopping.expired(now - 1) and not stopping.expired(now + 60)
    assert stopping.seconds_left(now - 1) == 0.0 and 59 < stopping.seconds_left(now + 60) <= 60
    assert stopping.seconds_left(None) is None
