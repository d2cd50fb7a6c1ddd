"""LocalScheduler: 2 CPU workers, gloo all-reduce, errors, restart, storage probe (one scheduler)."""

import asyncio

import pytest
import torch

from areno.launch.factory import scheduler_from_config
from areno.launch.scheduler import (
    LocalScheduler,
    SchedulerConfig,
    WorkerDiedError,
    WorkerError,
)
from areno.launch.storage import StorageCheckError, check_shared_storage
from tests.helpers.launch_workers import local_gradient

WORKER = "tests.helpers.launch_workers:GradWorker"
ENV_WORKER = "tests.helpers.launch_workers:EnvWorker"
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    s = scheduler_from_config({"type": "local", "log_dir": str(tmp_path_factory.mktemp("logs"))})
    assert isinstance(s, LocalScheduler)
    s.create_workers("actor", WORKER, 2, env=ENV, args=(7,))
    yield s
    s.shutdown()


def test_rendezvous_env(sched):
    ports = sched.call("actor", "env", "MASTER_PORT")
    assert ports[0] == ports[1] and ports[0].isdigit()
    assert sched.call("actor", "env", "MASTER_ADDR") == ["127.0.0.1"] * 2
    assert sched.call("actor", "env", "RANK") == ["0", "1"]
    assert sched.call("actor", "env", "WORLD_SIZE") == ["2", "2"]
    assert sched.call("actor", "env", "LOCAL_RANK") == ["0", "1"]
    assert [h.rank for h in sched.workers("actor")] == [0, 1]


def test_gloo_allreduce_matches_in_process_sum(sched):
    assert sched.call("actor", "init_dist") == [(0, 2), (1, 2)]
    expected_D = local_gradient(7, 0) + local_gradient(7, 1)
    futures = sched.submit("actor", "allreduced_gradient")
    got = [f.result(timeout=60) for f in futures]
    assert got[0] == got[1]
    torch.testing.assert_close(torch.tensor(got[0], dtype=torch.float64), expected_D, rtol=1e-12, atol=1e-12)
    # the coroutine form gives the same answer
    assert asyncio.run(sched.acall("actor", "allreduced_gradient")) == got


def test_calls_are_ordered_per_worker(sched):
    before = sched.call("actor", "count")
    assert sched.call_each("actor", "count", [(), ()]) == [before[0] + 1, before[1] + 1]


def test_remote_error_names_worker(sched):
    # both workers raise; call() raises the first failure to arrive (fail-fast gather)
    with pytest.raises(WorkerError, match=r"actor\[[01]\] \(pid \d+ on .*\) fail raised ValueError: boom") as info:
        sched.call("actor", "fail", "boom")
    assert "ValueError: boom" in info.value.remote_traceback


def test_storage_probe_ok_and_failures(sched, tmp_path):
    check_shared_storage([str(tmp_path / "ckpt"), str(tmp_path / "data")], sched)
    assert not (tmp_path / "ckpt" / ".areno-storage-probe").exists() or not any(
        (tmp_path / "ckpt" / ".areno-storage-probe").iterdir()
    )
    # fsspec's memory:// lives in each process: exactly what a node-local path looks like
    with pytest.raises(StorageCheckError) as info:
        check_shared_storage(["memory://bucket/ckpt"], sched)
    msg = str(info.value)
    assert "node " in msg and "(actor[0]) cannot read 'memory://bucket/ckpt/.areno-storage-probe/" in msg
    assert "(actor[1])" in msg
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageCheckError, match=r"\(controller\) cannot write under '.*/file/ckpt'"):
        check_shared_storage([str(tmp_path / "file" / "ckpt")], sched)


def test_restart_worker(sched):
    pids = sched.call("actor", "pid")
    counts = sched.call("actor", "count")
    with pytest.raises(WorkerDiedError, match=r"actor\[1\] \(pid \d+ on .*\) died during crash .*exit code 3"):
        sched.submit_one("actor", 1, "crash").result(timeout=30)
    handle = sched.restart_worker("actor", 1)
    assert handle.pid != pids[1] and handle.rank == 1
    assert sched.call("actor", "pid") == [pids[0], handle.pid]
    assert sched.call("actor", "count") == [counts[0] + 1, 1]  # fresh object on the restarted worker
    assert sched.submit_one("actor", 1, "env", "RANK").result() == "1"


