"""SLURM launches under stub sbatch/squeue/srun/scancel (audit walk5, A3): a queued job is waited
for (its state and reason logged), the connect timeout counts from the job's start, every failed or
interrupted launch cancels the job it submitted, the time limit is told, and the script can be
previewed without submitting it."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from areno.launch.scheduler import RoleSpec, SchedulerConfig, SchedulerError, WorkerDiedError, WorkerError
from areno.launch.slurm import SlurmScheduler, sbatch_preview, time_limit_note
from tests.helpers.slurm_cluster import minimal_sbatch

WORKER = "tests.helpers.launch_workers:GradWorker"
JOB = "4242"


def fake_slurm(root: Path) -> Path:
    """Stub SLURM client tools under ``root/bin`` that log each call to ``root/calls.log``.

    The job's state is the text of ``root/state`` (``STATE|REASON``). ``sbatch`` copies the script
    to ``root/job.sbatch``; when ``root/start_after`` holds N, it turns the job RUNNING after N
    seconds and runs the script (``srun`` runs its command here as task 0). ``scancel`` marks the
    job CANCELLED and stops the script."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (root / "state").write_text("PENDING|Priority")
    log = f'echo "$(basename "$0") $*" >> {root}/calls.log'
    tools = {
        "sbatch": f"""
            {log}
            script="${{@: -1}}"
            cp "$script" {root}/job.sbatch
            if [ -f {root}/start_after ]; then
              (sleep "$(cat {root}/start_after)"; echo 'RUNNING|None' > {root}/state; exec bash "$script") \\
                > {root}/job.out 2>&1 &
              echo $! > {root}/job.pid
            fi
            echo {JOB}
            """,
        "squeue": f"""
            {log}
            case "$*" in *--user*) exit 0;; esac
            state="$(cat {root}/state)"
            case "$*" in *%r*) echo "$state";; *) echo "${{state%%|*}}";; esac
            """,
        "scancel": f"""
            {log}
            echo 'CANCELLED|None' > {root}/state
            [ -f {root}/job.pid ] && pkill -P "$(cat {root}/job.pid)" ; true
            """,
        "srun": f"""
            {log}
            out=/dev/null
            while [ $# -gt 0 ] && [ "$1" != env ]; do
              case "$1" in --output=*) out="${{1#--output=}}";; esac
              shift
            done
            out="${{out//%t/0}}"
            SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_JOB_ID={JOB} "$@" >> "$out" 2>&1
            """,
    }
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
        path.chmod(0o755)
    return bin_dir


def calls(root: Path) -> list[str]:
    path = root / "calls.log"
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    root = tmp_path / "slurm"
    monkeypatch.setenv("PATH", f"{fake_slurm(root)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return root


def _cfg(tmp_path: Path, **options) -> SchedulerConfig:
    options = {"connect_timeout_s": 2.0, "slurm_poll_interval_s": 0.2, **options}
    return SchedulerConfig(
        type="slurm", log_dir=str(tmp_path / "workers"), slurm_controller_addr="127.0.0.1", **options
    )


def _specs() -> list[RoleSpec]:
    env = {"OMP_NUM_THREADS": "1"}
    return [
        RoleSpec(role="train", worker_cls=WORKER, n=1, args=(1,), env=env, world="w"),
        RoleSpec(role="rollout", worker_cls=WORKER, n=1, args=(1,), env=env, world="w"),
    ]


@pytest.mark.slow  # a multi-process run of 10-30 s
def test_a_pending_job_is_waited_for_and_the_connect_timeout_counts_from_its_start(slurm, tmp_path, caplog):
    (slurm / "start_after").write_text("8")  # queued longer than the connect timeout
    with SlurmScheduler(_cfg(tmp_path, connect_timeout_s=5.0), python=sys.executable) as sched:
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="areno.launch.slurm"):
            handles = sched.create_roles(_specs())
        assert time.monotonic() - t0 >= 8
        assert [h.rank for h in handles["train"] + handles["rollout"]] == [0, 1]
        assert sched.call("rollout", "env", "RANK") == ["1"]
        assert sched.call("train", "env", "SLURM_JOB_ID") == [JOB]
        assert not any(c.startswith("scancel") for c in calls(slurm))
    said = caplog.text
    assert f"SLURM job {JOB} is PENDING (Priority) after 0 s in the queue; waiting up to 86400s" in said
    assert f"SLURM job {JOB} started after" in said
    assert f"SLURM job {JOB}: time limit 01:00:00 (the default of cluster.scheduler_options.slurm_time)" in said
    assert calls(slurm)[-1] == f"scancel {JOB}"  # shutdown


def test_workers_that_never_connect_name_the_job_and_cancel_it(slurm, tmp_path):
    (slurm / "state").write_text("RUNNING|None")  # running, but its workers never dial back
    with SlurmScheduler(_cfg(tmp_path, connect_timeout_s=1.0), python=sys.executable) as sched:
        with pytest.raises(WorkerError) as info:
            sched.create_roles(_specs())
        message = str(info.value)
        assert message.startswith("workers train[0] (log ")
        assert f"did not connect within 1s of their job's start (SLURM job {JOB} is RUNNING;" in message
        assert f"every node must reach this controller at 127.0.0.1:{sched._hub.port}" in message
        assert "\n" not in message
        assert calls(slurm).count(f"scancel {JOB}") == 1
        assert sched.roles == []
    assert calls(slurm).count(f"scancel {JOB}") == 1  # shutdown does not cancel it twice


