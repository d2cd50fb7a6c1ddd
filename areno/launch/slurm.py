"""``SlurmScheduler``: one sbatch job, one ``srun`` step per role, workers dial back over RPC.

``create_roles`` renders an sbatch script that allocates the tasks of all roles and starts one
``srun --exact`` step per role inside that allocation, submits it with ``sbatch --parsable``, waits
for the job to leave the queue (``PENDING`` is no failure: the wait is bounded by
``slurm_queue_timeout_s`` and logs the job's state and reason), then waits
``connect_timeout_s``, counted from the job's start, for the workers (``python -m
areno.launch.worker --slurm``) to connect to this controller, polling ``squeue``/``sacct`` so
that a job that fails or is cancelled ends the wait with its state. A launch that fails (or is
interrupted, or a driver that exits without ``shutdown``) cancels (``scancel``) the jobs
it submitted: a job left in the queue would start later and hold its nodes until its time limit.

Each task takes ``RANK`` = its role's rank offset in the world + ``SLURM_PROCID`` and
``LOCAL_RANK`` = ``SLURM_LOCALID``; ``MASTER_ADDR`` (the node of the world's rank 0) is sent by the
controller once every worker has reported its host. ``restart_worker`` starts a one-task
``srun --overlap`` step inside the same job on the node of the worker it replaces.

Steps rather than a heterogeneous job: SLURM does not place two components of a heterogeneous
job on one node, so a het job cannot run on a single machine (the tests run a real single-node
cluster); steps of one allocation run anywhere, and ``--exact`` keeps them from overlapping.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import fields

from areno.errors import RunStopped
from areno.launch.scheduler import (
    AUTHKEY_ENV,
    RoleSpec,
    SchedulerConfig,
    SchedulerError,
    WorkerDiedError,
    WorkerError,
    WorkerHandle,
    _replace,
    _RpcScheduler,
    _RpcWorker,
    _tail,
    assign_ranks,
    free_port,
    python_path_env,
    worker_command,
)

logger = logging.getLogger(__name__)

__all__ = ["SlurmScheduler", "check_slurm_controller", "render_sbatch", "sbatch_preview"]

_ALIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
_QUEUED_STATES = {
    "PENDING",
    "CONFIGURING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESV_DEL_HOLD",
    "SUSPENDED",
    "RESIZING",
}
"""States of a job that has not started its steps yet (or was put back): waited for, not failures."""

_NEVER_STARTS = {
    "PartitionTimeLimit": "its time limit exceeds the partition's: lower cluster.scheduler_options.slurm_time",
    "PartitionNodeLimit": "it asks for more nodes than the partition has: fewer tasks, or another slurm_partition",
    "BadConstraints": "its constraints cannot be met: check slurm_extra_sbatch_lines",
    "InvalidAccount": "the account is not valid: fix cluster.scheduler_options.slurm_account",
    "InvalidQOS": "the QOS is not valid: fix the --qos of slurm_extra_sbatch_lines",
    "QOSMaxWallDurationPerJobLimit": "its time limit exceeds the QOS's: lower cluster.scheduler_options.slurm_time",
    "DependencyNeverSatisfied": "its dependency can never be satisfied",
}
"""Pending reasons (``squeue %r``) of a job that will not start without a change of its settings."""

QUEUE_PROGRESS_S = 60.0
"""A job still queued is reported (state, reason, time waited) this often, and at every change."""
OPTIONS = "cluster.scheduler_options"

_LIVE: weakref.WeakSet[SlurmScheduler] = weakref.WeakSet()
"""Schedulers whose jobs are cancelled when the interpreter exits without their ``shutdown``."""
_EXIT_HOOK_SET = False


def _cancel_at_exit() -> None:
    for sched in list(_LIVE):
        sched._cancel_jobs()


def _ensure_exit_hook() -> None:
    """Cancel the live schedulers' jobs when the interpreter exits: a ``threading`` exit hook, which runs
    before the interpreter joins its threads (``atexit`` hooks run after, never where a thread hangs)."""
    global _EXIT_HOOK_SET
    if not _EXIT_HOOK_SET:
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # pragma: no cover - every supported Python has it
            import atexit

            register = atexit.register
        register(_cancel_at_exit)
        _EXIT_HOOK_SET = True


@contextlib.contextmanager
def _stop_signals_end_the_wait(job_id: str) -> Iterator[None]:
    """While a job is queued, SIGINT, SIGTERM or SIGHUP (in the main thread) ends the wait with
    ``RunStopped``, so that the launch cancels the job: SIGTERM's default action would end the
    process before any cleanup, and a handler that only notes the signal would keep waiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        raise RunStopped(f"{name} while SLURM job {job_id} waited in the queue: it is cancelled; nothing ran", signum)

    wanted = [signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {s: signal.getsignal(s) for s in wanted}
    for s, handler in previous.items():
        if handler != signal.SIG_IGN:  # an ignored signal (nohup's SIGHUP) stays ignored
            signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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


def _directive(option: str, value: str) -> str:
    """``#SBATCH <option>=<value>``; a value with a space, quote, backslash or ``#`` in double quotes.
    sbatch reads these lines itself, not through the shell: it splits them at whitespace, ends them at an
    unquoted ``#``, groups what is in quotes and takes a character after a backslash as it is."""
    if re.search(r'[\s"\'\\#]', value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"#SBATCH {option}={value}"


def _output_pattern(path: str) -> str:
    """``path`` in an ``--output`` filename pattern, where SLURM replaces ``%j``, ``%t``, ... and reads
    ``%%`` as one ``%``."""
    return path.replace("%", "%%")


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
    """The sbatch script for ``specs``: one allocation, one ``srun`` step per role. No ``--time``
    line when ``cfg.slurm_time`` is empty or None (the partition's default limit applies)."""
    for what, path in (("run_dir (the job's directory)", job_dir), ("the working directory", workdir)):
        if "\n" in path or "\r" in path:  # the script is read line by line, by sbatch and by bash
            raise SchedulerError(f"{what} {path!r} holds a line break, which an sbatch script cannot carry; rename it")
    ranks = assign_ranks(specs)
    gpus = sum(len(spec.devices) for spec in specs if spec.devices is not None)
    lines = [
        "#!/bin/bash",
        _directive("--job-name", cfg.slurm_job_name),
        _directive("--output", f"{_output_pattern(job_dir)}/slurm-%j.out"),
        _directive("--chdir", workdir),
        *([_directive("--time", cfg.slurm_time)] if cfg.slurm_time else []),
        *([_directive("--partition", cfg.slurm_partition)] if cfg.slurm_partition else []),
        *([_directive("--account", cfg.slurm_account)] if cfg.slurm_account else []),
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
        srun.append(shlex.quote(f"--output={_output_pattern(job_dir)}/{spec.role}-%t.log"))
        cmd = [
            "env",
            *(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            *(
                shlex.quote(part)
                for part in worker_command("--connect", controller, "--role", spec.role, "--slurm", python=python)
            ),
        ]
        lines.append(" ".join(srun + cmd) + " &")
    lines += ["wait", ""]
    return "\n".join(lines)


def sbatch_preview(specs: Sequence[RoleSpec], cfg: SchedulerConfig, *, python: str | None = None) -> str:
    """The script ``SlurmScheduler`` would submit for ``specs`` from this host and directory, without
    submitting it (``areno launch slurm-script``): the controller's port and each world's
    ``MASTER_PORT`` are picked afresh at launch, and the authkey file is written then."""
    ranks = assign_ranks(specs)
    return render_sbatch(
        specs,
        cfg=cfg,
        controller=f"{cfg.slurm_controller_addr or socket.gethostname()}:{free_port()}",
        job_dir=str(cfg.log_dir),
        master_ports={world: free_port() for (_, _, world) in ranks.values()},
        python=python or sys.executable,
        pythonpath=python_path_env(),
        workdir=os.getcwd(),
    )


def _default_time(cfg: SchedulerConfig) -> bool:
    """Whether the job's ``--time`` is SchedulerConfig's default (the user did not choose it)."""
    return bool(cfg.slurm_time) and cfg.slurm_time == next(
        f.default for f in fields(SchedulerConfig) if f.name == "slurm_time"
    )


def time_limit_note(cfg: SchedulerConfig) -> str:
    """One line on the job's time limit, for the launch log and the dry run."""
    if not cfg.slurm_time:
        return "no --time: the partition's default time limit applies"
    which = "the default of" if _default_time(cfg) else "from"
    return (
        f"time limit {cfg.slurm_time} ({which} {OPTIONS}.slurm_time): SLURM ends the workers, and so the run, "
        f"when it runs out; set slurm_time to the run's length (e.g. '2-00:00:00'), or null for the partition's limit"
    )


class SlurmScheduler(_RpcScheduler):
    """Workers as tasks of one sbatch job per ``create_roles`` call (see the module docstring)."""

    def __init__(
        self, cfg: SchedulerConfig, *, python: str | None = None, queue_timeout_s: float | None = None
    ) -> None:
        """``python``: the interpreter on the compute nodes (this one by default: a shared venv);
        ``queue_timeout_s``: how long a submitted job may stay queued (default
        ``cfg.slurm_queue_timeout_s``;
        ``math.inf``: no limit)."""
        self.cfg = cfg
        self.python = python or sys.executable
        if queue_timeout_s is None:
            queue_timeout_s = cfg.slurm_queue_timeout_s
        if not queue_timeout_s > 0:
            raise SchedulerError(f"{OPTIONS}.slurm_queue_timeout_s must be > 0 seconds, got {queue_timeout_s}")
        self.queue_timeout_s = float(queue_timeout_s)
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
        self._cancelled: set[str] = set()
        self._last_poll = 0.0
        _LIVE.add(self)  # a driver that exits without shutdown() leaves no job queued
        _ensure_exit_hook()
        if os.environ.get("SLURM_JOB_ID"):
            logger.warning(
                "this driver runs inside SLURM job %s, and cluster.scheduler=slurm submits another job for the "
                "workers; to run the workers inside this allocation use cluster.scheduler=local (one node) or a "
                "Ray cluster started on its nodes (cluster.scheduler=ray); see docs/launch.md",
                os.environ["SLURM_JOB_ID"],
            )

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
        logger.info(
            "SLURM job %s submitted (%s, %d tasks; log %s); its workers dial back to %s",
            job_id,
            path,
            sum(spec.n for spec in specs),
            self.log_dir / f"slurm-{job_id}.out",
            self.controller,
        )
        logger.log(
            logging.WARNING if _default_time(self.cfg) else logging.INFO,
            "SLURM job %s: %s",
            job_id,
            time_limit_note(self.cfg),
        )
        with _stop_signals_end_the_wait(job_id):
            self._wait_started(job_id)

    def _wait_started(self, job_id: str) -> None:
        """Return once the job runs; queued states are waited for up to ``queue_timeout_s`` (with a
        line on its state and reason now and then); a job that ended, or will never start, raises."""
        t0 = time.monotonic()
        said: tuple[str, str] | None = None
        next_note = t0
        while True:
            state, reason = self.job_status(job_id)
            waited = time.monotonic() - t0
            if state == "RUNNING":
                if said is not None:
                    logger.info("SLURM job %s started after %.0f s in the queue", job_id, waited)
                return
            if state not in _QUEUED_STATES:
                log = self.log_dir / f"slurm-{job_id}.out"
                raise WorkerDiedError(
                    f"SLURM job {job_id} is {state} before its workers connected; log {log}: {_tail(str(log))}"
                )
            why = f" ({reason})" if reason and reason != "None" else ""
            if reason in _NEVER_STARTS:
                raise SchedulerError(
                    f"SLURM job {job_id} is {state}{why} and will not start: {_NEVER_STARTS[reason]}; it was cancelled"
                )
            if waited >= self.queue_timeout_s:
                raise SchedulerError(
                    f"SLURM job {job_id} is still {state}{why} after {waited:.0f}s in the queue (limit "
                    f"{self.queue_timeout_s:g}s, {OPTIONS}.slurm_queue_timeout_s); it was cancelled: raise the "
                    f"limit, ask for fewer resources or another slurm_partition"
                )
            now = time.monotonic()
            if (state, reason) != said or now >= next_note:
                limit = "no limit" if math.isinf(self.queue_timeout_s) else f"up to {self.queue_timeout_s:g}s"
                logger.info(
                    "SLURM job %s is %s%s after %.0f s in the queue; waiting %s for it to start "
                    "(%s.slurm_queue_timeout_s; the connect timeout counts from its start); Ctrl-C cancels it",
                    job_id,
                    state,
                    why,
                    waited,
                    limit,
                    OPTIONS,
                )
                said, next_note = (state, reason), now + QUEUE_PROGRESS_S
            time.sleep(max(0.0, min(self.cfg.slurm_poll_interval_s, self.queue_timeout_s - waited)))

    def _connect(self, workers: list[_RpcWorker]) -> None:
        try:
            super()._connect(workers)
        except WorkerError as e:
            if not self._start_timed_out(e, workers):
                raise  # a worker died, or a constructor raised: the message says which
            jobs = sorted({self._job_of_role[w.handle.role] for w in workers if w.handle.role in self._job_of_role})
            states = ", ".join(f"SLURM job {j} is {self.job_state(j)}" for j in jobs)
            logs = " ".join(
                f"{self.log_dir / f'slurm-{j}.out'}: {_tail(str(self.log_dir / f'slurm-{j}.out'))}" for j in jobs
            )
            raise WorkerError(
                f"{e} of their job's start ({states}; {OPTIONS}.connect_timeout_s counts from the start): every "
                f"node must reach this controller at {self.controller} ({OPTIONS}.slurm_controller_addr) and "
                f"import areno; job log {logs}"
            ) from None

    def create_roles(self, specs: Sequence[RoleSpec]) -> dict[str, list[WorkerHandle]]:
        submitted = len(self.job_ids)
        try:
            return super().create_roles(specs)
        except BaseException:  # Ctrl-C too: a job left queued would start later and hold its nodes
            self._cancel_jobs(self.job_ids[submitted:])
            raise

    def _cancel_jobs(self, job_ids: Sequence[str] | None = None) -> None:
        """``scancel`` each job not cancelled yet (default: every job submitted); a failure is
        logged with the command to run by hand."""
        for job_id in list(self.job_ids if job_ids is None else job_ids):
            if job_id in self._cancelled:
                continue
            self._cancelled.add(job_id)
            for role in [r for r, j in self._job_of_role.items() if j == job_id]:
                del self._job_of_role[role]  # a later create_roles of these roles submits a new job
            try:
                out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=60)
                problem = (out.stderr.strip() or f"exit code {out.returncode}") if out.returncode else ""
            except (OSError, subprocess.TimeoutExpired) as e:
                problem = f"{type(e).__name__}: {e}"
            if problem:
                logger.warning("scancel %s failed (%s): cancel it yourself with `scancel %s`", job_id, problem, job_id)
            else:
                logger.info("SLURM job %s cancelled", job_id)

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
            f"--output={_output_pattern(str(w.handle.log_path))}",
            *worker_command(
                "--connect", self.controller, "--role", w.handle.role, "--rank", str(w.handle.index), python=self.python
            ),
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

    def job_status(self, job_id: str) -> tuple[str, str]:
        """``(state, reason)`` from squeue (the reason a queued job waits: ``Priority``,
        ``Resources``, ...), or ``(job_state(), "")`` for a job squeue no longer lists."""
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            state, _, reason = out.stdout.strip().splitlines()[0].partition("|")
            return state.strip(), reason.strip()
        return self.job_state(job_id), ""

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
        try:
            super().shutdown()
        finally:
            self._cancel_jobs()
            _LIVE.discard(self)