def test_construction_failures_leave_no_role(tmp_path):
    with LocalScheduler(log_dir=str(tmp_path)) as s:
        with pytest.raises(WorkerError, match=r"broken\[0\] .*constructor raised RuntimeError: constructor refuses"):
            s.create_workers("broken", "tests.helpers.launch_workers:BrokenWorker", 1, env=ENV)
        assert s.roles == []
        # a worker interpreter that cannot start exits before connecting
        with pytest.raises(
            WorkerDiedError, match=r"bad\[0\] exited with code 1 before connecting; log .*Fatal Python error"
        ):
            s.create_workers("bad", ENV_WORKER, 1, env={**ENV, "PYTHONIOENCODING": "no-such-codec"})
        assert s.roles == []


def test_device_env_uses_parent_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with LocalScheduler(log_dir=str(tmp_path)) as s:
        with pytest.raises(ValueError, match="logical device 4 but CUDA_VISIBLE_DEVICES='4,5,6,7' has 4"):
            s.create_workers("x", ENV_WORKER, 2, env=ENV, devices=[4, 5])
        s.create_workers("rollout", ENV_WORKER, 1, env=ENV, devices=[2, 3])
        assert s.call("rollout", "env", "CUDA_VISIBLE_DEVICES") == ["6,7"]


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="cluster.scheduler must be one of local, ray, slurm"):
        SchedulerConfig(type="k8s")
    with pytest.raises(ValueError, match="cluster.scheduler_options.connect_timeout_s must be > 0"):
        SchedulerConfig(connect_timeout_s=0)
    with pytest.raises(TypeError):
        SchedulerConfig("local")  # keyword-only


def test_call_that_does_not_unpickle_on_the_worker(sched):
    import sys
    import types

    ghost = types.ModuleType("areno_ghost_module")  # exists only in this process

    def hello():
        return "hi"

    hello.__module__, hello.__qualname__ = ghost.__name__, "hello"
    ghost.hello = hello
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(WorkerError, match=r"actor\[0\] .* raised ModuleNotFoundError: cannot unpickle the call"):
            sched.submit_one("actor", 0, hello).result(timeout=30)
    finally:
        del sys.modules[ghost.__name__]
    assert sched.submit_one("actor", 0, "env", "RANK").result(timeout=30) == "0"  # the worker lives on


def test_slow_call_is_logged_with_the_workers_it_waits_for(sched, monkeypatch, caplog):
    import logging
    import time

    from areno.launch import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "SLOW_CALL_WARN_S", 0.4)
    with caplog.at_level(logging.WARNING, logger="areno.launch.scheduler"):
        assert sched.call("actor", time.sleep, 1.5) == [None, None]
    slow = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert 1 <= len(slow) <= 3  # after 0.4 s and 1.2 s (doubling), not every poll
    pids = sched.call("actor", "pid")
    assert slow[0].startswith("time.sleep still running after")
    assert all(f"pid {p}" in slow[0] for p in pids) and "kill -USR1" in slow[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="areno.launch.scheduler"):
        assert sched.call("actor", "count")  # a quick call logs nothing
    assert not [r for r in caplog.records if "still running" in r.getMessage()]


def test_tensors_travel_both_ways(sched):
    """By value: the default pickler of a connection hands tensors over by shared memory, whose file
    descriptors the controller could not fetch (AuthenticationError: a colocated checkpoint, whose
    extra state holds the rollout RNG tensor, could not be resumed partitioned)."""
    state = {"rng": torch.arange(5, dtype=torch.uint8), "step": 3}
    (got, _) = sched.call("actor", "doubled", state)
    assert torch.equal(got["rng"], state["rng"] * 2) and got["step"] == 3


def test_free_ports_come_from_outside_the_ephemeral_range(monkeypatch):
    """A worker binds its MASTER_PORT seconds after the launcher picked it; a bind(0) port lies in the range
    every outgoing connection of the machine draws from meanwhile (walk36: a known flake class)."""
    import socket

    from areno.launch import scheduler

    low, high = scheduler.ephemeral_ports()
    for _ in range(20):
        port = scheduler.free_port()
        assert not low <= port <= high and scheduler.LISTEN_PORTS[0] <= port < scheduler.LISTEN_PORTS[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # free indeed
    # a machine whose ephemeral range covers the whole listening range still gets a free port
    monkeypatch.setattr(scheduler, "ephemeral_ports", lambda: (1024, 65535))
    port = scheduler.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))


def test_free_ports_do_not_follow_the_runs_seed():
    """walk38: free_port drew from the global random, which a run seeds with train.seed: two runs of one
    seed on one host picked the same ports for their servers."""
    import random

    from areno.launch import scheduler

    picks = []
    for _ in range(2):
        random.seed(0)
        picks.append([scheduler.free_port() for _ in range(4)])
    assert picks[0] != picks[1]
