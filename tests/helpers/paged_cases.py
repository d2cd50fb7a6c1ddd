"""Small paged-KV cases for the engine's attention tests (sinks, soft-caps): a random pool, block tables,
q/k/v, and a step of decode rows beside prompt chunks.

Legend: T = packed new tokens, D = head dim."""

from __future__ import annotations

import torch

from areno.rollout.attention import SeqChunk
from areno.rollout.kv_cache import KVCache

BS, D = 4, 8
"""Tokens per block and head dim of the CPU cases."""


def pool(hkv: int, *, layers=1, num_blocks=40, bs=BS, dh=D, dtype=torch.float32, device="cpu", seed=0) -> KVCache:
    """A KV pool of random keys and values."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_kv_heads=hkv,
        head_dim=dh,
        dtype=dtype,
        device=torch.device(device),
    )
    for i in range(layers):
        cache.k_S[i].copy_(torch.randn(cache.k_S[i].shape, generator=g))
        cache.v_S[i].copy_(torch.randn(cache.v_S[i].shape, generator=g))
    return cache


def tables(cache: KVCache, lengths: list[int], seed=0) -> list[list[int]]:
    """Distinct random blocks holding ``lengths`` tokens per sequence."""
    perm = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for n in lengths:
        need = -(-n // cache.block_size)
        out.append(perm[:need])
        perm = perm[need:]
    return out


def padded(cache: KVCache, tables: list[list[int]], N: int | None = None) -> torch.Tensor:
    """Block tables padded with the pool's scratch block to ``N`` (default: the longest)."""
    N = N or max(map(len, tables))
    return torch.tensor([t + [cache.scratch_block] * (N - len(t)) for t in tables])


def qkv(T: int, hq: int, hkv: int, seed=2, dtype=torch.float32, device="cpu", scale=1.0):
    """Random q, k, v [T, H, D] of standard deviation ``scale``."""
    g = torch.Generator().manual_seed(seed)
    return tuple((scale * torch.randn(T, h, D, generator=g)).to(device, dtype) for h in (hq, hkv, hkv))


def mixed_case(cache, hq, hkv, seed=0, scale=1.0):
    """Two decode rows (positions 3 and 10) then two prompt chunks (7 tokens from 0; 6 from 5, after
    a cached prefix): chunks, tables, each token's table and position, and q/k/v."""
    starts, news = [3, 10, 0, 5], [1, 1, 7, 6]
    tabs = tables(cache, [s + n for s, n in zip(starts, news)], seed)
    chunks = [SeqChunk(t, s, n) for t, s, n in zip(tabs, starts, news)]
    tables_T = [t for t, n in zip(tabs, news) for _ in range(n)]
    pos_T = [s + i for s, n in zip(starts, news) for i in range(n)]
    return chunks, tabs, tables_T, pos_T, qkv(sum(news), hq, hkv, seed=seed + 7, scale=scale)
