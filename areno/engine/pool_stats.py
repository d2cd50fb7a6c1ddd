"""The rollout pool's accounting: its counters and per-batch figures, as ``rollout/*`` metrics."""

from __future__ import annotations

import collections
import time

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


def trained_versions(traj: Trajectory) -> list[int]:
    """Policy versions of the model-generated tokens of a trajectory."""
    return [v for v, m in zip(traj.versions, traj.completion_mask) if m and v >= 0]


def group_min_version(group: list[Trajectory]) -> int | None:
    """Oldest policy version that produced any token of the group (None: no generated tokens)."""
    versions = [min(vs) for vs in map(trained_versions, group) if vs]
    return min(versions) if versions else None


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

    def record_batch(self, groups: list[list[Trajectory]], version: int, *, wait_s: float) -> None:
        """The staleness of a collected batch against the current policy ``version``."""
        lags = []
        multi_version = 0
        for group in groups:
            for traj in group:
                versions = trained_versions(traj)
                if versions:
                    lags.append(version - min(versions))
                    multi_version += len(set(versions)) > 1
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
