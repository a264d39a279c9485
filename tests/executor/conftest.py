"""Fixtures shared by the executor tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: the suite targets 2-core machines, and fixed threading keeps CPU kernels repeatable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
