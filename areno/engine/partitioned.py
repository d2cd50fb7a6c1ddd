"""The partitioned placement: training and rollout on separate workers of one distributed world (seed 000).

The controller (the Trainer's process) starts, through the scheduler ``cluster.scheduler`` names
(local subprocesses, Ray actors or a SLURM job: ``areno.engine.cluster.scheduler_for``), ``n_train`` training
workers (``TrainWorker``: the recipe's roles on ``FSDP2TrainBackend`` over the training sub-mesh)
and ``n_rollout`` rollout workers (``RolloutWorker``: a ``RolloutEngine`` behind the token-level
HTTP server on 127.0.0.1), all in ONE torch.distributed world (gloo on CPU, NCCL on GPU) with
separate groups (``areno.engine.cluster``). ``ArenoEngine`` reaches them through the remote sides
(``engine/remote.py``):

    generate_rollout   WorkflowExecutor (controller) -> MultiServerRolloutClient -> HTTP /generate on
                       each rollout replica, round-robin over those a HealthMonitor holds healthy (a
                       dead replica's requests go to the others), each request under
                       rollout.request_timeout_s; the rollout engines keep their policy until a sync
                       completes
    step               the TokenBatch goes to every training worker; RecipeRunner on each
    update_weights     StreamTransport: training DP rows -> relay rollout rank -> every rollout rank,
                       bucketed, all-or-nothing commit; the version bumps only when the sync
                       completed on every rank; its ``policy_sync_*`` figures ride with the next
                       step's metrics

This module holds the placement (``PartitionedCluster``: layout, memory check, launch, which
workers are alive) and what the controller and the workers (``engine/workers.py``) share.

A worker lost (its process gone, or a rollout replica whose server gave no ``/health`` answer for
``cluster.worker_stall_s``: declared lost and killed, ``check_stalls``) breaks the world: every wait on it
(``gather``) fails at once naming the worker lost first, the Trainer saves an emergency checkpoint of the
training side when it is intact (``RemoteTrainingSide.save``: the training ranks alone, once the rollout
workers are retired), and the run stops. ``stop`` is bounded: a worker still in its shutdown after
``SHUTDOWN_TIMEOUT_S`` is killed.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import faulthandler
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areno.engine.api import resolve_device, rollout_max_num_seqs, rollout_sequences_in_flight
from areno.engine.cluster import (
    ClusterLayout,
    LayoutError,
    estimate_memory,
    layout_from_config,
    scheduler_for,
    validate_host_memory,
    validate_memory,
)
from areno.engine.config import ArenoConfig, ClusterSection, field_default, resolve_dtypes
from areno.engine.host import apply_host_settings
from areno.errors import ConfigError, RunFailure
from areno.launch.scheduler import (
    RUN_DIR_ENV,
    RoleSpec,
    WorkerDiedError,
    log_workers,
    scheduler_config,
    usable_cores,
)
from areno.launch.storage import check_shared_storage
from areno.launch.watchdog import process_state
from areno.models import moe
from areno.models.config import ModelConfig
from areno.models.hf_io import read_config
from areno.models.tp_plan import check_tp_size
from areno.recipes import get_recipe
from areno.sync.stream import StreamSyncConfig
from areno.train import checkpoint
from areno.train.context_parallel import check_context_parallel
from areno.train.offload import available_host_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "PartitionedCluster",
    "WorkerLostError",
    "cpu_oversubscription",
    "gather_fail_fast",
    "is_partitioned",
    "kv_tokens_for",
    "stall_setting",
    "warn_cpu_oversubscription",
]


class WorkerLostError(RunFailure):
    """A worker of the partitioned world died (or stopped answering and was killed); its world cannot
    be re-formed in place. ``training_side_intact``: every lost worker is a rollout worker, so the
    training workers still hold the trained state (the Trainer saves an emergency checkpoint of it);
    ``in_flight``: the operation of the world the loss broke (``"the policy sync"``), None when it was
    found between operations."""

    def __init__(self, message: str, *, training_side_intact: bool = False, in_flight: str | None = None) -> None:
        super().__init__(message)
        self.training_side_intact = training_side_intact
        self.in_flight = in_flight


NO_CHECKPOINT_YET = "start it again (no checkpoint yet)"
"""The advice of a lost worker's message when the run saved no checkpoint (``dead_workers``)."""
RESUME_FROM_CHECKPOINT = "go on from its last checkpoint with resume=auto"
"""The advice of a lost worker's message when it did (the Trainer's emergency checkpoint counts)."""

