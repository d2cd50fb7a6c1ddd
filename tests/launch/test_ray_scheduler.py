"""RayScheduler: bad addresses fail fast in one line; 2 CPU actors give the LocalScheduler's numbers."""

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from areno.launch.factory import scheduler_from_config  # noqa: E402
from areno.launch.ray_scheduler import RayScheduler  # noqa: E402
from areno.launch.scheduler import (  # noqa: E402
    LocalScheduler,
    SchedulerError,
    WorkerDiedError,
    WorkerError,
    free_port,
)
from tests.helpers.launch_workers import local_gradient  # noqa: E402

WORKER = "tests.helpers.launch_workers:GradWorker"
ENV = {"OMP_NUM_THREADS": "1"}


def test_address_that_refuses_fails_before_ray_init():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(SchedulerError, match=rf"Ray address '{address}' does not answer \(UNAVAILABLE"):
        scheduler_from_config({"type": "ray", "ray_address": address, "ray_connect_timeout_s": 2})
    assert not ray.is_initialized()


def test_address_that_is_silent_times_out_quickly():
    start = time.monotonic()
    # 10.255.255.1 is unroutable; where a proxy accepts every connection it answers with HTTP 404
    with pytest.raises(SchedulerError, match=r"Ray address 'ray://10\.255\.255\.1:10001' does not answer \(\w+: .*\)"):
        RayScheduler(address="ray://10.255.255.1:10001", connect_timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert not ray.is_initialized()


def test_malformed_address():
    with pytest.raises(ValueError, match="must be 'auto', 'host:port' or 'ray://host:port'"):
        RayScheduler(address="nohost", connect_timeout_s=0.5)


@pytest.mark.slow
def test_ray_and_local_compute_the_same_allreduce(tmp_path):
    with LocalScheduler(log_dir=str(tmp_path)) as local:
        local.create_workers("actor", WORKER, 2, env=ENV, args=(3,))
        local.call("actor", "init_dist")
        local_result = local.call("actor", "allreduced_gradient")

    with RayScheduler(cpus_per_worker=0.5, num_cpus=2) as sched:
        handles = sched.create_workers("actor", WORKER, 2, env=ENV, args=(3,))
        assert [h.rank for h in handles] == [0, 1]
        assert sched.call("actor", "env", "RANK") == ["0", "1"]
        assert sched.call("actor", "env", "WORLD_SIZE") == ["2", "2"]
        assert sched.call("actor", "init_dist") == [(0, 2), (1, 2)]
        ray_result = sched.call("actor", "allreduced_gradient")
        assert ray_result == local_result  # bit-identical across schedulers
        expected_D = local_gradient(3, 0) + local_gradient(3, 1)
        torch.testing.assert_close(torch.tensor(ray_result[0], dtype=torch.float64), expected_D)

        with pytest.raises(WorkerError, match=r"actor\[1\] .* fail raised ValueError: nope"):
            sched.submit_one("actor", 1, "fail", "nope").result()
        pids = sched.call("actor", "pid")
        assert sched.call("actor", "count") == [1, 1]
        with pytest.raises(WorkerDiedError, match=r"actor\[1\] .* died during crash"):
            sched.submit_one("actor", 1, "crash").result()
        handle = sched.restart_worker("actor", 1)
        assert handle.pid != pids[1]
        assert sched.call("actor", "count") == [2, 1]
        assert sched.submit_one("actor", 1, "env", "RANK").result() == "1"
    assert not ray.is_initialized()


def test_auto_without_a_cluster(monkeypatch):
    import os

    if os.path.exists("/tmp/ray/ray_current_cluster"):
        pytest.skip("a `ray start --head` cluster runs on this machine")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SchedulerError, match="ray_address='auto' but no Ray cluster runs on this machine"):
        RayScheduler(address="auto", connect_timeout_s=0.5)


_CLUSTER = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""

_DRIVER = """
import json, sys
from areno.launch.ray_scheduler import RayScheduler
with RayScheduler(address=sys.argv[1], cpus_per_worker=0.5) as sched:
    sched.create_workers("actor", "tests.helpers.launch_workers:GradWorker", 2, env={"OMP_NUM_THREADS": "1"}, args=(5,))
    sched.call("actor", "init_dist")
    print(json.dumps(sched.call("actor", "allreduced_gradient")))
"""


@pytest.mark.slow
def test_joins_an_existing_cluster_by_address():
    """A Ray cluster owned by another process (as after `ray start --head`), joined by its GCS address
    from a fresh driver. Ray reads RAY_AUTH_MODE once per process, hence the subprocesses: local
    clusters of Ray >= 2.50 use token auth, and joining without the mode set is a one-line error."""
    import json
    import os
    import subprocess
    import sys

    from areno.launch.scheduler import python_path_env

    owner = subprocess.Popen([sys.executable, "-c", _CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = owner.stdout.readline().strip()
        assert address, "the cluster process did not print its address"

        def drive(auth_mode: str) -> subprocess.CompletedProcess:
            env = {**os.environ, "RAY_AUTH_MODE": auth_mode, "PYTHONPATH": python_path_env()}
            return subprocess.run([sys.executable, "-c", _DRIVER, address], capture_output=True, text=True, env=env)

        refused = drive("disabled")
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"areno.launch.scheduler.SchedulerError: cannot join the Ray cluster at '{address}'")
        assert "RAY_AUTH_MODE=token" in last

        joined = drive("token")
        assert joined.returncode == 0, joined.stderr[-2000:]
        got = json.loads(joined.stdout.strip().splitlines()[-1])
        torch.testing.assert_close(
            torch.tensor(got[1], dtype=torch.float64), local_gradient(5, 0) + local_gradient(5, 1)
        )
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)
