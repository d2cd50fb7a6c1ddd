"""walk23 launch findings: a stray connection to the worker listener, a run_dir with a space in the
SLURM script, the type checks of cluster.scheduler_options, ray_cpus_per_worker=0, Ray worker logs."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from areno.api.config import ConfigError, load_config
from areno.launch import ray_scheduler, scheduler
from areno.launch.scheduler import LocalScheduler, RoleSpec, SchedulerConfig, SchedulerError, _Hub
from areno.launch.slurm import render_sbatch

ENV_WORKER = "tests.helpers.launch_workers:EnvWorker"
ENV = {"OMP_NUM_THREADS": "1"}


def _hello(port: int, authkey: bytes, role: str = "w", index: int = 0):
    """What a worker does first: dial the controller, authenticate, introduce itself."""
    conn = Client(("127.0.0.1", port), authkey=authkey)
    conn.send(("hello", role, index, os.getpid(), socket.gethostname()))
    return conn


def _hello_in_thread(port: int, authkey: bytes, role: str = "w", index: int = 0) -> threading.Thread:
    # a daemon: before the fix it blocks behind the stray connection, which must not hang the test run
    thread = threading.Thread(target=_hello, args=(port, authkey, role, index), daemon=True)
    thread.start()
    return thread


# -- 4: one stray TCP connection blocks every worker's connect ------------------------------------


def test_an_idle_connection_does_not_hold_back_the_workers():
    hub = _Hub("127.0.0.1")
    stray = socket.create_connection(("127.0.0.1", hub.port))  # a port scan, a health probe: sends nothing
    try:
        _hello_in_thread(hub.port, hub.authkey)
        arrived = hub.wait([("w", 0)], 5.0, lambda: None)
        assert arrived[("w", 0)][1] == os.getpid()
    finally:
        stray.close()
        hub.close()


def test_a_peer_without_the_key_is_refused_and_workers_still_connect():
    hub = _Hub("127.0.0.1")
    try:
        with pytest.raises(AuthenticationError):
            _hello(hub.port, b"not the key")
        _hello_in_thread(hub.port, hub.authkey, "w", 1)
        assert list(hub.wait([("w", 1)], 5.0, lambda: None)) == [("w", 1)]
    finally:
        hub.close()


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(scheduler, "HANDSHAKE_TIMEOUT_S", 0.3)
    hub = _Hub("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", hub.port)) as stray:
            stray.settimeout(3.0)
            t0 = time.monotonic()
            while stray.recv(4096):  # the challenge, then end of file once the handshake gives up
                pass
            assert time.monotonic() - t0 < 2.0
    finally:
        hub.close()


def test_local_workers_connect_past_a_stray_connection(tmp_path):
    with LocalScheduler(connect_timeout_s=20, log_dir=str(tmp_path)) as sched:
        with socket.create_connection(("127.0.0.1", sched._hub.port)):  # before: no worker ever connected
            sched.create_workers("w", ENV_WORKER, 2, env=ENV)
            assert sched.call("w", "env", "OMP_NUM_THREADS") == ["1", "1"]


def test_close_ends_the_accept_thread():
    hub = _Hub("127.0.0.1")
    hub.close()
    hub._thread.join(2.0)
    assert not hub._thread.is_alive()


# -- 5: the SLURM script and a run_dir with a space -------------------------------------------------


def _sbatch_arguments(script: str) -> list[str]:
    """The arguments sbatch takes from a script's ``#SBATCH`` lines, as its ``_get_argument`` splits them
    (sbatch reads these lines itself, not through the shell): whitespace separates, single or double
    quotes group, a backslash takes the next character as it is, an unquoted ``#`` ends the line."""
    args: list[str] = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break  # the first command ends the directives
            continue
        rest, i = line[len("#SBATCH") :], 0
        while True:
            while i < len(rest) and rest[i].isspace():
                i += 1
            arg, quote, escape, comment = "", "", False, False
            while i < len(rest) and (quote or not rest[i].isspace()):
                c = rest[i]
                i += 1
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                    continue
                elif quote:
                    if c == quote:
                        quote = ""
                        continue
                elif c in "\"'":
                    quote = c
                    continue
                elif c == "#":
                    comment = True
                    break
                arg += c
            assert not quote, f"sbatch: unmatched quote in {line!r}"
            if arg:
                args.append(arg)
            if comment or not arg:
                break
    return args