STALL_KEY = "cluster.worker_stall_s"
STALL_ENV = "ARENO_WORKER_STALL_S"
"""Overrides ``cluster.worker_stall_s`` when set: scripts and tests that set it before the key existed
keep working, and a run can be given another deadline without editing its config."""
SHUTDOWN_TIMEOUT_S = 15.0
"""How long ``PartitionedCluster.stop`` waits for a role's workers to finish ``shutdown`` (all at once)
before it kills those still in it: a stalled worker never holds the controller's exit."""


def stall_setting(config: ArenoConfig | None) -> tuple[float, str]:
    """``(seconds, the setting that gave them)``: a rollout worker whose server has not answered
    ``/health`` for this long (its ``HealthMonitor`` holds it unhealthy) is declared lost: killed
    (``kill -9`` of its process group), and the run stops as for a worker that died, naming it, after
    an emergency checkpoint of the training side; 0: never. ``ARENO_WORKER_STALL_S`` when set (it
    overrides the config), else ``cluster.worker_stall_s`` (its default without a ``config``). Without
    it a stopped or deadlocked worker (``kill -STOP``, a hung kernel, a stuck NFS read) left the run
    waiting for ``rollout.request_timeout_s`` and ``cluster.sync_timeout_s`` again and again."""
    value = os.environ.get(STALL_ENV)
    if value is None:
        stall_s = (
            config.cluster.worker_stall_s if config is not None else field_default(ClusterSection, "worker_stall_s")
        )
        return float(stall_s), STALL_KEY
    try:
        stall_s = float(value)
    except ValueError:
        stall_s = float("nan")
    if not 0 <= stall_s < float("inf"):
        raise ConfigError(
            f"{STALL_ENV}={value!r}: must be a finite number of seconds >= 0 (0: never); or unset it and set {STALL_KEY}"
        )
    return stall_s, STALL_ENV


def _setting(layout: ClusterLayout, key: str, size: int) -> str:
    """The setting that gave a TP size: the allocation string when the run has one, else ``key``."""
    return (
        f"cluster.allocation_mode={layout.allocation_mode!r} (t{size})" if layout.allocation_mode else f"{key}={size}"
    )


def cpu_oversubscription(config: ArenoConfig, layout: ClusterLayout) -> str | None:
    """A warning when a CPU run's worker processes, times their threads, outnumber the cores this
    process may use (None otherwise): they then start slowly enough to miss the connect timeout and
    train far slower than a smaller placement would."""
    if layout.cuda:
        return None
    procs = layout.n_train + layout.n_rollout
    threads = config.cluster.cpu_threads or 1
    cores = usable_cores()
    if procs * threads <= cores:
        return None
    timeout_s = scheduler_config(config.cluster.scheduler, config.cluster.scheduler_options).connect_timeout_s
    where = (
        f"cluster.allocation_mode={config.cluster.allocation_mode}"
        if config.cluster.allocation_mode
        else "cluster.train_devices + cluster.rollout_devices"
    )
    each = (
        f"{threads} thread(s) each (cluster.cpu_threads)"
        if config.cluster.cpu_threads
        else ("each with torch's default of one thread per core (set cluster.cpu_threads=1)")
    )
    return (
        f"{where} on the CPU starts {procs} worker processes ({layout.n_train} training, {layout.n_rollout} rollout), "
        f"{each}, on {cores} cores: they start slowly (the connect timeout, cluster.scheduler_options."
        f"connect_timeout_s={timeout_s:g} s, may pass) and train slower than fewer would; use at most {cores} "
        f"processes (e.g. cluster.allocation_mode='areno:d1+fsdp:d1'), or raise connect_timeout_s"
    )


PROMPT_TOKENS_EST = 256
"""Prompt tokens per sequence assumed by the KV-cache estimate."""


