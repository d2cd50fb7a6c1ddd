"""The everlasting pool reads each finished group's policy versions once, as the group finishes: not at
every wake-up of ``wait_batch`` (a per-token scan of every queued group, under the results lock) nor
again in ``record_batch``. Its staleness decisions and figures are those of the per-token scan."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from areno.engine.executor import WorkflowExecutor
from areno.engine.pool_stats import PoolStats, group_min_version, version_span
from areno.engine.staleness import StalenessManager
from areno.types import Trajectory
from areno.workflows.base import RolloutWorkflow


# ---- the per-token scan the pool used: the reference
def ref_trained_versions(traj: Trajectory) -> list[int]:
    return [v for v, m in zip(traj.versions, traj.completion_mask) if m and v >= 0]


def ref_group_min_version(group: list[Trajectory]) -> int | None:
    versions = [min(vs) for vs in map(ref_trained_versions, group) if vs]
    return min(versions) if versions else None


def ref_batch_figures(groups: list[list[Trajectory]], version: int) -> dict[str, float]:
    lags, multi = [], 0
    for group in groups:
        for traj in group:
            versions = ref_trained_versions(traj)
            if versions:
                lags.append(version - min(versions))
                multi += len(set(versions)) > 1
    return {
        "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "rollout/staleness_max": float(max(lags)) if lags else 0.0,
        "rollout/multi_version_frac": multi / len(lags) if lags else 0.0,
    }


def batch_figures(groups: list[list[Trajectory]], version: int) -> dict[str, float]:
    stats = PoolStats(1)
    stats.record_batch([version_span(t) for g in groups for t in g], version, wait_s=0.0)
    return {k: v for k, v in stats.metrics(version, None, None).items() if k in ref_batch_figures([], 0)}


def random_trajectory(rng: random.Random) -> Trajectory:
    """Masks of ones, of 0/1/True/2, all zeros; versions of one value (small or past the cached ints),
    mixed, -1 on generated tokens; lists, tuples and numpy arrays; empty completions."""
    n = rng.choice([0, 1, 2, 7, 40])
    mask_kind, version_kind = rng.randrange(4), rng.randrange(4)
    mask = [
        [1] * n,
        [rng.choice([0, 1, True, 2]) for _ in range(n)],
        [0] * n,
        [True] * n,
    ][mask_kind]
    one = rng.choice([0, 3, 300, 10**6])
    versions = [
        [one] * n,
        [rng.choice([-1, 2, 5, 700]) for _ in range(n)],
        [-1] * n,
        sorted(rng.choice([4, 5, 6]) for _ in range(n)),
    ][version_kind]
    container = rng.choice([list, tuple, np.asarray])
    return Trajectory(
        prompt_ids=[1, 2],
        completion_ids=[7] * n,
        logprobs=[-0.5] * n,
        versions=container(versions) if n else versions,
        completion_mask=mask,
        reward=0.0,
    )


@pytest.mark.parametrize("seed", range(6))
def test_spans_give_the_per_token_scan_decisions_and_figures(seed):
    rng = random.Random(seed)
    groups = [[random_trajectory(rng) for _ in range(rng.choice([1, 2, 4]))] for _ in range(40)]
    for group in groups:
        assert group_min_version(group) == ref_group_min_version(group)
        for traj in group:
            span, versions = version_span(traj), ref_trained_versions(traj)
            assert span == ((min(versions), max(versions)) if versions else None)
    for version in (0, 6, 1000):
        assert batch_figures(groups, version) == ref_batch_figures(groups, version)
    assert batch_figures([], 3) == ref_batch_figures([], 3)


class CountingList(list):
    """Versions that count the passes over them."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


