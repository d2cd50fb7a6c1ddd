"""Fixtures for rollout tests: a tiny random decoder and a naive greedy reference."""

from __future__ import annotations

import pytest
import torch

from areno.models.decoder import Decoder
from areno.models.hf_io import tiny_config

VOCAB = 64
EOS = 2


def make_model(seed: int = 0, **kw) -> tuple[Decoder, object]:
    cfg = tiny_config(VOCAB, hidden_size=32, layers=2, heads=4, kv_heads=2, max_position_embeddings=256, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(cfg)
        # A larger init spread makes the tiny model's argmax decisive (no near-ties in parity tests).
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3)
    return model.eval(), cfg


@pytest.fixture(scope="session")
def tiny():
    return make_model(0)


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
    return out


@torch.no_grad()
def naive_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Full recompute every token (no cache): the reference for the engine."""
    ids = list(prompt)
    logprobs = []
    for _ in range(n):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        logits = model.logits(hidden[-1:]).float()[0]
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], logprobs
