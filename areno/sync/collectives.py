"""The collectives of one rank's policy syncs (``stream.py``): post them, wait on them with the
timeout, and time each phase of a sync.

On NCCL the per-bucket waits are stream-ordered (``Work.wait()`` without a timeout: the current
stream waits, the host keeps enqueuing), so packing bucket k+1 is not serialised behind bucket k on
the wire; before voting, every rank host-waits on them with the timeout (``drain``), so a hung peer
still ends in ``PolicySyncError``. Host waits on NCCL works poll ``is_completed`` every ~50 us first:
NCCL's ``Work.wait(timeout)`` polls once per millisecond, which would add up to a millisecond to the
drain and to an NCCL vote. On gloo every wait blocks the host, with the timeout.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from areno.sync.base import PolicySyncError

POLL_S = 1.0
"""Host waits on NCCL works poll ``is_completed`` for up to this long (then ``Work.wait(timeout)``)."""
POLL_INTERVAL_S = 5e-5
"""Sleep between two polls (~50-100 us on Linux; releases the GIL to a generating engine thread)."""

PHASES = ("begin", "pack", "post", "wait", "stage", "vote", "commit", "device_sync")
"""The phases of one sync on one rank: ``begin`` (the receiver's), ``pack`` (copies into bucket
buffers), ``post`` (posting collectives), ``wait`` (waiting on them), ``stage`` (copying received
slices into staging), ``vote`` (the commit vote), ``commit`` (the receiver's apply), ``device_sync``."""


class Collectives:
    """Posts the collectives of one rank's syncs and waits on them, each wait bounded by
    ``timeout_s``; ``phases`` holds the seconds of the current (or last) sync by phase."""

    def __init__(self, *, timeout_s: float, stream_ordered: bool) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stream_ordered = stream_ordered
        """Per-bucket waits only order the current CUDA stream after the collective (NCCL); the host
        waits (with the timeout) once, on all of them, in ``drain``. Off (gloo): every wait blocks."""
        self.inflight: list[tuple[dist.Work, str, int]] = []
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def start(self) -> None:
        """A new sync: no collectives in flight, every phase at zero."""
        self.inflight = []
        self.phases = dict.fromkeys(PHASES, 0.0)

    def post(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> tuple[dist.Work, float]:
        """Post an asynchronous broadcast of ``tensor`` from ``src`` over ``group``; the work and the
        seconds posting took (counted as ``post``)."""
        t = time.perf_counter()
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        dt = time.perf_counter() - t
        self.phases["post"] += dt
        return work, dt

    def wait(self, work: dist.Work, what: str, *, poll: bool = False) -> None:
        """Block the host until ``work`` completes, at most ``timeout_s``.

        ``poll`` (NCCL works): ``Work.wait(timeout)`` checks completion once per millisecond
        (ProcessGroupNCCL), so a collective that ends microseconds after the call (the vote, the
        last bucket) would cost up to a millisecond; poll ``is_completed`` every ~50 us first (the
        sleep releases the GIL), for at most ``POLL_S``, then hand the rest of the timeout to it."""
        timeout = self.timeout
        try:
            if poll:
                t0 = time.perf_counter()
                end = t0 + min(POLL_S, timeout.total_seconds())
                while not work.is_completed():
                    if time.perf_counter() >= end:  # still running: the rest of the timeout
                        timeout = max(
                            timeout - datetime.timedelta(seconds=time.perf_counter() - t0),
                            datetime.timedelta(milliseconds=1),
                        )
                        break
                    time.sleep(POLL_INTERVAL_S)
            work.wait(timeout)
        except RuntimeError as e:
            raise PolicySyncError(f"{what}: {e}") from e

    def order(self, work: dist.Work, what: str, bucket: int) -> None:
        """What comes after this call (buffer reuse, staging, the fan-out) needs ``work`` done.
        Stream-ordered: the current CUDA stream waits for it and the host goes on (checked later by
        ``drain``); otherwise the host waits, at most ``timeout_s``."""
        if not self.stream_ordered:
            self.wait(work, what)
            return
        try:
            work.wait()
        except RuntimeError as e:
            raise PolicySyncError(f"{what}: {e}") from e
        self.inflight.append((work, what, bucket))

    def timed_wait(self, work: dist.Work, what: str, bucket: int) -> float:
        """``order`` ``work``; the seconds it took (counted as ``wait``)."""
        t = time.perf_counter()
        self.order(work, what, bucket)
        dt = time.perf_counter() - t
        self.phases["wait"] += dt
        return dt

    def drain(self) -> float:
        """Stream-ordered: host-wait (each at most ``timeout_s``) on every collective of this sync,
        so a rank votes "done" only once its data really moved. Returns the seconds waited."""
        t = time.perf_counter()
        inflight, self.inflight = self.inflight, []
        for work, what, bucket in inflight:
            try:
                self.wait(work, what, poll=True)
            except PolicySyncError as e:
                e.buckets_done = bucket
                raise
        dt = time.perf_counter() - t
        self.phases["wait"] += dt
        return dt
