"""A rollout worker that stops answering (``kill -STOP``: a deadlock, a stuck NFS read) is declared lost
after ``cluster.worker_stall_s`` and killed; the run stops with one line naming it, its pid and log, after an
emergency checkpoint of the training side, which ``resume=auto`` goes on from with no trained step lost.
The driver names every worker (pid, log) at start; each worker log starts with a header line, without
runpy's warning, and a resumed run appends to it after a separator."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.configs import train_args
from tests.helpers.launch_workers import alive

PARTITIONED = (
    "cluster.allocation_mode=areno:d1+fsdp:d1",
    "cluster.cpu_threads=1",
    "rollout.max_head_offpolicyness=1",
    "train.algorithm=grpo_async",
    "data.num_eval=0",
    "train.save_interval=0",
)


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def _wait(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow  # a multi-process run of 10-30 s
def test_a_stopped_rollout_worker_is_declared_lost_and_the_trained_steps_are_saved(tmp_path):
    run = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k != "ARENO_WORKER_STALL_S"}  # the key alone decides
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "areno",
                *train_args(tmp_path, "train.steps=100000", "cluster.worker_stall_s=4", *PARTITIONED),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    try:
        workers = {}

        def started() -> bool:  # one line per worker at start: role, rank, pid, log
            for name, pid, log in re.findall(
                r"worker (\w+\[\d\]) \(rank \d\) pid (\d+) on \S+, log (\S+)", err_path.read_text()
            ):
                workers[name] = (int(pid), log)
            return len(workers) == 2

        _wait(started, proc, "worker lines")
        assert workers["rollout[0]"][1] == str(run / "workers" / "rollout-0.log")
        metrics = run / "metrics.jsonl"
        _wait(lambda: metrics.is_file() and len(_steps(metrics)) >= 2, proc, "two steps")
        rollout_pid = workers["rollout[0]"][0]
        os.kill(rollout_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    assert proc.returncode == 1, text[-3000:]
    last = text.strip().splitlines()[-1]
    saved = re.search(r"saved an emergency checkpoint of step (\d+) \((\S+)\), which resume=auto goes on from$", last)
    assert last.startswith(f"areno: error: rollout[0] (pid {rollout_pid}) stopped answering: ") and saved, text[-3000:]
    assert f"(log: {run / 'workers' / 'rollout-0.log'})" in last and "cluster.worker_stall_s=4" in last
    assert "stopped (SIGSTOP" in last  # what /proc says of it
    assert took < 60, took  # not rollout.request_timeout_s (600 s) or cluster.sync_timeout_s
    step = int(saved.group(1))
    assert (run / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()
    assert "emergency checkpoint of step" in text  # marked as such in the log
    assert _steps(metrics)[-1] == step  # the step it saved is logged, once
    assert not any(alive(pid) for pid, _ in workers.values())  # the stopped worker too
    header = (run / "workers" / "rollout-0.log").read_text().splitlines()
    assert header[0].startswith(f"==== areno worker rollout[0] rank 1 of 2, pid {rollout_pid} on ")
    assert f"run_dir {run} ====" in header[0] and header[1].startswith("==== command: ")
    assert not any("RuntimeWarning" in line for line in header)  # runpy's, of `python -m` a loaded module

    resumed = subprocess.run(
        [sys.executable, "-m", "areno", *train_args(tmp_path, f"train.steps={step + 1}", *PARTITIONED, "resume=auto")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f'"resumed_from": "{run / "checkpoints" / f"step_{step:08d}"}"' in resumed.stdout
    assert _steps(metrics) == list(range(1, step + 2))  # no trained step lost, none twice
    log = (run / "workers" / "rollout-0.log").read_text()
    assert log.startswith(header[0]) and "this worker starts again" in log  # appended on resume