def is_partitioned(config: ArenoConfig) -> bool:
    """True when the config asks for the partitioned topology (what ``build_engine`` checks):
    device lists or a ``+`` allocation_mode that parts rollout from the policy (one that colocates
    them places recipe roles: ``ClusterSection.string_role_devices``), and an online recipe (offline
    recipes such as the pipeline's sft warm start have no rollout side and run colocated)."""
    return config.cluster.asks_partitioned() and _online(config)


def _online(config: ArenoConfig) -> bool:
    """Whether the run's recipe (with ``train.algorithm_kwargs``: a teacher's path) generates rollouts."""
    return get_recipe(config.train.algorithm, policy_kwargs=dict(config.train.algorithm_kwargs)).online


def kv_tokens_for(config: ArenoConfig, max_positions: int) -> int:
    """KV-cache tokens a rollout replica holds: the configured blocks, else every sequence its engine can
    run at once (the run's sequences in flight, at most its running batch: waiting ones hold no KV) at a
    nominal prompt plus its full completion, and at least one sequence of the engine's ``max_model_len``
    (``rollout.max_model_len``, else the model's ``max_positions``), so that any request it accepts fits."""
    r = config.rollout
    if r.kv_blocks:
        return r.kv_blocks * r.block_size
    running = min(rollout_max_num_seqs(config), rollout_sequences_in_flight(config))
    return max(running * (PROMPT_TOKENS_EST + r.max_new_tokens), r.max_model_len or max_positions)


def bind_host(config: ArenoConfig) -> str:
    """Where a rollout worker's server listens: loopback when the local scheduler runs every worker
    on the controller's machine, all interfaces (with an API key) when Ray or SLURM may place it on
    another node."""
    return "127.0.0.1" if config.cluster.scheduler == "local" else "0.0.0.0"


def advertised_address(host: str) -> str:
    """The address the controller dials: loopback for a loopback server, else this node's address
    on the route to the world's rendezvous host (``MASTER_ADDR``, set by every scheduler)."""
    if host == "127.0.0.1":
        return host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: no packet is sent
        return probe.getsockname()[0]


def _device_type(config: ArenoConfig) -> str:
    return resolve_device(config.cluster.device).type


def apply_process_settings(config: ArenoConfig) -> None:
    """A worker process's own settings: torch's CPU threads and malloc's (``engine/host.py``)."""
    apply_host_settings(config.cluster, _device_type(config))


def init_world(config: ArenoConfig) -> str:
    """A worker joins the world (env from the scheduler); returns the device type."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks to the worker log
    device_type = _device_type(config)
    apply_process_settings(config)
    if device_type == "cuda":
        torch.cuda.set_device(0)  # the scheduler gave this worker exactly its device
    if not dist.is_initialized():
        # The world is gloo even on GPU: overlapping device lists put two ranks on one GPU, which
        # an NCCL communicator must never hold. NCCL lives in the subgroups (build_groups and the
        # stream transport's data plane), whose members are on distinct GPUs by construction.
        dist.init_process_group("gloo", timeout=collective_timeout(config))
    return device_type


def collective_timeout(config: ArenoConfig) -> datetime.timedelta:
    """``cluster.collective_timeout_s``: the world's and every group's (``build_groups``)."""
    return datetime.timedelta(seconds=config.cluster.collective_timeout_s)


def _sync_config(config: ArenoConfig, model_config: ModelConfig):
    """The stream sync's settings; ``model_config``: the synced model's (its float32 tensors keep their dtype on
    the wire). Both sides must pass the same one: they plan the buckets alike."""
    dtype_name = resolve_dtypes(config, _device_type(config)).rollout
    wire = None if dtype_name == "float32" else getattr(torch, dtype_name)
    return StreamSyncConfig(
        bucket_bytes=config.cluster.sync_bucket_bytes,
        timeout_s=config.cluster.sync_timeout_s,
        wire_dtype=wire,
        float32_names=frozenset(moe.float32_names(model_config)),
    )


_crowding_warned: set[str] = set()


def warn_cpu_oversubscription(config: ArenoConfig, layout: ClusterLayout) -> None:
    """``cpu_oversubscription``'s warning, logged once per process (preflight and the launch both ask)."""
    crowded = cpu_oversubscription(config, layout)
    if crowded and crowded not in _crowding_warned:
        _crowding_warned.add(crowded)
        logger.warning("%s", crowded)


