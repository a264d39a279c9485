"""Fixtures shared by every test folder."""

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
