"""Paged KV cache: fixed-size blocks, ref-counted, with a content-addressed prefix cache.

Layout. Each layer owns two flat slot tensors ``k_S`` and ``v_S`` of shape ``[S, Hkv, Dh]`` with
``S = (num_blocks + 1) * block_size`` (the last block is scratch space for padding); token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix sharing. A block whose ``block_size`` tokens are all known is *full*; full blocks are
immutable, so they can be shared by every sequence whose token prefix is identical. Each full block
gets a chained content key ``key_i = hash((key_{i-1}, tokens of block i))`` and is registered in
``BlockAllocator`` as soon as the scheduler decides to compute it (the forward pass writes every
layer's new K/V before any attention of that layer reads, so a sequence scheduled later in the same
step may already read it). When the last reference to a registered block goes away, the block is
kept as *evictable* (LRU) so that a later request with the same prefix (a multi-turn continuation,
the next GRPO sample) reuses it; evictable blocks are recycled only when no free block is left.
Partially filled blocks are never shared, so no copy-on-write is needed.

Legend: S = KV slots (num_blocks * block_size), Hkv = KV heads, Dh = head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class OutOfBlocksError(RuntimeError):
    """Raised by ``BlockAllocator.allocate`` when neither a free nor an evictable block exists."""


@dataclass
class _BlockMeta:
    ref_count: int = 0
    key: int | None = None
    """Content key when the block is registered in the prefix cache."""
    parent_key: int | None = None
    tokens: tuple[int, ...] = ()


ROOT_KEY = 0


def block_key(parent_key: int, tokens: tuple[int, ...]) -> int:
    """Chained content key of a full block (depends on every token of the prefix)."""
    return hash((parent_key, tokens))


class BlockAllocator:
    """Ref-counted block pool with an LRU prefix cache. Pure bookkeeping: no tensors."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_sharing: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_sharing = enable_prefix_sharing
        # Built as blocks are first handed out (low ids first): a pool sized from a large device's memory
        # can hold 10^7-10^8 blocks, whose records at once took seconds to minutes and gigabytes.
        self._meta: list[_BlockMeta] = []
        self._next = 0
        """Blocks from here on were never handed out."""
        self._free: list[int] = []
        """Blocks handed out and freed since (unregistered): reused first, the last freed first."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_key: dict[int, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- capacity ----
    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free + evictable)."""
        return len(self._free) + self.num_blocks - self._next + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    # ---- allocation ----
    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._next < self.num_blocks:
            block = self._next
            self._next += 1
            self._meta.append(_BlockMeta())
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        else:
            raise OutOfBlocksError("no free KV blocks")
        meta = self._meta[block]
        assert meta.ref_count == 0
        meta.ref_count = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, the ones (and in the order) that ``n`` calls of ``allocate`` return."""
        free = self._free
        take = min(n, len(free))
        blocks = free[len(free) - take :][::-1]
        del free[len(free) - take :]
        fresh = min(n - take, self.num_blocks - self._next)
        if fresh:
            blocks.extend(range(self._next, self._next + fresh))
            self._meta.extend(_BlockMeta() for _ in range(fresh))
            self._next += fresh
        meta = self._meta
        for block in blocks:
            assert meta[block].ref_count == 0
            meta[block].ref_count = 1
        for _ in range(n - len(blocks)):  # then evictable blocks, oldest first
            blocks.append(self.allocate())
        return blocks

    def incref(self, block: int) -> None:
        meta = self._meta[block]
        if meta.ref_count == 0:
            self._evictable.pop(block)
        meta.ref_count += 1

    def free(self, block: int) -> None:
        meta = self._meta[block]
        assert meta.ref_count > 0, f"double free of KV block {block}"
        meta.ref_count -= 1
        if meta.ref_count == 0:
            if meta.key is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free_all(self, blocks: list[int]) -> None:
        # Free in reverse so a sequence's tail blocks are evicted before its head (LRU order).
        for block in reversed(blocks):
            self.free(block)

    # ---- prefix cache ----
    def register(self, block: int, parent_key: int, tokens: tuple[int, ...]) -> int:
        """Record that ``block`` holds the full block ``tokens`` after prefix ``parent_key``.

        Returns the block's key (the parent key of the next block). If another block already holds
        the same content, this block stays unregistered (it is still valid for its owner).
        """
        key = block_key(parent_key, tokens)
        if not self.enable_prefix_sharing:
            return key
        meta = self._meta[block]
        if meta.key is None and key not in self._by_key:
            meta.key, meta.parent_key, meta.tokens = key, parent_key, tokens
            self._by_key[key] = block
        return key

    def match_prefix(self, token_ids: list[int], max_tokens: int, root: int = ROOT_KEY) -> tuple[list[int], int]:
        """Longest run of cached full blocks covering at most ``max_tokens`` leading tokens.

        The returned blocks are already incref'd for the caller. Returns (blocks, last key).
        ``root``: the key chains start from (a sequence with images: their content hash, so equal
        token ids beside other images never share K/V).
        """
        bs = self.block_size
        blocks: list[int] = []
        parent = root
        self.prefix_query_tokens += max_tokens
        if not self.enable_prefix_sharing:
            return blocks, parent
        for start in range(0, max_tokens - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            key = block_key(parent, tokens)
            block = self._by_key.get(key)
            if block is None:
                break
            meta = self._meta[block]
            if meta.parent_key != parent or meta.tokens != tokens:  # hash collision
                break
            self.incref(block)
            blocks.append(block)
            parent = key
        self.prefix_hit_tokens += len(blocks) * bs
        return blocks, parent

    def clear_prefix_cache(self) -> None:
        """Forget every registered block (after a weight update their K/V is stale)."""
        # A rollout leaves thousands of blocks registered, cleared in the policy sync: only the key
        # marks a block registered (parent key and tokens are read after a lookup by key only)
        meta = self._meta
        for block in self._by_key.values():
            meta[block].key = None
        self._by_key.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    def _unregister(self, block: int) -> None:
        meta = self._meta[block]
        if meta.key is not None:
            del self._by_key[meta.key]
        meta.key, meta.parent_key, meta.tokens = None, None, ()

    def ref_count(self, block: int) -> int:
        return self._meta[block].ref_count if block < self._next else 0


class KVCache:
    """The K/V tensors of every layer. ``release()`` frees them (sleep), ``allocate()`` restores."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.k_S: list[torch.Tensor] = []
        self.v_S: list[torch.Tensor] = []
        self.decode_carry = None
        """``attention.DecodeCarry`` of the engine's CPU decode steps (copies of pool contents):
        dropped whenever the pool is allocated or released."""
        self.allocate()

    @property
    def num_slots(self) -> int:
        # One extra scratch block at the end: padding rows of CUDA-graph batches write there.
        return (self.num_blocks + 1) * self.block_size

    @property
    def scratch_block(self) -> int:
        """A block no sequence owns (written by padding tokens, never read unmasked)."""
        return self.num_blocks

    @property
    def is_allocated(self) -> bool:
        return bool(self.k_S)

    def allocate(self) -> None:
        if self.is_allocated:
            return
        if self.decode_carry is not None:
            self.decode_carry.invalidate()
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        self.k_S = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_S = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def release(self) -> None:
        if self.decode_carry is not None:
            self.decode_carry.invalidate()
        self.k_S, self.v_S = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
