"""What the run says when partitioned workers fail or start slowly: the worker that died first (not the
one whose collective then broke), the connect timeout's setting and each missing worker's process, a CPU
placement with more processes than cores, worker logs started afresh or appended to, the health warning of
a run with one server, and a workflow that raises in its own code named as the cause of dropped samples."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import re

import pytest

from areno.api.config import load_config
from areno.engine.episodes import EpisodeAttempts, EpisodeTask
from areno.engine.executor import RolloutPoolBroken, WorkflowExecutor
from areno.engine.partitioned import PartitionedCluster, WorkerLostError, cpu_oversubscription
from areno.launch.scheduler import LocalScheduler, WorkerDiedError, WorkerError, WorkerHandle, usable_cores
from areno.rollout.client import MultiServerRolloutClient, RolloutRequestTimeout
from areno.rollout.health import HealthMonitor
from areno.workflows.base import RolloutWorkflow
from tests.helpers.configs import tiny_run_overrides


def _done(value=None, error: BaseException | None = None) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class _World:
    """A scheduler's answers for train[0] (alive) and rollout[0..1] (rollout[1] dead)."""

    roles = ["train", "rollout"]

    def workers(self, role):
        n = 1 if role == "train" else 2
        return [
            WorkerHandle(
                role=role, index=i, rank=i, world_size=3, pid=100 + i, host="h", log_path=f"/logs/{role}-{i}.log"
            )
            for i in range(n)
        ]

    def submit_one(self, role, index, target, *args):
        if (role, index) == ("rollout", 1):
            return _done(error=WorkerDiedError("rollout[1] (pid 101 on h) died during pid (EOFError)"))
        return _done(7)


def test_a_collective_broken_by_a_dead_worker_names_the_dead_one(tmp_path):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "cluster.allocation_mode=areno:d2+fsdp:d1"])
    cluster = PartitionedCluster(cfg, tmp_path / "run", scheduler=_World())
    glhf = WorkerError(
        "train[0] (pid 100 on h; log /logs/train-0.log) save_role raised RuntimeError: [gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:6061: Connection reset by peer. GLHF!"
    )
    failed = [_done(error=glhf), _done(None), _done(None)]
    with pytest.raises(WorkerLostError) as info:
        cluster.gather(failed, "a checkpoint save")
    err = info.value
    assert str(err) == (
        "rollout[1] (pid 101) died; the distributed world cannot be re-formed in place: start it again (no checkpoint "
        "yet) (log: /logs/rollout-1.log)"
    )
    assert err.training_side_intact and err.in_flight == "a checkpoint save" and err.__cause__ is glhf


def test_a_connect_timeout_names_its_setting_and_each_workers_process(tmp_path):
    with LocalScheduler(log_dir=str(tmp_path), connect_timeout_s=0.05) as sched:
        with pytest.raises(WorkerError) as info:
            sched.create_workers("w", "tests.helpers.launch_workers:EnvWorker", 2)
    message = str(info.value)
    assert re.search(r"w\[0\] \(pid \d+, still running, log .*w-0\.log\)", message), message
    assert "did not connect within 0s (cluster.scheduler_options.connect_timeout_s)" in message
    assert f"{usable_cores()} cores here for 2 worker processes" in message


def test_more_cpu_worker_processes_than_cores_is_warned_about(tmp_path):
    cores = usable_cores()
    d = cores  # train d + rollout d: twice the cores
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), f"cluster.allocation_mode=areno:d{d}+fsdp:d{d}"])
    layout = PartitionedCluster(cfg, tmp_path / "run", scheduler=object()).layout
    warning = cpu_oversubscription(cfg, layout)
    assert warning is not None
    assert f"starts {2 * d} worker processes ({d} training, {d} rollout)" in warning and f"on {cores} cores" in warning
    assert "connect_timeout_s=120 s" in warning and "areno:d1+fsdp:d1" in warning
    if cores >= 2:
        small = load_config(None, [*tiny_run_overrides(tmp_path), "cluster.allocation_mode=areno:d1+fsdp:d1"])
        assert cpu_oversubscription(small, PartitionedCluster(small, tmp_path / "r", scheduler=object()).layout) is None


