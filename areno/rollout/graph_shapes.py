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
