"""Stall diagnosis: thread states from /proc, children of a process, and ``dump_hang``'s report."""

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from areno.launch.watchdog import child_pids, descendants, dump_hang, thread_states

linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


@linux
def test_thread_states_lists_every_thread_with_state_and_wait_channel():
    text = thread_states(os.getpid())
    lines = text.splitlines()
    assert len(lines) == len(os.listdir(f"/proc/{os.getpid()}/task"))
    assert all(" state " in line and " wchan " in line for line in lines)
    assert f"tid {os.getpid()} " in text  # the main thread
    assert "no such process" in thread_states(2**22 + 12345)  # beyond pid_max: named, not raised


@linux
def test_dump_hang_reports_controller_stacks_worker_threads_and_worker_stack(tmp_path):
    log = tmp_path / "worker.log"
    code = textwrap.dedent("""
        import faulthandler, signal, subprocess, sys, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        grandchild = subprocess.Popen(["sleep", "60"])
        def stuck_in_here():
            print("ready", flush=True)  # from in here: a dump from now on shows this frame
            time.sleep(60)
        stuck_in_here()
    """)
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        assert proc.pid in child_pids(os.getpid())
        out = io.StringIO()
        dump_hang([proc.pid], log_paths=[str(log)], settle_s=1.0, file=out)
        report = out.getvalue()
        assert "=== stall: controller stacks" in report
        assert "test_dump_hang_reports_controller_stacks" in report  # this (the controller's) stack
        assert f"=== stall: threads of pid {proc.pid}" in report and f"pid {proc.pid} tid {proc.pid}" in report
        assert "stuck_in_here" in report  # the worker's own stack, from the tail of its log
        # the worker's own children (a compiler it waits for, say), with state and command line
        assert f"=== stall: processes below pid {proc.pid}" in report
        below = report.split(f"=== stall: processes below pid {proc.pid}")[1]
        assert f"ppid {proc.pid} state S" in below and "sleep 60" in below and " cpu " in below
        assert "=== stall: processes below the workers, 1 s later" in report
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def test_worker_call_log_names_each_call_and_its_end(monkeypatch, capsys):
    from areno.launch import worker

    monkeypatch.setenv(worker.LOG_CALLS_ENV, "1")
    runtime = worker.WorkerRuntime()
    assert runtime.handle(("call", divmod, (7, 2), {})) == ("ok", (3, 1))
    reply = runtime.handle(("call", "missing", (), {}))
    assert reply[0] == "err" and "not initialised" in reply[2]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("call divmod started")
    assert "call divmod ended after" in lines[1]
    monkeypatch.setenv(worker.LOG_CALLS_ENV, "0")
    assert worker.WorkerRuntime().handle(("call", divmod, (7, 2), {})) == ("ok", (3, 1))
    assert capsys.readouterr().err == ""