def test_worker_logs_start_afresh_or_are_appended_to_after_a_separator(tmp_path):
    for fresh in (True, False):
        log = tmp_path / "w-0.log"
        log.write_text("an older run's lines\n")
        with LocalScheduler(log_dir=str(tmp_path)) as sched:
            sched.fresh_logs = fresh
            (pid,) = [h.pid for h in sched.create_workers("w", "tests.helpers.launch_workers:EnvWorker", 1)]
        text = log.read_text()
        assert ("an older run's lines" in text) is not fresh
        assert ("this worker starts again" in text) is not fresh
        header = next(line for line in text.splitlines() if line.startswith("==== areno worker"))
        assert header.startswith(f"==== areno worker w[0] rank 0 of 1, pid {pid} on ")
        assert "RuntimeWarning" not in text


def test_the_health_warning_says_what_happens_with_one_server(caplog):
    url = "http://127.0.0.1:9"
    monitor = HealthMonitor([url], max_misses=2, lost_after_s=60)
    with caplog.at_level(logging.WARNING, logger="areno.rollout.health"):
        monitor.report_failure(url, "no answer")
        monitor.report_failure(url, "no answer")
    assert "other servers" not in caplog.text
    assert (
        "it is the only rollout server: no request is sent (requests in flight there wait, each up to "
        "rollout.request_timeout_s) until a server answers /health again; if it gives no answer for 60 s it is "
        "declared lost and the run stops"
    ) in caplog.text
    assert monitor.silent_for(url) >= 0


def test_a_request_timeout_on_the_only_unhealthy_server_is_not_requeued_onto_it(caplog):
    url = "http://127.0.0.1:9"
    monitor = HealthMonitor([url], max_misses=1)
    monitor.report_failure(url, "no answer")
    client = MultiServerRolloutClient([url], health=monitor)

    class TimesOut(RolloutWorkflow):
        async def run_episode(self, client, sample):
            raise RolloutRequestTimeout(server=url, request_id="r", timeout_s=600, prompt_tokens=3, max_new_tokens=4)

    attempts = EpisodeAttempts(
        client, TimesOut(), runner=None, max_retries=1, episode_timeout_s=None, counts=collections.Counter()
    )
    with caplog.at_level(logging.WARNING, logger="areno.engine.episodes"):
        status, _ = asyncio.run(attempts.arun(EpisodeTask(0, {"prompt": "p"})))
    assert status == "retry"
    assert "not re-queueing dataset" in caplog.text
    assert f"onto an unhealthy server ({url} is the only rollout server)" in caplog.text


class RaisesInItsOwnCode(RolloutWorkflow):
    async def run_episode(self, client, sample):
        return {"reward": 1}["answer"]  # a KeyError raised here, in the workflow's file


class RaisesInAreno(RolloutWorkflow):
    async def run_episode(self, client, sample):
        return await client.agenerate([1], None)  # the (broken) client raises, in areno's code


def test_samples_dropped_by_a_workflow_raising_in_its_own_code_name_the_workflow():
    with WorkflowExecutor(None, RaisesInItsOwnCode(), max_retries=0) as ex:
        with pytest.raises(RolloutPoolBroken) as info:
            ex.rollout_batch([{"prompt": "p"}])
    assert str(info.value).endswith(
        "rollout.workflow RaisesInItsOwnCode.run_episode raised it in its own code, not the data or the rollout "
        "side: fix it"
    )
    client = MultiServerRolloutClient(["http://127.0.0.1:9"], request_timeout_s=1, max_failures_per_server=1)
    with WorkflowExecutor(client, RaisesInAreno(), max_retries=0) as ex:
        with pytest.raises(RolloutPoolBroken) as info:
            ex.rollout_batch([{"prompt": "p"}])
    assert "the rollout side is failing" in str(info.value) and "RaisesInAreno" not in str(info.value)