class GivenGroups(RolloutWorkflow):
    """Sample {"id", "versions": [...], "masks": [...]} -> that group, versions as ``CountingList``s."""

    def __init__(self):
        self.made: list[Trajectory] = []

    async def run_episode(self, client, sample):
        group = []
        for versions, mask in zip(sample["versions"], sample["masks"]):
            n = len(versions)
            traj = Trajectory(
                prompt_ids=[1],
                completion_ids=[5] * n,
                logprobs=[-0.1] * n,
                versions=CountingList(versions),
                completion_mask=mask,
                reward=0.0,
                group_id=str(sample["id"]),
            )
            group.append(traj)
        self.made += group
        return group


def wait_ready(ex: WorkflowExecutor, n: int) -> None:
    deadline = time.monotonic() + 30
    while ex.metrics()["rollout/ready"] < n:
        assert time.monotonic() < deadline, f"{ex.metrics()['rollout/ready']} of {n} groups finished in 30 s"
        time.sleep(0.005)


def test_each_trajectory_is_scanned_once_however_often_the_queue_is():
    """Every ``wait_batch`` call (and every wake-up in one) looks at every queued group; with eight
    groups queued and collected one at a time, the last was scanned nine times."""
    n = 8
    rows = [{"id": i, "versions": [[0] * 30 + [1] * 30, [1] * 60], "masks": [[1] * 60, [1] * 60]} for i in range(n)]
    wf = GivenGroups()
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=n, max_concurrent=n)
    with WorkflowExecutor(None, wf, iter(rows), staleness, num_workers=n) as ex:
        ex.start()
        wait_ready(ex, n)
        collected = []
        for _ in range(n):
            (group,) = ex.wait_batch(1, timeout=30)
            collected.append((group, {k: ex.metrics()[k] for k in ref_batch_figures([], 0)}))
    assert len(wf.made) == 2 * n
    assert max(t.versions.passes for t in wf.made) <= 2  # was up to n + 1 (here min and max: 2)
    assert all(got == ref_batch_figures([group], 0) for group, got in collected)  # the reference scans too
    assert collected[0][1]["rollout/multi_version_frac"] == 0.5


def test_stale_groups_dropped_as_by_the_per_token_scan():
    """At version 2 with η = 0 the groups whose oldest generated token is older are dropped; masked
    tokens and tokens at -1 do not count, and a group without generated tokens is kept."""
    groups = {
        "old": ([[2, 2, 1], [2, 2, 2]], [[1, 1, 1], [1, 1, 1]]),
        "new": ([[2, 2], [2, 3]], [[1, 1], [1, 1]]),
        "masked old": ([[0, 2, 2]], [[0, 1, 1]]),
        "teacher": ([[-1, -1, 2]], [[1, 1, 1]]),
        "none generated": ([[0, 0]], [[0, 0]]),
        "masked new, generated old": ([[3, 1]], [[0, True]]),
    }
    rows = [{"id": name, "versions": v, "masks": m} for name, (v, m) in groups.items()]
    wf = GivenGroups()
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=len(rows), max_concurrent=len(rows))
    # max_retries=0: a dropped group is not generated again (its rows' versions are fixed: it would be dropped
    # again, as often as the timing allows)
    with WorkflowExecutor(None, wf, iter(rows), staleness, num_workers=len(rows), max_retries=0) as ex:
        ex.start()
        wait_ready(ex, len(rows))
        ex.set_version(2)
        kept = ex.wait_batch(len(rows), timeout=30)
        metrics = ex.metrics()
    by_name = {}
    for traj in wf.made:
        by_name.setdefault(traj.group_id, []).append(traj)
    want_kept = sorted(name for name, g in by_name.items() if not (ref_group_min_version(g) or 2) < 2)
    assert sorted(g[0].group_id for g in kept) == want_kept == ["masked old", "new", "none generated", "teacher"]
    assert metrics["rollout/dropped_stale"] == 2 and metrics["rollout/dropped_stale_trajectories"] == 3
    want = ref_batch_figures(kept, 2)
    assert {k: metrics[k] for k in want} == want
