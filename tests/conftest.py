"""Fixtures shared by every test folder, and the end-of-run list of the longest modules."""

import sys

import pytest

#: The key under which an xdist worker hands the longest modules to the controller, which prints them: the
#: controller runs no test, so the length test's list is only ever in a worker's stash.
_LONGEST_OUTPUT = "longest_modules"
#: Where the controller keeps what a worker handed over: {"limit": lines, "modules": [[name, lines], ...]}.
_REPORTED = pytest.StashKey[dict]()


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


def _longest(config: pytest.Config) -> dict | None:
    """The longest modules and the limit, as the module-length test left them in this process; ``None`` if it did
    not run here (tests/test_architecture.py)."""
    architecture = sys.modules.get("tests.test_architecture")  # not loaded: the length test did not run
    longest = architecture and config.stash.get(architecture.LONGEST_MODULES, None)
    return {"limit": architecture.MAX_MODULE_LINES, "modules": longest} if longest else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker that ran the module-length test, hand its list to the controller."""
    output = getattr(session.config, "workeroutput", None)  # only xdist workers have one
    longest = _longest(session.config)
    if output is not None and longest:
        output[_LONGEST_OUTPUT] = longest


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown, and never called, without the plugin
def pytest_testnodedown(node, error) -> None:
    """In the xdist controller, keep the list a worker handed over."""
    longest = getattr(node, "workeroutput", {}).get(_LONGEST_OUTPUT)
    if longest:
        node.config.stash[_REPORTED] = longest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """After a run that included the module-length test, one short section of the longest modules and their lines,
    so that growth is seen in every CI log long before the test's limit fails it (tests/test_architecture.py)."""
    longest = _longest(config) or config.stash.get(_REPORTED, None)
    if not longest:
        return
    terminalreporter.section(f"longest modules (lines; the suite fails over {longest['limit']})", sep="-")
    for name, lines in longest["modules"]:
        terminalreporter.write_line(f"{lines:5d}  {name}")
