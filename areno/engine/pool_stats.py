"""The rollout pool's accounting: its counters and per-batch figures, as ``rollout/*`` metrics."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from itertools import compress

import numpy as np

from areno.engine.staleness import StalenessManager
from areno.types import Trajectory

ALWAYS_REPORTED = (
    "dropped_stale",
    "aborted_stale",
    "failed_episodes",
    "dropped_failed",
    "refused_requests",
    "rejected",
    "reward_errors",
)
"""Counters reported (as 0) before they first count anything."""


def version_span(traj: Trajectory) -> tuple[int, int] | None:
    """(oldest, newest) policy version of the trajectory's model-generated tokens (``completion_mask``
    set, version >= 0); None when it has none. Computed once per trajectory, as its group finishes,
    by C-level passes (``compress``, ``count``, ``min``/``max``): never a Python step per token."""
    versions, mask = traj.versions, traj.completion_mask
    assert mask is not None  # Trajectory fills it
    if not (isinstance(mask, list) and mask.count(1) == len(mask)):
        versions = list(compress(versions, mask))  # the generated tokens' (truthy mask entries)
    elif not isinstance(versions, list):
        versions = list(versions)
    if not versions:
        return None
    first = versions[0]
    if versions.count(first) == len(versions):  # no weight swap mid-request: count is far cheaper than min/max
        oldest = newest = first
    else:
        oldest, newest = min(versions), max(versions)
    if newest < 0:
        return None
    if oldest < 0:  # generated tokens at -1 (another model's) beside the policy's: left out
        kept = np.asarray(versions, dtype=np.int64)
        oldest = kept[kept >= 0].min()
    return int(oldest), int(newest)


def group_min_version(group: list[Trajectory]) -> int | None:
    """Oldest policy version that produced any token of the group (None: no generated tokens)."""
    return spans_min_version(map(version_span, group))


def spans_min_version(spans: Iterable[tuple[int, int] | None]) -> int | None:
    """The oldest version of ``version_span``s (None: none of them has generated tokens)."""
    return min((span[0] for span in spans if span is not None), default=None)


class PoolStats:
    """Counters of episode outcomes (``counts``, shared with ``EpisodeAttempts``), the workers'
    busy time and the staleness of the last batch collected."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.counts: collections.Counter[str] = collections.Counter()
        self.busy_s = 0.0
        """Seconds the workers spent in episodes, summed over workers."""
        self.started_at: float | None = None
        """``time.monotonic()`` when the everlasting pool started (None: not started)."""
        self._last_batch: dict[str, float] = {}

    def record_batch(self, spans: Iterable[tuple[int, int] | None], version: int, *, wait_s: float) -> None:
        """The staleness of a collected batch against the current policy ``version``, from its
        trajectories' ``version_span``s (computed once, as each group finished)."""
        lags = []
        multi_version = 0
        for span in spans:
            if span is not None:
                lags.append(version - span[0])
                multi_version += span[0] != span[1]
        self._last_batch = {
            "rollout/wait_s": wait_s,
            "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags)) if lags else 0.0,
            "rollout/multi_version_frac": multi_version / len(lags) if lags else 0.0,
        }

    def metrics(self, version: int, staleness: StalenessManager | None, ready: int | None) -> dict[str, float]:
        """Cumulative counters (``rollout/<name>``), staleness of the last batch, pool state
        (``ready``: finished groups waiting for the trainer)."""
        out = {f"rollout/{name}": float(value) for name, value in sorted(self.counts.items())}
        for name in ALWAYS_REPORTED:
            out.setdefault(f"rollout/{name}", 0.0)
        out.update(self._last_batch)
        out["rollout/version"] = float(version)
        if staleness is not None:
            snap = staleness.snapshot()
            out["rollout/running"] = float(snap["running"])
            out["rollout/ready"] = float(ready)
        if self.started_at is not None:
            elapsed = max(time.monotonic() - self.started_at, 1e-9)
            out["rollout/worker_busy_frac"] = min(1.0, self.busy_s / (elapsed * self.num_workers))
        return out
