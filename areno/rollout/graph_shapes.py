"""The padded shapes decode CUDA graphs are captured for (``cuda_graph.py``).

The scheduler sizes its block-table tensor by them (wide enough for every graph's width), so they live
below both: the scheduler never imports the graph runner.
"""

from __future__ import annotations


def padded_batch_size(n: int) -> int:
    """The captured batch size serving ``n`` sequences: 1, 2, 4, then multiples of 8 up to 64, of 32
    up to 256 and of 64 beyond. Coarser steps for large batches bound the number of graphs (an
    asynchronous run with long-tailed lengths sweeps through every batch size) while a decode step,
    latency-bound at these sizes, costs about the same for a few padding rows more."""
    if n <= 4:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 64 else 32 if n <= 256 else 64
    return -(-n // step) * step


def padded_num_blocks(n: int) -> int:
    # Powers of two up to 16 blocks, then multiples of 16: the gathered keys exceed the longest
    # context by at most 2x for short contexts and by 16 blocks for long ones.
    if n <= 16:
        return 1 << (n - 1).bit_length()
    return -(-n // 16) * 16


PAGED_MIN_BLOCKS = 64
"""Narrowest block table of a graph under paged decode attention (1,024 tokens at block size 16)."""


def graph_num_blocks(n: int, paged: bool) -> int:
    """The captured block-table width for a batch whose longest sequence spans ``n`` blocks. The
    gather path attends over every column, so its width follows ``padded_num_blocks``; the paged
    kernel reads only each row's real context, so there the width is a power of two of at least
    ``PAGED_MIN_BLOCKS``: one graph width for most RL lengths instead of one per context bucket."""
    if not paged:
        return padded_num_blocks(n)
    return max(PAGED_MIN_BLOCKS, 1 << (n - 1).bit_length())


PREFILL_MIN_TOKENS = 256
"""Smallest padded token (and key) count of a prefill graph."""


def padded_prefill_tokens(n: int) -> int:
    """The captured token (or key) count serving ``n``: ``PREFILL_MIN_TOKENS``, then powers of two
    and 1.5 times powers of two (256, 384, 512, 768, 1,024, ...): at most a third more device work
    than the step's, and a handful of graphs over a run's prompt lengths."""
    if n <= PREFILL_MIN_TOKENS:
        return PREFILL_MIN_TOKENS
    p = 1 << (n - 1).bit_length()
    return p * 3 // 4 if n <= p * 3 // 4 else p


def padded_prefill_batch(n: int) -> int:
    """The captured sequence count of a prefill graph: a power of two."""
    return 1 << max(n - 1, 0).bit_length()
