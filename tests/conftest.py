"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module's tests: bitwise comparisons and op timings do not depend on how
    a reduction was split across threads (modules opt in with ``pytestmark = pytest.mark.usefixtures``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