def _script(job_dir: str, workdir: str, **cfg) -> str:
    return render_sbatch(
        [RoleSpec(role="train", worker_cls="m:C", n=1)],
        cfg=SchedulerConfig(type="slurm", **cfg),
        controller="ctl:5000",
        job_dir=job_dir,
        master_ports={"role:train": 29500},
        python=sys.executable,
        pythonpath="/src",
        workdir=workdir,
    )


def test_sbatch_directives_keep_a_run_dir_with_a_space_whole():
    script = _script("/runs/my run/workers", "/src dir/it's", slurm_job_name="my job")
    args = _sbatch_arguments(script)
    assert "--output=/runs/my run/workers/slurm-%j.out" in args
    assert "--chdir=/src dir/it's" in args
    assert "--job-name=my job" in args
    assert "--ntasks=1" in args  # the plain lines read as before


def test_srun_gets_a_run_dir_with_a_space_as_one_argument(tmp_path):
    job_dir = tmp_path / "my run" / "workers"
    job_dir.mkdir(parents=True)
    (job_dir / "authkey").write_text("00")
    script = _script(str(job_dir), str(tmp_path))
    (tmp_path / "job.sbatch").write_text(script)
    argv = tmp_path / "argv"
    # the script as bash runs it, with srun a function that writes the arguments it receives
    # (bash's own `wait`: the script starts srun in the background, and the file must be written before the check)
    harness = f"srun() {{ printf '%s\\0' \"$@\" > {argv}; }}; source {tmp_path / 'job.sbatch'}"
    subprocess.run(["bash", "-c", harness], check=True, timeout=30)
    got = argv.read_text().split("\0")
    assert f"--output={job_dir}/train-%t.log" in got
    assert got[got.index("--slurm") - 1] == "train"  # the worker command is intact after it


def test_a_percent_in_the_run_dir_is_literal_in_the_output_patterns():
    script = _script("/runs/100%/workers", "/src")
    assert "--output=/runs/100%%/workers/slurm-%j.out" in _sbatch_arguments(script)
    assert "--output=/runs/100%%/workers/train-%t.log" in script


def test_a_run_dir_with_a_line_break_is_refused():
    with pytest.raises(SchedulerError, match=r"^run_dir \(the job's directory\) '/runs/a\\nb' holds a line break"):
        _script("/runs/a\nb", "/src")


# -- 6: cluster.scheduler_options values are type-checked ------------------------------------------

BASE = ["model.path=unused", "cluster.device=cpu", "cluster.allocation_mode='areno:d1+fsdp:d1'"]
KEY = "cluster.scheduler_options"