class PartitionedCluster:
    """The partitioned world seen from the controller: its layout, the scheduler running its
    workers, and which of them are alive. Both remote sides hold the same one."""

    ROLES = ("rollout", "train")
    """The worker roles, in the order they are shut down."""

    # set in __init__
    config: ArenoConfig
    run_dir: Path
    layout: ClusterLayout
    scheduler: Any
    stall_s: float
    """``cluster.worker_stall_s``, or ``ARENO_WORKER_STALL_S`` where set (``stall_setting``); 0: never."""
    # set in launch()
    api_key: str | None = None
    """The random key every request to a rollout server carries (None until launched)."""

    def __init__(
        self,
        config: ArenoConfig,
        run_dir: Path,
        *,
        scheduler: Any = None,
        device_capacity: dict[int, int] | int | None = None,
    ) -> None:
        """``scheduler``: a started ``Scheduler`` (default: the one ``cluster.scheduler`` names,
        logging to ``run_dir/workers``); ``device_capacity``: bytes per logical device for the memory check
        (default: each visible GPU's total memory; no check on CPU). The layout is validated here,
        before anything loads."""
        self.config = config
        self.run_dir = run_dir
        self.scheduler = scheduler
        self._device_capacity = device_capacity
        self._launched = False
        self._stopped: set[str] = set()
        self._lost: dict[tuple[str, int], str] = {}
        """``(role, index) -> what happened`` of each worker found dead or declared stalled, in the order
        found: the first is the run's root cause."""
        self._lost_lock = threading.Lock()
        self._probes: dict[tuple[str, int], concurrent.futures.Future] = {}
        """The ``pid`` call of each worker's last liveness probe (a stalled worker's never returns: it is
        waited on again rather than queued behind itself)."""
        self._health: Any = None
        self._replicas: list[tuple[str, tuple[int, ...]]] = []
        """Each rollout replica's URL and its workers' indices (``watch_health``)."""
        self._stall_warned: set[str] = set()
        self.stall_s, self._stall_key = stall_setting(config)  # a bad ARENO_WORKER_STALL_S: refused before launch
        self._retired: set[str] = set()
        """Roles ``retire`` stopped: the world is down to the other role's workers (the emergency save's
        training ranks), whose calls no longer wait on them."""
        if not _online(config):
            raise ConfigError(
                f"recipe {config.train.algorithm!r} trains offline: the partitioned topology is for online "
                "RL; unset cluster.train_devices/rollout_devices to run it colocated"
            )
        self.layout = self.plan_layout()

    def plan_layout(self) -> ClusterLayout:
        """The validated layout (lists, TP, routing) — raises before anything is loaded."""
        cfg = self.config
        cuda = _device_type(cfg) == "cuda"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cuda:
            ids = (
                tuple(d for d in visible.split(",") if d.strip())
                if visible is not None
                else tuple(str(i) for i in range(torch.cuda.device_count()))
            )
        else:
            ids = ()
        layout = layout_from_config(cfg.cluster, num_devices=len(ids) if cuda else 0, cuda=cuda, device_ids=ids)
        if layout is None:
            raise LayoutError(
                "the partitioned placement needs cluster.train_devices + cluster.rollout_devices "
                "or a cluster.allocation_mode with a '+' (e.g. 'areno:d1+fsdp:d1'); without them the engine "
                "runs colocated"
            )
        if layout.rollout_tp > 1 and cfg.rollout.max_head_offpolicyness > 0 and cfg.cluster.sync_commit == "inplace":
            # an in-place sync pauses each TP rank at its own step boundary while the replica generates
            raise LayoutError(
                f"rollout TP {layout.rollout_tp} with asynchronous RL needs cluster.sync_commit=staged "
                "(its TP ranks then switch weights at the same step); or set rollout.max_head_offpolicyness=0"
            )
        layout.relays()  # routing error (no relay on another device) before launch
        return layout

    def check_tp(self, layout: ClusterLayout, model_config: ModelConfig) -> None:
        """LayoutError (one line) when the training or rollout TP size cannot split the model's
        heads, MLP or vocabulary (``areno.models.tp_plan.check_tp_size``), or training TP meets ``train.lora``."""
        if model_config.vision is not None and layout.rollout_tp > 1:  # its rollout engine loads whole
            raise LayoutError(
                f"{_setting(layout, 'cluster.rollout_tp', layout.rollout_tp)}: a vision-language model's rollout "
                "engine runs without tensor parallelism; "
                + ("give the rollout component t1" if layout.allocation_mode else "set cluster.rollout_tp=1")
            )
        if layout.train_tp > 1 and self.config.train.lora is not None:  # the backend refuses it once loaded
            raise LayoutError(
                f"train.lora with {_setting(layout, 'cluster.train_tp', layout.train_tp)}: LoRA does not train under "
                "tensor parallelism; set train.lora=null, or "
                + ("give the training component t1" if layout.allocation_mode else "set cluster.train_tp=1")
            )
        for what, size in (("cluster.train_tp", layout.train_tp), ("cluster.rollout_tp", layout.rollout_tp)):
            try:
                check_tp_size(model_config, size)
            except ValueError as e:
                raise LayoutError(f"{_setting(layout, what, size)}: {e}") from None
        try:
            check_context_parallel(model_config, layout.train_cp)
        except ConfigError as e:
            raise LayoutError(f"cluster.allocation_mode={layout.allocation_mode!r} (c{layout.train_cp}): {e}") from None

    def check_memory(self, layout: ClusterLayout, model_dir: Path) -> None:
        """LayoutError when some device cannot hold what the layout puts on it (``estimate_memory``
        against ``device_capacity``, default each GPU's total memory; nothing checked on CPU)."""
        cfg = self.config
        cuda = layout.cuda
        if cfg.cluster.scheduler == "local":  # one host runs every worker
            train_dtype = resolve_dtypes(cfg, "cuda" if cuda else "cpu").train
            validate_host_memory(layout, read_config(model_dir), train_dtype, available_host_bytes())
        capacity = self._device_capacity
        if capacity is None and cuda:
            capacity = {
                d: torch.cuda.get_device_properties(d).total_memory
                for d in set(layout.train_devices) | set(layout.rollout_devices)
            }
        if capacity is not None:
            model_config = read_config(model_dir)
            dtypes = resolve_dtypes(cfg, "cuda" if cuda else "cpu")
            est = estimate_memory(
                layout,
                model_config,
                train_dtype=dtypes.train,
                rollout_dtype=dtypes.rollout,
                kv_tokens=kv_tokens_for(cfg, model_config.max_seq_len),
            )
            validate_memory(layout, est, capacity)

    def launch(self, model_dir: Path) -> None:
        """Start every worker of the world, once: both roles at a time, since they join one
        world (the memory check first, then the scheduler's roles, then the shared-storage probe)."""
        if self._launched:
            return
        cfg, layout = self.config, self.layout
        self.check_tp(layout, read_config(model_dir))
        self.check_memory(layout, model_dir)
        warn_cpu_oversubscription(cfg, layout)
        logger.info("partitioned topology: %s", layout.describe())
        if self.scheduler is None:
            self.scheduler = scheduler_for(cfg.cluster, layout, log_dir=str(self.run_dir / "workers"))
            if hasattr(self.scheduler, "fresh_logs"):
                # a run that starts over (a new run, overwrite=true, nothing to resume) truncates its
                # workers' logs; a resumed one appends to them after a separator line
                self.scheduler.fresh_logs = checkpoint.latest_complete(self.run_dir / "checkpoints") is None
        env = {RUN_DIR_ENV: str(self.run_dir)}
        args = (cfg, layout, str(model_dir))
        # every request carries this key, also on loopback: an unkeyed server trusts every local user
        self.api_key = secrets.token_urlsafe(32)
        self.scheduler.create_roles(
            [
                RoleSpec(
                    role="train",
                    worker_cls="areno.engine.workers:TrainWorker",
                    n=layout.n_train,
                    env=env,
                    args=args,
                    devices=list(layout.train_devices) if layout.cuda else None,
                    world="areno",
                ),
                RoleSpec(
                    role="rollout",
                    worker_cls="areno.engine.workers:RolloutWorker",
                    n=layout.n_rollout,
                    env=env,
                    args=args,
                    kwargs={"api_key": self.api_key},
                    devices=list(layout.rollout_devices) if layout.cuda else None,
                    world="areno",
                ),
            ]
        )
        self._launched = True
        log_workers(self.scheduler)
        # checkpoints (DCP, written by the training ranks) and exports go under run_dir: every node must see it
        check_shared_storage([str(self.run_dir)], self.scheduler)

    def replica_urls(self) -> list[str]:
        """The URL of each rollout replica's server (its TP group's leader)."""
        urls = self.scheduler.call("rollout", "url")
        return [urls[r - self.layout.n_train] for r in self.layout.replica_leaders()]

    def check_workers(self, *, timeout_s: float = 60) -> None:
        """WorkerLostError (one line) naming the first lost worker (dead, or declared stalled). A dead
        rollout replica only loses its in-flight HTTP requests, which the client re-sends to another
        replica (the episode, run here, is neither lost nor duplicated); but the policy sync needs
        every rank of the world, which cannot be re-formed around a new process in place."""
        lost = self.lost_workers(timeout_s=timeout_s)
        if lost:
            raise self._lost_error(lost, in_flight=None)

    def lost_workers(self, *, timeout_s: float = 5) -> dict[tuple[str, int], str]:
        """``(role, index) -> why`` (one line naming it, its pid and log, and what to do) for every worker
        lost: declared stalled, or whose process is gone; the root cause first."""
        for role in ("train", "rollout"):
            self.dead_workers(role, timeout_s=timeout_s)  # records the dead in self._lost
        with self._lost_lock:
            keys = list(self._lost)
        return {key: self._why(*key) for key in keys}

    def _lost_error(self, lost: dict[tuple[str, int], str], *, in_flight: str | None) -> WorkerLostError:
        return WorkerLostError(
            next(iter(lost.values())),
            training_side_intact=all(role == "rollout" for role, _ in lost),
            in_flight=in_flight,
        )

    def _why(self, role: str, index: int) -> str:
        handle = self.scheduler.workers(role)[index]
        saved = checkpoint.latest_complete(self.run_dir / "checkpoints") is not None
        again = RESUME_FROM_CHECKPOINT if saved else NO_CHECKPOINT_YET
        return (
            f"{handle.name} (pid {handle.pid}) {self._lost[(role, index)]}; the distributed world cannot be "
            f"re-formed in place: {again} (log: {handle.log_path})"
        )

    def dead_workers(self, role: str, timeout_s: float) -> dict[int, str]:
        """``index -> why`` for each worker of ``role`` whose process is gone or that was declared stalled
        (``check_stalls``); a worker too busy to answer within ``timeout_s`` counts as alive."""
        handles = self.scheduler.workers(role)
        probes = {}
        for i in range(len(handles)):
            if (role, i) in self._lost:
                continue
            probe = self._probes.get((role, i))
            if probe is None or probe.done():
                probe = self._probes[(role, i)] = self.scheduler.submit_one(role, i, "pid")
            probes[i] = probe
        deadline = time.monotonic() + timeout_s
        for i, probe in probes.items():
            try:
                probe.result(timeout=max(deadline - time.monotonic(), 0.0))
            except WorkerDiedError:
                self._record_lost(role, i, "died")
            except concurrent.futures.TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - it answered (with an error): alive
                pass
        return {i: self._why(role, i) for r, i in list(self._lost) if r == role}

    def _record_lost(self, role: str, index: int, what: str) -> bool:
        """Note ``role[index]`` as lost (``what`` happened to it); False when it was already."""
        with self._lost_lock:
            if (role, index) in self._lost:
                return False
            self._lost[(role, index)] = what
            return True

    # ------------------------------------------------------------------ stalled rollout workers
    def watch_health(self, health: Any, urls: list[str]) -> None:
        """Judge the rollout workers by ``health`` (a ``HealthMonitor`` of ``urls``, one per replica in
        ``replica_urls``' order): ``check_stalls`` declares a replica lost once its server has not
        answered ``/health`` for ``stall_s``."""
        if self._stall_key == STALL_ENV:  # said once, where the watch starts
            logger.warning(
                "%s=%g overrides %s=%g: %s",
                STALL_ENV,
                self.stall_s,
                STALL_KEY,
                self.config.cluster.worker_stall_s,
                f"a rollout worker is declared lost after {self.stall_s:g} s without a /health answer"
                if self.stall_s
                else "no rollout worker is declared lost for its silence",
            )
        groups = self.layout.rollout_tp_groups()
        n_train = self.layout.n_train
        self._health = health
        self._replicas = [(url, tuple(r - n_train for r in group)) for url, group in zip(urls, groups)]

    def check_stalls(self) -> list[str]:
        """Declare lost every rollout replica whose server has been unhealthy, with no ``/health``
        answer for ``stall_s`` (0: never): each of its workers is killed (its process group), so the
        calls and requests waiting on it fail at once, and named as the run's root cause; where the
        scheduler cannot kill it, ``gather`` stops waiting on it. A warning names it at half that time.
        Returns the whys of those declared now."""
        stall_s = self.stall_s
        if self._health is None or not stall_s:
            return []
        declared = []
        for url, indices in self._replicas:
            if self._health.is_healthy(url) or all(("rollout", i) in self._lost for i in indices):
                self._stall_warned.discard(url)
                continue
            silent = self._health.silent_for(url)
            leader = self.scheduler.workers("rollout")[indices[0]]
            local = bool(leader.pid) and leader.host == socket.gethostname()
            state = process_state(leader.pid) if local else None
            if local and (state is None or state.startswith("a zombie")):  # dead: dead_workers names it
                continue
            seen = f", its process {state}" if state else ""
            if silent >= stall_s:
                what = (
                    f"stopped answering: its server {url} gave no /health answer for {silent:.0f} s{seen}; "
                    f"killed after {self._stall_key}={stall_s:g}"
                )
                for i in indices:
                    if self._record_lost("rollout", i, what):
                        declared.append(self._why("rollout", i))
                        logger.error("%s", declared[-1])
                        try:
                            self.scheduler.kill_worker("rollout", i)
                        except NotImplementedError:
                            logger.warning("cannot kill %s here: it is stopped with the run", leader.name)
            elif silent >= stall_s / 2 and url not in self._stall_warned:
                self._stall_warned.add(url)
                logger.warning(
                    "rollout worker %s (pid %s, log %s) has not answered /health for %.0f s%s; it is declared lost, "
                    "and the run stops, if it does not answer within %g s of its last answer (%s)",
                    leader.name,
                    leader.pid,
                    leader.log_path,
                    silent,
                    seen,
                    stall_s,
                    self._stall_key,
                )
        return declared

    # ------------------------------------------------------------------ waiting on the world
    def gather(self, futures: list, what: str) -> list:
        """Results of worker futures in order (``what``: the operation, for messages). The first worker
        error is raised at once, as the lost worker it comes from when a worker of the world was lost
        (the others then fail in its collectives: naming them would hide the cause); a rollout worker
        that stops answering is declared lost meanwhile (``check_stalls``), so nothing waits on it for
        ``cluster.sync_timeout_s``. A worker lost before or during the call (the stall watcher's thread
        may declare it first) fails it as well while the futures wait: a call on the world waits on
        every rank, and a stalled worker the scheduler cannot kill never fails its own. Only the
        training ranks' calls after ``retire("rollout")`` (the emergency save) wait on."""
        wait_s = 0.0  # first look: a worker lost before this call fails it without a second's wait
        while True:
            done, pending = concurrent.futures.wait(
                futures, timeout=wait_s, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                raise self.root_cause(failed.exception(), what) from failed.exception()
            if not pending:
                return [f.result() for f in futures]
            if self.check_stalls():  # declared lost now (and killed, where the scheduler can): the world is broken
                raise self._lost_error(self.lost_workers(timeout_s=5), in_flight=what)
            with self._lost_lock:
                lost = list(self._lost)
            if any(role not in self._retired for role, _ in lost):  # found or declared before: named as recorded
                raise self._lost_error({key: self._why(*key) for key in lost}, in_flight=what)
            wait_s = 1.0

    def root_cause(self, exc: BaseException, what: str) -> BaseException:
        """``exc`` (a worker's error during ``what``), or the ``WorkerLostError`` of the worker lost
        first when one was: a worker in a collective with a dead one fails too, and its error (gloo's
        "Connection reset by peer") names the wrong process."""
        if isinstance(exc, WorkerLostError):
            return exc
        lost = self.lost_workers(timeout_s=5)
        if not lost:
            return exc
        logger.warning("%s failed as a worker of the world was lost: %s", what, _first_line(exc))
        return self._lost_error(lost, in_flight=what)

    def retire(self, role: str, what: str) -> None:
        """Kill every worker of ``role`` not lost yet, noting ``what`` happened to it (after the root
        cause): once the world is broken its rollout workers have nothing left to do, and a training
        rank waiting for them in a collective of the broken sync (its vote) gets its error at once
        instead of after ``cluster.sync_timeout_s``. The calls ``gather`` waits on from then on are the
        other role's alone: they no longer fail for ``role``'s losses."""
        self._retired.add(role)
        for i in range(len(self.scheduler.workers(role))):
            if self._record_lost(role, i, what):
                self._kill(role, i)

    def require_idle(self, role: str, timeout_s: float = 20) -> None:
        """RunFailure unless every worker of ``role`` answers a call within ``timeout_s``: none is still
        inside an operation the world's loss broke (waiting in a collective for a peer that left it,
        up to ``cluster.sync_timeout_s`` or ``collective_timeout_s``)."""
        handles = self.scheduler.workers(role)
        futures = self.scheduler.submit(role, "pid")
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        if pending:
            busy = ", ".join(f"{handles[i].name} (pid {handles[i].pid})" for i, f in enumerate(futures) if f in pending)
            raise RunFailure(
                f"{busy} did not answer within {timeout_s:g} s: still inside the call the loss broke (a collective "
                f"that waits for the lost worker), so the {role} workers cannot save together"
            )
        for f in futures:
            f.result()  # a dead one raises WorkerDiedError

    def stop(self, role: str) -> None:
        """Shut ``role``'s workers down, all at once, within ``SHUTDOWN_TIMEOUT_S``: a worker still in it
        then (stalled, or in a collective with a lost peer) is killed, as are lost ones; a failure is
        logged (tearing down anyway). The scheduler too once every role is stopped."""
        if self.scheduler is None:
            return
        if role in self.scheduler.roles and role not in self._stopped:
            handles = self.scheduler.workers(role)
            live = [i for i in range(len(handles)) if (role, i) not in self._lost]
            futures = {i: self.scheduler.submit_one(role, i, "shutdown") for i in live}
            _, pending = concurrent.futures.wait(list(futures.values()), timeout=SHUTDOWN_TIMEOUT_S)
            for i, future in futures.items():
                if future in pending:
                    logger.warning(
                        "%s (pid %s) did not finish its shutdown within %g s: killing it (log: %s)",
                        handles[i].name,
                        handles[i].pid,
                        SHUTDOWN_TIMEOUT_S,
                        handles[i].log_path,
                    )
                    self._kill(role, i)
                elif isinstance(future.exception(), WorkerDiedError):
                    logger.debug("%s shutdown: %s", handles[i].name, future.exception())  # gone already
                elif future.exception() is not None:
                    logger.warning("partitioned engine: %s shutdown failed: %s", handles[i].name, future.exception())
            for i in range(len(handles)):
                if (role, i) in self._lost:
                    self._kill(role, i)
        self._stopped.add(role)
        if self._stopped.issuperset(self.ROLES):
            self.scheduler.shutdown()

    def _kill(self, role: str, index: int) -> None:
        try:
            self.scheduler.kill_worker(role, index)
        except NotImplementedError:
            pass  # the scheduler's shutdown ends it


def _first_line(exc: BaseException) -> str:
    """``exc`` as ``Type: its first line``, cut at a remote traceback's start (a one-line log)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    first = re.sub(r"^(.*? raised \w+): .*$", r"\1", first) if len(first) > 300 else first
    return f"{type(exc).__name__}: {first}"


def gather_fail_fast(futures: list) -> list:
    """Results of worker futures in order; the first worker error is raised at once (the other
    workers may then be stuck in a collective with it: the engine must be shut down)."""
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]
