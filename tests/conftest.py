"""Fixtures shared by every test folder, and the end-of-run list of the longest modules."""

import sys

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: the suite targets 2-core machines, and fixed threading keeps CPU kernels repeatable.

    torch is imported here, not at the top, so that collecting the sim tests does not load it.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """After a run that included the module-length test, one short section of the longest modules and their lines,
    so that growth is seen in every CI log long before the test's limit fails it (tests/test_architecture.py)."""
    architecture = sys.modules.get("tests.test_architecture")  # not loaded: the length test did not run
    longest = architecture and config.stash.get(architecture.LONGEST_MODULES, None)
    if not longest:
        return
    terminalreporter.section(f"longest modules (lines; the suite fails over {architecture.MAX_MODULE_LINES})", sep="-")
    for name, lines in longest:
        terminalreporter.write_line(f"{lines:5d}  {name}")
