"""One intra-op thread for the training tests: on a shared 2-core machine two OpenMP threads
contend with other processes and a small matmul gets ~50x slower (measured 39 ms vs 0.7 ms)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
