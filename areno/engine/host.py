"""Process-wide host settings of a run: torch's intra-op threads, how malloc hands memory back, and
which objects Python's cyclic garbage collector walks.

On CPU every tensor is a ``malloc`` (PyTorch keeps no cache of freed CPU memory), and glibc's
defaults return large freed blocks to the kernel: blocks of 32 MiB or more are ``mmap``ed and
unmapped one by one, and a heap top above its trim threshold is released. A training step's
temporaries (a [C, V] logits chunk, a micro-batch's MLP activations) then come back as fresh pages
at each use, every page a fault the kernel zero-fills. ``keep_freed_memory`` turns both off, so the
process keeps what it frees for its next allocations, as CUDA's caching allocator does; its resident
memory stays at its peak instead of falling back between phases.

Python's collector walks every tracked object of the oldest generation at each full pass: after
imports, a model and its engine that is several hundred thousand objects which live as long as the
run, and the pass stops every thread of the process (GIL) while it walks them. ``freeze_heap``
(``cluster.gc_freeze``), once a process's first step is done, collects once and moves what is left
into the collector's permanent generation (``gc.freeze``), so later passes walk only what the run
allocates afterwards; reference counting still frees frozen objects, only their cycles wait for
``thaw_heap`` (a driver's shutdown).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import time

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


_frozen_here = False
"""Whether ``freeze_heap`` froze this process's heap (``thaw_heap`` leaves a freeze of other code alone)."""


def freeze_heap() -> int:
    """Collect once, then exempt every object alive now from later collections (``gc.freeze``);
    returns how many objects the permanent generation holds. A heap other code froze is left as it
    is (0): ``gc.unfreeze`` could not give back ours alone."""
    global _frozen_here
    if gc.get_freeze_count() and not _frozen_here:
        return 0
    gc.collect()
    gc.freeze()
    _frozen_here = True
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give what ``freeze_heap`` froze back to the collector (``gc.unfreeze``): a finished run's
    reference cycles become collectable again (a notebook's next run needs its memory)."""
    global _frozen_here
    if _frozen_here:
        gc.unfreeze()
        _frozen_here = False


class HeapFreezer:
    """``freeze_heap`` once, after a process's first step (``cluster.gc_freeze``); ``thaw`` undoes it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.frozen = False

    def after_step(self) -> None:
        """Freeze the heap unless done already: a first step has built what lives as long as the run
        (compiled graphs, captured shapes, optimizer state)."""
        if self.enabled and not self.frozen:
            t0 = time.perf_counter()
            count = freeze_heap()
            self.frozen = True
            log.debug("gc_freeze: %d objects exempt from later collections (%.3f s)", count, time.perf_counter() - t0)

    def thaw(self) -> None:
        if self.frozen:
            thaw_heap()
            self.frozen = False
