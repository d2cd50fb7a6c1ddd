"""Shared fixtures: tiny local checkpoints and tokenizers (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch

# Tiny models: one intra-op thread is fastest and never oversubscribes the 2 CI cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A run in this process sets its ``cluster.cpu_threads`` (the shipped demo config's is 2) and keeps it:
    one thread again after each test, else every later test in that xdist worker runs two OpenMP threads
    beside the other worker and its small matmuls slow down many times over."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def char_tokenizer():
    from areno.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, char_tokenizer):
    """A random tiny Qwen2-style checkpoint with a character tokenizer, saved like a HF model."""
    from areno.models.hf_io import init_model_dir, tiny_config

    out = tmp_path_factory.mktemp("tiny_model")
    init_model_dir(out, tiny_config(len(char_tokenizer), hidden_size=64, layers=2), char_tokenizer, seed=0)
    return out
