"""``SlurmScheduler``: one sbatch job, one ``srun`` step per role, workers dial back over RPC.

``create_roles`` renders an sbatch script that allocates the tasks of all roles and starts one
``srun --exact`` step per role inside that allocation, submits it with ``sbatch --parsable`` and
waits for the workers (``python -m areno.launch.worker --slurm``) to connect to this controller,
polling ``squeue``/``sacct`` so that a job that fails or is cancelled ends the wait with its
state. Each task takes ``RANK`` = its role's rank offset in the world + ``SLURM_PROCID`` and
``LOCAL_RANK`` = ``SLURM_LOCALID``; ``MASTER_ADDR`` (the node of the world's rank 0) is sent by the
controller once every worker has reported its host. ``restart_worker`` starts a one-task
``srun --overlap`` step inside the same job on the node of the worker it replaces.

Steps rather than a heterogeneous job: SLURM does not place two components of a heterogeneous
job on one node, so a het job cannot run on a single machine (the tests run a real single-node
cluster); steps of one allocation run anywhere, and ``--exact`` keeps them from overlapping.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from areno.launch.scheduler import (
    AUTHKEY_ENV,
    RoleSpec,
    SchedulerConfig,
    SchedulerError,
    WorkerDiedError,
    _replace,
    _RpcScheduler,
    _RpcWorker,
    _tail,
    assign_ranks,
    free_port,
    python_path_env,
)

__all__ = ["SlurmScheduler", "check_slurm_controller", "render_sbatch"]

_ALIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def check_slurm_controller(timeout_s: float = 60.0) -> None:
    """SchedulerError (one line) unless a SLURM controller answers ``squeue`` from here: without
    one (no slurm.conf, slurmctld down) ``sbatch`` could not allocate the job's nodes."""
    try:
        out = subprocess.run(
            ["squeue", "--noheader", "--format=%i", f"--user={getpass.getuser()}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise SchedulerError(
            f"no SLURM controller answered squeue within {timeout_s:g}s: check that slurmctld "
            f"runs (scontrol ping) or use cluster.scheduler=local|ray"
        ) from None
    if out.returncode != 0:
        lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()] or [f"exit code {out.returncode}"]
        raise SchedulerError(
            f"no SLURM controller answers from this host (squeue: {lines[-1]}): cluster.scheduler="
            f"slurm needs slurm.conf (SLURM_CONF) and a running slurmctld; or use "
            f"cluster.scheduler=local|ray"
        )


