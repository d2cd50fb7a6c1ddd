"""``SlurmScheduler``: one sbatch job, one ``srun`` step per role, workers dial back over RPC.

``create_roles`` renders an sbatch script (a heterogeneous job when there are several roles,
one component per role), submits it with ``sbatch --parsable`` and waits for the workers
(``python -m areno.launch.worker --slurm``) to connect to this controller, polling
``squeue``/``sacct`` so that a job that fails or is cancelled ends the wait with its state.
Each task derives ``RANK`` from ``SLURM_PROCID`` plus its role's rank offset in the world;
``MASTER_ADDR`` is the first node of the world's first role. ``restart_worker`` starts a
one-task ``srun --overlap`` step inside the same job on the node of the worker it replaces.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from areno.launch.scheduler import (
    RoleSpec,
    SchedulerConfig,
    SchedulerError,
    _RpcScheduler,
    _RpcWorker,
    _replace,
    _tail,
    assign_ranks,
    free_port,
    python_path_env,
)
from areno.launch.worker import AUTHKEY_ENV

__all__ = ["SlurmScheduler", "render_sbatch"]

_ALIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _role_env(spec: RoleSpec, rank_offset: int, world_size: int, master_port: int, master_var: str) -> list[str]:
    env = {**spec.env, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world_size),
           "ARENO_RANK_OFFSET": str(rank_offset), "ARENO_ROLE": spec.role}
    return [f'MASTER_ADDR="${master_var}"'] + [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]


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
    """The sbatch script for ``specs``: a heterogeneous job with one component and step per role."""
    ranks = assign_ranks(specs)
    het = len(specs) > 1
    lines = ["#!/bin/bash", f"#SBATCH --job-name={cfg.slurm_job_name}", f"#SBATCH --output={job_dir}/slurm-%j.out",
             f"#SBATCH --chdir={workdir}"]
    for k, spec in enumerate(specs):
        if k:
            lines.append("#SBATCH hetjob")
        lines.append(f"#SBATCH --time={cfg.slurm_time}")
        if cfg.slurm_partition:
            lines.append(f"#SBATCH --partition={cfg.slurm_partition}")
        if cfg.slurm_account:
            lines.append(f"#SBATCH --account={cfg.slurm_account}")
        lines.append(f"#SBATCH --ntasks={spec.n}")
        lines.append(f"#SBATCH --cpus-per-task={cfg.slurm_cpus_per_task}")
        if spec.devices is not None:
            lines.append(f"#SBATCH --gpus-per-task={len(spec.devices) // spec.n}")
        if k == 0:
            lines.extend(f"#SBATCH {x.removeprefix('#SBATCH').strip()}" for x in cfg.slurm_extra_sbatch_lines)
    lines += ["", "set -euo pipefail", *cfg.slurm_setup_lines,
              f"export PYTHONPATH={shlex.quote(pythonpath)}",
              f'export {AUTHKEY_ENV}="$(cat {shlex.quote(job_dir + "/authkey")})"']
    first_of_world: dict[str, int] = {}
    for k, spec in enumerate(specs):
        world = ranks[(spec.role, 0)][2]
        first_of_world.setdefault(world, k)
        nodelist = f"SLURM_JOB_NODELIST_HET_GROUP_{k}" if het else "SLURM_JOB_NODELIST"
        if first_of_world[world] == k:
            lines.append(f'master_{k}="$(scontrol show hostnames "${nodelist}" | head -n 1)"')
    for k, spec in enumerate(specs):
        rank0, world_size, world = ranks[(spec.role, 0)]
        env = _role_env(spec, rank0, world_size, master_ports[world], f"master_{first_of_world[world]}")
        srun = ["srun"] + ([f"--het-group={k}"] if het else []) + [
            f"--ntasks={spec.n}", f"--output={job_dir}/{spec.role}-%t.log"]
        cmd = ["env", *env, python, "-m", "areno.launch.worker", "--connect", controller, "--role", spec.role, "--slurm"]
        lines.append(" ".join(srun + cmd) + " &")
    lines += ["wait", ""]
    return "\n".join(lines)


class SlurmScheduler(_RpcScheduler):
    """Workers as tasks of one sbatch job (see the module docstring)."""

    def __init__(self, cfg: SchedulerConfig, *, python: str | None = None) -> None:
        self.cfg = cfg
        self.python = python or sys.executable
        for tool in ("sbatch", "squeue", "srun", "scancel"):
            if shutil.which(tool) is None:
                raise SchedulerError(
                    f"{tool!r} not found on PATH: scheduler.type=slurm needs the SLURM client tools; "
                    f"install them or use scheduler.type=local|ray"
                )
        super().__init__(bind_host="0.0.0.0", connect_timeout_s=cfg.connect_timeout_s, log_dir=cfg.log_dir)
        self.controller = f"{cfg.slurm_controller_addr or socket.gethostname()}:{self._hub.port}"
        self.job_ids: list[str] = []
        self._job_of_role: dict[str, tuple[str, int, bool]] = {}  # role -> (job id, het group, het)
        self._last_poll = 0.0

    def _prepare_env(self, workers: list[_RpcWorker], ranks: dict) -> None:
        for w in workers:
            w.handle = _replace(w.handle, log_path=str(self.log_dir / f"{w.handle.role}-{w.handle.index}.log"))

    def _start(self, workers: list[_RpcWorker]) -> None:
        if all(w.handle.role in self._job_of_role for w in workers):
            for w in workers:  # restart: one task in the running job
                self._start_restart(w)
            return
        specs = list(dict.fromkeys(w.spec.role for w in workers))
        role_specs = [next(w.spec for w in workers if w.spec.role == r) for r in specs]
        ranks = assign_ranks(role_specs)
        ports = {world: free_port() for (_, _, world) in ranks.values()}
        authkey = self.log_dir / "authkey"
        authkey.write_text(self._hub.authkey.hex())
        authkey.chmod(0o600)
        script = render_sbatch(
            role_specs, cfg=self.cfg, controller=self.controller, job_dir=str(self.log_dir), master_ports=ports,
            python=self.python, pythonpath=python_path_env(), workdir=os.getcwd(),
        )
        path = self.log_dir / f"job-{'-'.join(specs)}.sbatch"
        path.write_text(script)
        path.chmod(0o600)
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SchedulerError(f"sbatch {path} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
        job_id = out.stdout.strip().split(";")[0]
        self.job_ids.append(job_id)
        for k, role in enumerate(specs):
            self._job_of_role[role] = (job_id, k, len(specs) > 1)
        for w in workers:
            rank, _, world = ranks[(w.handle.role, w.handle.index)]
            w.env = {"RANK": str(rank), "MASTER_PORT": str(ports[world]), "ARENO_WORLD": world}

    def _start_restart(self, w: _RpcWorker) -> None:
        job_id, group, het = self._job_of_role[w.handle.role]
        cmd = ["srun", f"--jobid={job_id}", *( [f"--het-group={group}"] if het else []), "--overlap",
               "--ntasks=1", "--nodes=1", f"--nodelist={w.handle.host}", "--output", w.handle.log_path or "/dev/null",
               self.python, "-m", "areno.launch.worker", "--connect", self.controller, "--role", w.handle.role,
               "--rank", str(w.handle.index)]
        master = next(x.handle.host for ws in self._workers.values() for x in ws
                      if x.env.get("ARENO_WORLD") == w.env["ARENO_WORLD"] and x.handle.rank == 0)
        env = {**os.environ, **w.spec.env, "PYTHONPATH": python_path_env(), AUTHKEY_ENV: self._hub.authkey.hex(),
               "MASTER_ADDR": master, "MASTER_PORT": w.env["MASTER_PORT"], "RANK": w.env["RANK"],
               "WORLD_SIZE": str(w.handle.world_size), "LOCAL_RANK": "0", "ARENO_ROLE": w.handle.role}
        w.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)

    def job_state(self, job_id: str) -> str:
        """The job's state from squeue (running jobs) or sacct (finished ones)."""
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        states = out.stdout.split()
        if out.returncode == 0 and states:
            bad = [s for s in states if s not in _ALIVE_STATES]
            return bad[0] if bad else states[0]
        if shutil.which("sacct"):
            out = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        return "FINISHED"

    def _check_alive(self, workers: list[_RpcWorker]) -> None:
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None and w.conn is None:
                raise SchedulerError(f"{w.handle.name}: restart step exited with code {w.proc.returncode} before connecting")
        if time.monotonic() - self._last_poll < self.cfg.slurm_poll_interval_s:
            return
        self._last_poll = time.monotonic()
        for job_id in {self._job_of_role[w.handle.role][0] for w in workers}:
            state = self.job_state(job_id)
            if state not in _ALIVE_STATES:
                log = self.log_dir / f"slurm-{job_id}.out"
                raise SchedulerError(f"SLURM job {job_id} is {state} before its workers connected; log {log}: {_tail(str(log))}")

    def _stop_process(self, w: _RpcWorker) -> None:
        # Closing the connection ends a healthy worker (its recv sees EOF); a restart step's srun
        # client ends with it.
        if w.proc is not None and w.proc.poll() is None:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.terminate()

    def shutdown(self) -> None:
        if self._closed:
            return
        super().shutdown()
        for job_id in self.job_ids:
            subprocess.run(["scancel", job_id], capture_output=True)