def test_the_queue_wait_is_bounded_and_cancels_the_job(slurm, tmp_path):
    with SlurmScheduler(_cfg(tmp_path), python=sys.executable, queue_timeout_s=1.0) as sched:
        with pytest.raises(
            SchedulerError,
            match=rf"^SLURM job {JOB} is still PENDING \(Priority\) after \d+s in the queue \(limit 1s, "
            r"cluster.scheduler_options.slurm_queue_timeout_s\); it was cancelled",
        ):
            sched.create_roles(_specs())
        assert calls(slurm)[-1] == f"scancel {JOB}"


def test_a_job_that_will_never_start_fails_at_once(slurm, tmp_path):
    (slurm / "state").write_text("PENDING|PartitionTimeLimit")
    with SlurmScheduler(_cfg(tmp_path, slurm_time="30-00:00:00"), python=sys.executable) as sched:
        t0 = time.monotonic()
        with pytest.raises(SchedulerError, match=r"PENDING \(PartitionTimeLimit\) and will not start: .*slurm_time"):
            sched.create_roles(_specs())
        assert time.monotonic() - t0 < 5
        assert calls(slurm)[-1] == f"scancel {JOB}"


def test_a_job_that_fails_in_the_queue_names_its_state(slurm, tmp_path):
    (slurm / "state").write_text("FAILED|None")
    with SlurmScheduler(_cfg(tmp_path), python=sys.executable) as sched:
        with pytest.raises(WorkerDiedError, match=rf"^SLURM job {JOB} is FAILED before its workers connected; log "):
            sched.create_roles(_specs())


def test_ctrl_c_while_queued_cancels_the_job(slurm, tmp_path):
    with SlurmScheduler(_cfg(tmp_path), python=sys.executable) as sched:
        interrupt = threading.Timer(1.0, lambda: (slurm / "state").write_text("interrupt|"))

        def status(job_id):  # the user's Ctrl-C arrives while the job is queued
            if (slurm / "state").read_text() == "interrupt|":
                raise KeyboardInterrupt
            return "PENDING", "Resources"

        sched.job_status = status
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            sched.create_roles(_specs())
        assert f"scancel {JOB}" in calls(slurm)


def test_a_driver_that_exits_without_shutdown_cancels_its_job(slurm, tmp_path):
    """atexit: a job submitted by a process that ends without shutdown() is cancelled."""
    code = textwrap.dedent(
        f"""
        import sys
        from areno.launch.scheduler import RoleSpec, SchedulerConfig
        from areno.launch.slurm import SlurmScheduler
        cfg = SchedulerConfig(type="slurm", log_dir={str(tmp_path / "w")!r}, slurm_poll_interval_s=0.2)
        sched = SlurmScheduler(cfg, queue_timeout_s=0.5)
        sched._wait_started = lambda job_id: None  # submitted and "started"; the driver then exits
        sched._connect = lambda workers: sys.exit(0)
        sched.create_roles([RoleSpec(role="train", worker_cls="m:C", n=1)])
        """
    )
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert calls(slurm).count(f"scancel {JOB}") == 1


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_queued_cancels_the_job(slurm, tmp_path, signame):
    """``timeout``, SLURM or ``docker stop`` send SIGTERM; its default action would skip any cleanup."""
    import signal
    import subprocess

    code = textwrap.dedent(
        f"""
        from areno.launch.scheduler import RoleSpec, SchedulerConfig
        from areno.launch.slurm import SlurmScheduler
        from areno.errors import RunStopped
        cfg = SchedulerConfig(type="slurm", log_dir={str(tmp_path / "w")!r}, slurm_poll_interval_s=0.2)
        sched = SlurmScheduler(cfg)
        print("waiting", flush=True)
        try:
            sched.create_roles([RoleSpec(role="train", worker_cls="m:C", n=1)])
        except RunStopped as e:
            print("stopped:", e, flush=True)
            raise SystemExit(128 + e.signum)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "waiting\n"
    deadline = time.monotonic() + 60
    while not any(c.startswith("squeue -h -j") for c in calls(slurm)) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=60)
    signum = getattr(signal, signame)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"stopped: {signame} while SLURM job {JOB} waited in the queue: it is cancelled; nothing ran" in out
    assert calls(slurm).count(f"scancel {JOB}") == 1


def test_a_driver_inside_an_allocation_is_told_it_submits_another_job(slurm, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with caplog.at_level(logging.WARNING, logger="areno.launch.slurm"):
        SlurmScheduler(_cfg(tmp_path)).shutdown()
    assert "this driver runs inside SLURM job 77, and cluster.scheduler=slurm submits another job" in caplog.text


def test_no_time_limit_unless_one_is_set():
    cfg = SchedulerConfig(type="slurm", slurm_time=None)
    script = minimal_sbatch(cfg)
    assert "--time" not in script
    assert time_limit_note(cfg) == "no --time: the partition's default time limit applies"
    assert time_limit_note(SchedulerConfig(type="slurm", slurm_time="2-00:00:00")).startswith(
        "time limit 2-00:00:00 (from cluster.scheduler_options.slurm_time)"
    )


def test_preview_is_the_script_the_launch_submits(slurm, tmp_path):
    cfg = _cfg(tmp_path, slurm_time="04:00:00", slurm_partition="gpu")
    preview = sbatch_preview(_specs(), cfg, python=sys.executable)
    (slurm / "state").write_text("FAILED|None")
    with SlurmScheduler(cfg, python=sys.executable) as sched, pytest.raises(WorkerDiedError):
        sched.create_roles(_specs())
    submitted = (slurm / "job.sbatch").read_text()

    def ports_apart(text: str) -> list[str]:  # the controller's port and MASTER_PORT are picked at launch
        import re

        return re.sub(r"(127\.0\.0\.1:|MASTER_PORT=)\d+", r"\1N", text).splitlines()

    assert ports_apart(preview) == ports_apart(submitted)
    assert "#SBATCH --time=04:00:00" in preview and "#SBATCH --partition=gpu" in preview
