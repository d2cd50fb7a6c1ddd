"""``cluster.worker_stall_s``: the key and its checks, ``ARENO_WORKER_STALL_S`` overriding it (said once), the
stall watch judging by it; and a worker the watcher's thread declared lost first, on a scheduler that cannot
kill it, failing the policy sync at once while the emergency save of the training ranks alone still runs."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import pytest

from areno.api.config import load_config
from areno.engine.partitioned import STALL_ENV, PartitionedCluster, WorkerLostError, stall_setting
from areno.engine.remote import RemoteRolloutSide, RemoteTrainingSide
from areno.engine.seams import WeightKind, WeightUpdate
from areno.errors import ConfigError
from areno.launch.scheduler import Scheduler, WorkerHandle
from tests.helpers.configs import tiny_run_overrides

PARTITIONED = "cluster.allocation_mode=areno:d1+fsdp:d1"
URL = "http://rollout-0:8000"


def _config(tmp_path, *extra: str):
    return load_config(None, [*tiny_run_overrides(tmp_path), PARTITIONED, *extra])


@pytest.fixture(autouse=True)
def _no_stall_env(monkeypatch):
    monkeypatch.delenv(STALL_ENV, raising=False)


def test_the_key_defaults_to_60_s_and_refuses_a_negative_a_non_finite_or_a_misspelt_one(tmp_path):
    assert _config(tmp_path).cluster.worker_stall_s == 60
    assert _config(tmp_path, "cluster.worker_stall_s=0").cluster.worker_stall_s == 0  # never
    for value, message in (("-1", "must be >= 0 seconds"), ("inf", "must be a finite number")):
        with pytest.raises(ConfigError, match=rf"^cluster\.worker_stall_s: {message}") as info:
            _config(tmp_path, f"cluster.worker_stall_s={value}")
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="worker_stall_s"):  # the closest key named
        _config(tmp_path, "cluster.worker_stal_s=5")


def test_the_environment_variable_overrides_the_key_and_the_watch_says_so(tmp_path, monkeypatch, caplog):
    cfg = _config(tmp_path, "cluster.worker_stall_s=30")
    assert stall_setting(cfg) == (30.0, "cluster.worker_stall_s")
    monkeypatch.setenv(STALL_ENV, "4")
    assert stall_setting(cfg) == (4.0, STALL_ENV)
    cluster = PartitionedCluster(cfg, tmp_path / "run", scheduler=_World())
    assert cluster.stall_s == 4
    with caplog.at_level(logging.WARNING, logger="areno.engine.partitioned"):
        cluster.watch_health(_Health(), [URL])
    assert [r.getMessage() for r in caplog.records] == [
        "ARENO_WORKER_STALL_S=4 overrides cluster.worker_stall_s=30: a rollout worker is declared lost after 4 s "
        "without a /health answer"
    ]
    for bad in ("soon", "-1", "inf"):
        monkeypatch.setenv(STALL_ENV, bad)
        with pytest.raises(ConfigError) as info:
            PartitionedCluster(cfg, tmp_path / "run", scheduler=_World())
        assert str(info.value) == (
            f"ARENO_WORKER_STALL_S={bad!r}: must be a finite number of seconds >= 0 (0: never); or unset it and set "
            "cluster.worker_stall_s"
        )


def test_the_watch_declares_a_silent_worker_lost_after_the_keys_seconds(tmp_path, caplog):
    cluster, health = _watched(tmp_path, "cluster.worker_stall_s=5")
    health.silent_s = 3.0  # past half: warned about, not lost
    with caplog.at_level(logging.WARNING, logger="areno.engine.partitioned"):
        assert cluster.check_stalls() == []
    assert "if it does not answer within 5 s of its last answer (cluster.worker_stall_s)" in caplog.text
    health.silent_s = 6.0
    (why,) = cluster.check_stalls()
    assert why.startswith(f"rollout[0] (pid 11) stopped answering: its server {URL} gave no /health answer for 6 s")
    assert "killed after cluster.worker_stall_s=5" in why
    never, health = _watched(tmp_path, "cluster.worker_stall_s=0")
    health.silent_s = 1e6
    assert never.check_stalls() == []


def test_a_sync_fails_at_once_on_a_worker_the_watcher_declared_lost_first(tmp_path):
    cluster, health = _watched(tmp_path, "cluster.worker_stall_s=5")
    health.silent_s = 6.0
    cluster.check_stalls()  # the watcher's thread: rollout[0] declared lost, but this scheduler cannot kill it
    assert cluster.scheduler.kills == [("rollout", 0)]
    update = WeightUpdate(
        version=3, kind=WeightKind.COLLECTIVE, sending=tuple(cluster.scheduler.submit("train", "sync"))
    )
    t0 = time.monotonic()
    err = _raised_within(lambda: RemoteRolloutSide(cluster).update_weights(update), timeout_s=30)
    # not cluster.sync_timeout_s (the stalled worker never answers), nor the 5 s of a probe of it
    assert time.monotonic() - t0 < 4
    assert isinstance(err, WorkerLostError), err
    assert str(err).startswith("rollout[0] (pid 11) stopped answering: ") and "\n" not in str(err)
    assert err.training_side_intact and err.in_flight == "the policy sync"


def test_the_emergency_save_of_the_training_ranks_alone_still_runs(tmp_path):
    cluster, health = _watched(tmp_path, "cluster.worker_stall_s=5")
    health.silent_s = 6.0
    cluster.check_stalls()
    t0 = time.monotonic()
    err = _raised_within(lambda: RemoteTrainingSide(cluster).save(tmp_path / "ckpt", {"rollout_id": 1}), timeout_s=30)
    assert err is None, err
    # 4 calls answered in 0.05 s each; waiting on the stalled worker would take a probe's 5 s at least
    assert time.monotonic() - t0 < 4
    assert cluster.scheduler.calls("train") == ["pid", "pid", "trainable_roles", "save_role_alone"]
    assert cluster.scheduler.calls("rollout") == []  # nothing waits on the stalled worker


# ---------------------------------------------------------------------------------------------- fakes


class _World(Scheduler):
    """train[0] answers every call within 0.05 s; rollout[0] is stalled (its calls never answer) and this
    scheduler cannot kill it, as on one without ``kill_worker``."""

    def __init__(self) -> None:
        self.kills: list[tuple[str, int]] = []
        self._calls: list[tuple[str, str]] = []

    roles = ["train", "rollout"]

    def workers(self, role):
        pid = 10 if role == "train" else 11
        rank = 0 if role == "train" else 1
        return [WorkerHandle(role=role, index=0, rank=rank, world_size=2, pid=pid, host="elsewhere", log_path=None)]

    def submit_one(self, role, index, target, *args, **kwargs):
        future = concurrent.futures.Future()
        if role == "train":  # answered soon, not at once: a save takes a while, and is waited for
            self._calls.append((role, target))
            answer = {"pid": 10, "trainable_roles": ["actor"]}.get(target, {})
            threading.Timer(0.05, future.set_result, (answer,)).start()
        elif target != "pid":
            self._calls.append((role, target))
        return future

    def calls(self, role):
        return [target for r, target in self._calls if r == role]

    def kill_worker(self, role, index):
        self.kills.append((role, index))
        raise NotImplementedError("this scheduler cannot kill one worker")

    def create_roles(self, specs):
        raise AssertionError("launched by the test")

    def restart_worker(self, role, index):
        raise AssertionError("never restarted")

    def shutdown(self):
        pass


class _Health:
    """A ``HealthMonitor``'s answers: the one server unhealthy once ``silent_s`` is set."""

    silent_s = 0.0

    def is_healthy(self, url):
        return self.silent_s == 0

    def silent_for(self, url):
        return self.silent_s


def _watched(tmp_path, *extra: str) -> tuple[PartitionedCluster, _Health]:
    cluster = PartitionedCluster(_config(tmp_path, *extra), tmp_path / "run", scheduler=_World())
    health = _Health()
    cluster.watch_health(health, [URL])
    return cluster, health


def _raised_within(call, timeout_s: float) -> BaseException | None:
    """What ``call()`` raised (None: it returned), run in a thread so that a wait that never ends fails
    the test instead of hanging it."""
    out: list[BaseException | None] = []

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)
        else:
            out.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert out, f"still waiting after {timeout_s} s"
    return out[0]
