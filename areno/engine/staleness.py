"""Admission control for asynchronous rollout (the StalenessManager of the everlasting pool).

Counts are in *samples* (one dataset row = one episode = one group of trajectories), the unit a
trainer step consumes ``batch_size`` of. With policy version ``v`` (the number of weight updates
the rollout engine has taken) and ``η = max_head_offpolicyness``:

    capacity = min(max_concurrent − running,
                   (η + v + 1) · batch_size − (accepted + running))

The second term bounds how far generation may run ahead of training: everything ever accepted or
still running must fit in the batches of versions ``v … v + η``, so no admitted sample starts more
than η versions before the step that trains on it. η = 0 is the synchronous algorithm (exactly one
batch is produced per version).
"""

from __future__ import annotations

import threading


class StalenessManager:
    """Thread-safe counters and the capacity formula above."""

    def __init__(self, max_head_offpolicyness: int, batch_size: int, max_concurrent: int) -> None:
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.max_head_offpolicyness = max_head_offpolicyness
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self._version = 0
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return self._running

    @property
    def accepted(self) -> int:
        return self._accepted

    def set_version(self, version: int) -> None:
        with self._lock:
            if version < self._version:
                raise ValueError(f"policy version went backwards: {self._version} -> {version}")
            self._version = version

    def capacity(self) -> int:
        """How many more samples may start now (can be negative after a drop in batch size)."""
        with self._lock:
            return self._capacity_locked()

    def _capacity_locked(self) -> int:
        eta, v, bs = self.max_head_offpolicyness, self._version, self.batch_size
        concurrency_room = self.max_concurrent - self._running
        staleness_room = (eta + v + 1) * bs - (self._accepted + self._running)
        return min(concurrency_room, staleness_room)

    def try_submit(self) -> bool:
        """Atomically: if capacity > 0, count one more running sample and return True."""
        with self._lock:
            if self._capacity_locked() <= 0:
                return False
            self._running += 1
            return True

    def on_submit(self) -> None:
        """Count a sample that started (callers that checked ``capacity()`` themselves)."""
        with self._lock:
            self._running += 1

    def on_accept(self) -> None:
        """A running sample finished and its trajectories go to the trainer."""
        with self._lock:
            assert self._running > 0, "on_accept without a running sample"
            self._running -= 1
            self._accepted += 1

    def on_reject(self) -> None:
        """A running sample finished without trajectories (rejected, or failed): its slot is freed."""
        with self._lock:
            assert self._running > 0, "on_reject without a running sample"
            self._running -= 1
            self._rejected += 1

    def on_drop_accepted(self) -> None:
        """An accepted sample was dropped at collection (too stale): a replacement may start."""
        with self._lock:
            assert self._accepted > 0, "on_drop_accepted without an accepted sample"
            self._accepted -= 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "version": self._version,
                "running": self._running,
                "accepted": self._accepted,
                "rejected": self._rejected,
                "capacity": self._capacity_locked(),
            }