@pytest.mark.parametrize(
    "scheduler_name, options, message",
    [
        ("local", "{connect_timeout_s: '30'}", f"{KEY}.connect_timeout_s: must be a number, got '30'"),
        ("local", "{connect_timeout_s: .nan}", f"{KEY}.connect_timeout_s: must be a finite number, got nan"),
        ("local", "{connect_timeout_s: .inf}", f"{KEY}.connect_timeout_s: must be a finite number, got inf"),
        ("slurm", "{slurm_queue_timeout_s: .inf}", f"{KEY}.slurm_queue_timeout_s: must be a finite number, got inf"),
        (
            "slurm",
            "{slurm_extra_sbatch_lines: '--qos=high'}",
            f"{KEY}.slurm_extra_sbatch_lines: must be a list of strings, got '--qos=high'; one line per item, "
            "e.g. ['--qos=high']",
        ),
        (
            "slurm",
            "{slurm_setup_lines: 'module load cuda'}",
            f"{KEY}.slurm_setup_lines: must be a list of strings, got 'module load cuda'; one line per item, "
            "e.g. ['module load cuda']",
        ),
        ("slurm", "{slurm_cpus_per_task: 2.5}", f"{KEY}.slurm_cpus_per_task: must be an integer, got 2.5"),
        ("slurm", "{slurm_time: 60}", f"{KEY}.slurm_time: must be a string or null, got 60"),
        (
            "slurm",
            "{slurm_time: '2 days'}",
            f"{KEY}.slurm_time: must be a SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, "
            "e.g. '2-00:00:00'), or null for the partition's limit; got '2 days'",
        ),
        ("ray", "{ray_cpus_per_worker: .nan}", f"{KEY}.ray_cpus_per_worker: must be a finite number, got nan"),
        ("local", "{log_dir: 5}", f"{KEY}.log_dir: must be a string or null, got 5"),
    ],
)
def test_option_of_the_wrong_type_is_one_line_naming_the_key(scheduler_name, options, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, f"cluster.scheduler={scheduler_name}", f"{KEY}={options}"])
    assert str(info.value) == message


@pytest.mark.parametrize("value", ["90", "30:00", "01:00:00", "2-00", "2-12:30", "2-00:00:00", "INFINITE", ""])
def test_slurm_time_takes_slurms_formats(value):
    assert SchedulerConfig(type="slurm", slurm_time=value).slurm_time == value


@pytest.mark.parametrize("value", ["2 days", "1:2:3:4", "-1", "01:00:00 ", "1-", "1h"])
def test_slurm_time_refuses_other_strings(value):
    with pytest.raises(ConfigError, match=rf"^{KEY}\.slurm_time: must be a SLURM time limit"):
        SchedulerConfig(type="slurm", slurm_time=value)


def test_line_lists_and_sbatch_values_keep_their_lines():
    cfg = SchedulerConfig(type="slurm", slurm_extra_sbatch_lines=["--qos=high"], slurm_setup_lines=["a", "b"])
    assert (cfg.slurm_extra_sbatch_lines, cfg.slurm_setup_lines) == (("--qos=high",), ("a", "b"))
    with pytest.raises(ConfigError, match=rf"^{KEY}\.slurm_job_name: must not hold a line break"):
        SchedulerConfig(type="slurm", slurm_job_name="a\nrm -rf x")
    assert SchedulerConfig(log_dir=Path("/tmp/x")).log_dir == "/tmp/x"  # a path from Python, as elsewhere


def test_a_nan_connect_timeout_no_longer_reaches_the_wait():
    # nan passed `<= 0` and made the connect wait spin forever: min(nan, 0.2) is nan, and a wait of nan returns
    with pytest.raises(ConfigError, match="finite"):
        SchedulerConfig(connect_timeout_s=float("nan"))


# -- 8: ray_cpus_per_worker=0 ----------------------------------------------------------------------


def test_zero_ray_cpus_per_worker_is_refused_by_the_config():
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, "cluster.scheduler=ray", f"{KEY}={{ray_cpus_per_worker: 0}}"])
    assert str(info.value).startswith(f"{KEY}.ray_cpus_per_worker: must be > 0 (")
    assert "\n" not in str(info.value)
    assert SchedulerConfig(type="ray", ray_cpus_per_worker=0.25).ray_cpus_per_worker == 0.25


def test_zero_cpus_per_worker_is_refused_before_ray_starts(monkeypatch):
    def no_ray():
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray_scheduler, "import_ray", no_ray)
    with pytest.raises(SchedulerError, match=rf"^{KEY}\.ray_cpus_per_worker: must be > 0"):
        ray_scheduler.RayScheduler(cpus_per_worker=0)


# -- 9: Ray worker logs: a header line, truncated when the run starts over --------------------------


