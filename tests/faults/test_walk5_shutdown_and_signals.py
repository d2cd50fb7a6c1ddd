"""No worker outlives the driver, and stopping never waits on a stalled worker: shutdown is bounded (then
the worker's process group is killed), a second SIGINT or SIGTERM stops at once, a driver that exits
without shutdown or is killed outright takes its workers with it. SIGHUP stops a run like SIGTERM (the
step's checkpoint saved); SIGUSR1 dumps the driver's stacks (and its workers') instead of killing it;
Ctrl-C during start-up says that nothing was trained."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.engine import partitioned
from areno.engine.partitioned import PartitionedCluster
from areno.launch import scheduler as scheduler_module
from areno.launch.scheduler import LocalScheduler, RoleSpec
from areno.launch.watchdog import descendants
from tests.helpers.configs import tiny_run_overrides, train_args
from tests.helpers.launch_workers import alive

WORKER = "tests.helpers.launch_workers:GradWorker"


def _gone(pids, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_shutdown_of_a_stopped_worker_is_bounded_and_kills_it(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_module, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(partitioned, "SHUTDOWN_TIMEOUT_S", 1.0)
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "cluster.allocation_mode=areno:d1+fsdp:d1"])
    sched = LocalScheduler(log_dir=str(tmp_path / "workers"))
    sched.create_roles(
        [
            RoleSpec(role="train", worker_cls=WORKER, n=1, args=(0,)),
            RoleSpec(role="rollout", worker_cls=WORKER, n=1, args=(1,)),
        ]
    )
    pids = [sched.workers(role)[0].pid for role in ("train", "rollout")]
    cluster = PartitionedCluster(cfg, tmp_path / "run", scheduler=sched)
    os.kill(pids[1], signal.SIGSTOP)
    sched.submit("rollout", "count")  # a call it never answers: its connection's thread waits in recv
    t0 = time.monotonic()
    cluster.stop("rollout")  # "shutdown" is not a GradWorker method: the live one answers an error at once
    cluster.stop("train")
    assert time.monotonic() - t0 < 10
    assert _gone(pids, 5)


def test_a_driver_leaving_without_shutdown_or_killed_takes_its_workers_along(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from areno.launch.scheduler import LocalScheduler
        sched = LocalScheduler(log_dir={str(tmp_path)!r})
        handles = sched.create_workers("w", {WORKER!r}, 2, args=(0,))
        print(" ".join(str(h.pid) for h in handles), flush=True)
        os.kill(handles[0].pid, signal.SIGSTOP)
        sched.submit_one("w", 0, "count")  # never answered: a non-daemon thread waits in recv
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    for how in ("exit", "kill"):
        out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=60)
        pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 2, out.stderr[-2000:]
        if how == "exit":  # the interpreter's exit does not hang on the stopped worker, and kills both
            assert out.returncode == 0 and _gone(pids, 5), out.stderr[-2000:]
        else:  # killed outright: the live worker sees its parent gone and exits
            assert out.returncode == -signal.SIGKILL and _gone(pids[1:], 10)
            os.kill(pids[0], signal.SIGKILL)  # a stopped process cannot see it: none can help that one


def _start_partitioned(tmp_path: Path, *extra: str, stall_s: str = "0") -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "stderr.txt"
    args = train_args(
        tmp_path, "train.steps=100000", "data.num_eval=0", "cluster.allocation_mode=areno:d1+fsdp:d1",
        "cluster.cpu_threads=1", *extra,
    )  # fmt: skip
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areno", *args],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env={**os.environ, "ARENO_WORKER_STALL_S": stall_s},
        )
    return proc, err


def _wait_for(proc: subprocess.Popen, err: Path, pattern: str, timeout_s: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, err.read_text())
        if found:
            return found
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow  # a multi-process run of 10-30 s
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once_though_a_worker_is_stopped(tmp_path, second):
    proc, err = _start_partitioned(tmp_path)
    try:
        lines = _wait_for(proc, err, r"(?s)worker train\[0\].*worker rollout\[0\][^\n]*\n").group(0)
        pids = [int(p) for p in re.findall(r"worker \w+\[\d\] \(rank \d\) pid (\d+)", lines)]
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        if second == signal.SIGINT:  # SIGUSR1 first: the driver's stacks, passed on to the workers, no stop
            proc.send_signal(signal.SIGUSR1)
            _wait_for(proc, err, r"SIGUSR1 passed to the workers \[\d+, \d+\]")
            assert "most recent call first" in err.read_text()
            assert proc.poll() is None
        os.kill(pids[1], signal.SIGSTOP)  # the rollout worker: every call to it waits forever
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, err, "stopping after this step")
        time.sleep(1)
        t0 = time.monotonic()
        proc.send_signal(second)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert f"areno: stopped at once by a second {second.name}" in text, text[-3000:]
    assert proc.returncode == (130 if second == signal.SIGINT else -signal.SIGTERM), text[-3000:]
    assert took < 30, took
    assert _gone(pids, 5), [p for p in pids if alive(p)]
    if second == signal.SIGINT:
        worker_log = (tmp_path / "run" / "workers" / "train-0.log").read_text()
        assert "most recent call first" in worker_log  # the SIGUSR1 the driver passed on


def test_sighup_saves_the_step_like_sigterm_and_sigusr1_dumps_stacks_without_stopping(tmp_path):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areno", *train_args(tmp_path, "train.steps=500", "data.num_eval=0")],
            stdout=subprocess.DEVNULL,
            stderr=f,
            # a run started under nohup (SIGHUP ignored) keeps it ignored, as it should: this test's run
            # must see SIGHUP as an ssh disconnect sends it, whoever started pytest
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        _wait_for(proc, err, "most recent call first")
        time.sleep(0.5)
        assert proc.poll() is None  # the default action would have ended the run (rc 138)
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGHUP, text[-3000:]
    last = text.strip().splitlines()[-1]
    found = re.match(r"areno: stopped by SIGHUP after step (\d+) of 500 .*resume=auto$", last)
    assert found, text[-3000:]
    assert (tmp_path / "run" / "checkpoints" / f"step_{int(found.group(1)):08d}" / "COMPLETE").is_file()
    assert not (tmp_path / "run" / "areno.lock").exists()


def test_ctrl_c_during_start_up_says_nothing_was_trained_and_stops_the_workers(tmp_path):
    proc, err = _start_partitioned(tmp_path)
    try:
        _wait_for(proc, err, "partitioned topology")
        deadline = time.monotonic() + 30
        while len(workers := descendants(proc.pid)) < 2:  # train[0] and rollout[0] launched, still starting
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.02)
        assert (tmp_path / "run" / "metrics.jsonl").exists() is False
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert (
        "areno: interrupted during start-up, before any step: nothing was trained and no checkpoint was written; "
        "the same command starts it again"
    ) in text.splitlines(), text[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert _gone(workers, 10)
