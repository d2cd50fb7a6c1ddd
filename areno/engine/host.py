"""Process-wide CPU settings of a run: torch's intra-op threads and how malloc hands memory back.

On CPU every tensor is a ``malloc`` (PyTorch keeps no cache of freed CPU memory), and glibc's
defaults return large freed blocks to the kernel: blocks of 32 MiB or more are ``mmap``ed and
unmapped one by one, and a heap top above its trim threshold is released. A training step's
temporaries (a [C, V] logits chunk, a micro-batch's MLP activations) then come back as fresh pages
at each use, every page a fault the kernel zero-fills. ``keep_freed_memory`` turns both off, so the
process keeps what it frees for its next allocations, as CUDA's caching allocator does; its resident
memory stays at its peak instead of falling back between phases.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

from areno.engine.config import ClusterSection

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
"""glibc's ``mallopt`` parameter numbers (malloc.h)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (which has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in this process (no ``mmap``ed blocks, no heap trim);
    returns whether it applied (False off glibc)."""
    libc = _glibc()
    if libc is None:
        log.info("not glibc: freed CPU memory goes back to the system as the C library decides")
        return False
    # largest int: trim only a free heap top above 2 GiB, i.e. never within a step
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        log.warning("mallopt refused the malloc settings: freed CPU memory goes back to the system")
    return ok


def apply_host_settings(cluster: ClusterSection, device_type: str) -> None:
    """This process's settings: ``cluster.cpu_threads`` (0: torch's default) and, for a CPU run,
    ``cluster.cpu_keep_freed_memory``. A CUDA run's host memory is left as it is: its large host
    blocks (a loaded checkpoint, parked optimizer state) are better given back."""
    if cluster.cpu_threads:
        torch.set_num_threads(cluster.cpu_threads)
    if device_type == "cpu" and cluster.cpu_keep_freed_memory:
        keep_freed_memory()
