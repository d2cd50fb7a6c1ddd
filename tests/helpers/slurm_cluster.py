"""A private single-node SLURM cluster (slurmctld + slurmd in the foreground) for tests.

No munge (auth/none, cred/none), no cgroups (proctrack/linuxproc, task/none), no accounting;
everything lives in a temporary directory and the daemons are children of the test, stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from areno.launch.scheduler import RoleSpec, SchedulerConfig, free_port
from areno.launch.slurm import render_sbatch


def slurm_available() -> str | None:
    """None when slurmctld/slurmd/sbatch exist, else the reason to skip."""
    missing = [
        t for t in ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol") if not shutil.which(t)
    ]
    return f"SLURM not installed ({', '.join(missing)} missing; apt-get install slurm-wlm)" if missing else None


@contextlib.contextmanager
def slurm_cluster(root: Path, cpus: int = 8) -> Iterator[dict[str, str]]:
    """Start the daemons; yields the env (SLURM_CONF) that client commands need."""
    host = socket.gethostname()
    for d in ("state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=arenotest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=bf_interval=1",  # heterogeneous jobs are only started by backfill
                "InactiveLimit=0",
                "KillWait=5",
                "MinJobAge=300",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    ctld = subprocess.Popen(
        ["slurmctld", "-D", "-i", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    slurmd = subprocess.Popen(
        ["slurmd", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            for p, name in ((ctld, "slurmctld"), (slurmd, "slurmd")):
                if p.poll() is not None:
                    log = root / "log" / f"{name}.log"
                    raise RuntimeError(
                        f"{name} exited ({p.returncode}): {log.read_text()[-1500:] if log.exists() else ''}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM node not idle within 60s: {out.stdout!r} {out.stderr!r}")
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        # cancel what is left and let slurmstepd finish before the daemons go
        subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=env, capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
            if out.returncode != 0 or not out.stdout.strip():
                break
            time.sleep(0.5)
        for p in (slurmd, ctld):
            p.terminate()
        for p in (slurmd, ctld):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def minimal_sbatch(cfg: SchedulerConfig) -> str:
    """The sbatch script of one one-task role under ``cfg``, with placeholder paths."""
    return render_sbatch(
        [RoleSpec(role="actor", worker_cls="m:C", n=1)],
        cfg=cfg,
        controller="h:1",
        job_dir="/j",
        master_ports={"role:actor": 2},
        python="python3",
        pythonpath="/p",
        workdir="/w",
    )