def test_ray_actor_log_has_a_header_and_is_truncated_or_appended(tmp_path):
    log = tmp_path / "workers" / "train-0.log"
    env = {"RANK": "1", "WORLD_SIZE": "2", "ARENO_RUN_DIR": "/runs/x"}
    # the actor's method, in a process of its own (it redirects file descriptors 1 and 2); no Ray needed
    child = textwrap.dedent(
        f"""
        from areno.launch.ray_scheduler import _RayWorkerActor
        actor = _RayWorkerActor()
        for n, truncate in ((1, True), (2, True), (3, False)):  # a run, a run that starts over, a resume
            assert actor.redirect_output({str(log)!r}, truncate, "train", 0, {env!r}) == (None, "")
            print("output of run", n)
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60, env={**os.environ, **ENV})
    text = log.read_text()
    assert "output of run 1" not in text  # truncated when the run started over
    first, _, rest = text.partition("\n==================== ")
    assert first.startswith("==== areno worker train[0] rank 1 of 2, pid ")
    assert "run_dir /runs/x ====\n==== command: " in first and first.endswith("output of run 2\n")
    assert rest.split("\n")[0].endswith(": this worker starts again ====================")
    assert "==== areno worker train[0] rank 1 of 2" in rest and rest.endswith("output of run 3\n")


class _FakeMethod:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return None, ""


class _FakeActor:
    def __init__(self, calls: list) -> None:
        self.redirect_output = _FakeMethod(calls)


def test_ray_scheduler_truncates_each_log_once_when_fresh(tmp_path):
    assert ray_scheduler.RayScheduler.fresh_logs is False  # partitioned.launch sets it where there is one
    sched = ray_scheduler.RayScheduler.__new__(ray_scheduler.RayScheduler)
    sched.__dict__.update(_ray=type("FakeRay", (), {"get": staticmethod(lambda refs: refs)}), log_dir=str(tmp_path))
    sched._truncated = set()
    sched.fresh_logs = True
    calls: list = []
    workers = [
        ray_scheduler._RayWorker(
            spec=RoleSpec(role="train", worker_cls="m:C", n=2),
            handle=scheduler.WorkerHandle(role="train", index=i, rank=i, world_size=2, pid=1, host="h"),
            bundle=i,
            env={"RANK": str(i)},
            actor=_FakeActor(calls),
        )
        for i in range(2)
    ]
    sched._redirect_logs(workers)
    sched._redirect_logs(workers[:1])  # restart_worker: the same log again
    assert [(Path(c[0]).name, c[1], c[2], c[3], c[4]) for c in calls] == [
        ("train-0.log", True, "train", 0, {"RANK": "0"}),
        ("train-1.log", True, "train", 1, {"RANK": "1"}),
        ("train-0.log", False, "train", 0, {"RANK": "0"}),
    ]
    assert workers[0].handle.log_path == str(tmp_path / "train-0.log")


@pytest.mark.slow
def test_ray_worker_logs_start_over_with_the_run(tmp_path):
    pytest.importorskip("ray")
    log = tmp_path / "w-0.log"
    pids = []
    for fresh in (True, True, False):  # a run, a run that starts over (overwrite=true), a resumed run
        with ray_scheduler.RayScheduler(num_cpus=1, cpus_per_worker=0.5, log_dir=str(tmp_path)) as sched:
            sched.fresh_logs = fresh
            (handle,) = sched.create_workers("w", ENV_WORKER, 1, env={**ENV, "ARENO_RUN_DIR": "/runs/r"})
            pids.append(handle.pid)
            assert handle.log_path == str(log)
    text = log.read_text()
    assert f"pid {pids[0]} " not in text
    assert text.startswith(f"==== areno worker w[0] rank 0 of 1, pid {pids[1]} on ")
    assert "run_dir /runs/r ====" in text
    assert text.count(": this worker starts again ====") == 1
    assert f"==== areno worker w[0] rank 0 of 1, pid {pids[2]} on " in text.split("this worker starts again")[1]