def render_sbatch(
    specs: Sequence[RoleSpec],
    *,
    cfg: SchedulerConfig,
    controller: str,
    job_dir: str,
    master_ports: dict[str, int],
    python: str,
    pythonpath: str,
    workdir: str,
) -> str:
    """The sbatch script for ``specs``: one allocation, one ``srun`` step per role."""
    ranks = assign_ranks(specs)
    gpus = sum(len(spec.devices) for spec in specs if spec.devices is not None)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.slurm_job_name}",
        f"#SBATCH --output={job_dir}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --time={cfg.slurm_time}",
        *([f"#SBATCH --partition={cfg.slurm_partition}"] if cfg.slurm_partition else []),
        *([f"#SBATCH --account={cfg.slurm_account}"] if cfg.slurm_account else []),
        f"#SBATCH --ntasks={sum(spec.n for spec in specs)}",
        f"#SBATCH --cpus-per-task={cfg.slurm_cpus_per_task}",
        *([f"#SBATCH --gpus={gpus}"] if gpus else []),
        *(f"#SBATCH {x.removeprefix('#SBATCH').strip()}" for x in cfg.slurm_extra_sbatch_lines),
        "",
        "set -euo pipefail",
        *cfg.slurm_setup_lines,
        f"export PYTHONPATH={shlex.quote(pythonpath)}",
        f'export {AUTHKEY_ENV}="$(cat {shlex.quote(job_dir + "/authkey")})"',
    ]
    for spec in specs:
        rank0, world_size, world = ranks[(spec.role, 0)]
        env = {
            **spec.env,
            "MASTER_PORT": str(master_ports[world]),
            "WORLD_SIZE": str(world_size),
            "ARENO_RANK_OFFSET": str(rank0),
            "ARENO_ROLE": spec.role,
        }
        srun = ["srun", "--exact", f"--ntasks={spec.n}", f"--cpus-per-task={cfg.slurm_cpus_per_task}"]
        if spec.devices is not None:
            srun.append(f"--gpus-per-task={len(spec.devices) // spec.n}")
        srun.append(f"--output={job_dir}/{spec.role}-%t.log")
        cmd = [
            "env",
            *(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            python,
            "-m",
            "areno.launch.worker",
            "--connect",
            controller,
            "--role",
            spec.role,
            "--slurm",
        ]
        lines.append(" ".join(srun + cmd) + " &")
    lines += ["wait", ""]
    return "\n".join(lines)


class SlurmScheduler(_RpcScheduler):
    """Workers as tasks of one sbatch job per ``create_roles`` call (see the module docstring)."""

    def __init__(self, cfg: SchedulerConfig, *, python: str | None = None) -> None:
        """``python``: the interpreter on the compute nodes (this one by default: a shared venv)."""
        self.cfg = cfg
        self.python = python or sys.executable
        for tool in ("sbatch", "squeue", "srun", "scancel"):
            if shutil.which(tool) is None:
                raise SchedulerError(
                    f"{tool!r} not found on PATH: cluster.scheduler=slurm needs the SLURM client tools; "
                    f"install them or use cluster.scheduler=local|ray"
                )
        check_slurm_controller()
        super().__init__(bind_host="0.0.0.0", connect_timeout_s=cfg.connect_timeout_s, log_dir=cfg.log_dir)
        self.controller = f"{cfg.slurm_controller_addr or socket.gethostname()}:{self._hub.port}"
        self.job_ids: list[str] = []
        self._job_of_role: dict[str, str] = {}
        self._last_poll = 0.0

    def _prepare_env(self, workers: list[_RpcWorker], ranks: dict) -> None:
        ports = {world: free_port() for (_, _, world) in ranks.values()}
        for w in workers:
            rank, _, world = ranks[(w.handle.role, w.handle.index)]
            w.env = {"RANK": str(rank), "MASTER_PORT": str(ports[world]), "ARENO_WORLD": world}
            w.handle = _replace(w.handle, log_path=str(self.log_dir / f"{w.handle.role}-{w.handle.index}.log"))

    def _init_env(self, w: _RpcWorker) -> dict[str, str]:
        master = next(
            x.handle.host
            for ws in self._workers.values()
            for x in ws
            if x.env["ARENO_WORLD"] == w.env["ARENO_WORLD"] and x.handle.rank == 0
        )
        return {"MASTER_ADDR": master}

    def _start(self, workers: list[_RpcWorker]) -> None:
        if all(w.handle.role in self._job_of_role for w in workers):
            for w in workers:  # restart: one task in the running job
                self._start_restart(w)
            return
        roles = list(dict.fromkeys(w.spec.role for w in workers))
        specs = [next(w.spec for w in workers if w.spec.role == r) for r in roles]
        ports = {w.env["ARENO_WORLD"]: int(w.env["MASTER_PORT"]) for w in workers}
        authkey = self.log_dir / "authkey"
        authkey.write_text(self._hub.authkey.hex())
        authkey.chmod(0o600)
        script = render_sbatch(
            specs,
            cfg=self.cfg,
            controller=self.controller,
            job_dir=str(self.log_dir),
            master_ports=ports,
            python=self.python,
            pythonpath=python_path_env(),
            workdir=os.getcwd(),
        )
        path = self.log_dir / f"job-{'-'.join(roles)}.sbatch"
        path.write_text(script)
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SchedulerError(f"sbatch {path} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
        job_id = out.stdout.strip().split(";")[0]
        self.job_ids.append(job_id)
        for role in roles:
            self._job_of_role[role] = job_id

    def restart_command(self, w: _RpcWorker) -> list[str]:
        """The ``srun`` that puts a fresh worker into the running job, on the old worker's node."""
        gpus = [f"--gpus-per-task={len(w.handle.devices)}"] if w.handle.devices else []
        return [
            "srun",
            f"--jobid={self._job_of_role[w.handle.role]}",
            "--overlap",
            "--ntasks=1",
            "--nodes=1",
            f"--nodelist={w.handle.host}",
            *gpus,
            f"--output={w.handle.log_path}",
            self.python,
            "-m",
            "areno.launch.worker",
            "--connect",
            self.controller,
            "--role",
            w.handle.role,
            "--rank",
            str(w.handle.index),
        ]

    def _start_restart(self, w: _RpcWorker) -> None:
        env = {
            **os.environ,
            **w.spec.env,
            "PYTHONPATH": python_path_env(),
            AUTHKEY_ENV: self._hub.authkey.hex(),
            "MASTER_PORT": w.env["MASTER_PORT"],
            "RANK": w.env["RANK"],
            "WORLD_SIZE": str(w.handle.world_size),
            "LOCAL_RANK": "0",
            "ARENO_ROLE": w.handle.role,
        }
        w.proc = subprocess.Popen(
            self.restart_command(w),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def job_state(self, job_id: str) -> str:
        """The job's state from squeue (queued or running) or sacct (finished; FINISHED without accounting)."""
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
        if shutil.which("sacct"):
            out = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        return "FINISHED"

    def _check_alive(self, workers: list[_RpcWorker]) -> None:
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None and w.conn is None:
                raise WorkerDiedError(
                    f"{w.handle.name}: restart step exited with code {w.proc.returncode} before connecting; "
                    f"log {w.handle.log_path}: {_tail(w.handle.log_path)}"
                )
        if time.monotonic() - self._last_poll < self.cfg.slurm_poll_interval_s:
            return
        self._last_poll = time.monotonic()
        for job_id in {self._job_of_role[w.handle.role] for w in workers}:
            state = self.job_state(job_id)
            if state not in _ALIVE_STATES:
                log = self.log_dir / f"slurm-{job_id}.out"
                raise WorkerDiedError(
                    f"SLURM job {job_id} is {state} before its workers connected; log {log}: {_tail(str(log))}"
                )

    def _stop_process(self, w: _RpcWorker) -> None:
        # The connection is closed already, which ends a healthy worker (its recv sees EOF); the
        # srun client of a restart step ends with it.
        if w.proc is not None and w.proc.poll() is None:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.terminate()
                w.proc.wait()

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        for job_id in self.job_ids:
            subprocess.run(["scancel", job_id], capture_output=True)
