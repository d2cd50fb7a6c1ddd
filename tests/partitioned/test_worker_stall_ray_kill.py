"""``RayScheduler.kill_worker``: a stopped actor (``kill -STOP``, as a deadlocked worker) is killed, its call in
flight fails at once with ``WorkerDiedError``, and its process is gone: the stall watch's kill on Ray."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("ray")

from areno.launch.ray_scheduler import RayScheduler
from areno.launch.scheduler import WorkerDiedError
from tests.helpers.launch_workers import alive


@pytest.mark.slow  # Ray's start: 10-20 s
def test_a_stopped_ray_worker_is_killed_and_its_call_fails_at_once():
    with RayScheduler(cpus_per_worker=0.5, num_cpus=2) as sched:
        (handle,) = sched.create_workers(
            "rollout", "tests.helpers.launch_workers:GradWorker", 1, env={"OMP_NUM_THREADS": "1"}, args=(3,)
        )
        os.kill(handle.pid, signal.SIGSTOP)
        waiting = sched.submit_one("rollout", 0, "count")  # never answered by a stopped process
        t0 = time.monotonic()
        sched.kill_worker("rollout", 0)
        with pytest.raises(WorkerDiedError, match=r"rollout\[0\] \(pid \d+ on \S+\) died during count"):
            waiting.result(timeout=10)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 30
        while alive(handle.pid):  # Ray sends SIGKILL once the actor does not exit by itself
            assert time.monotonic() < deadline, f"pid {handle.pid} still alive"
            time.sleep(0.1)
