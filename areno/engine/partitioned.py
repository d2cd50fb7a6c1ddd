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
"""

from __future__ import annotations

import concurrent.futures
import datetime
import faulthandler
import logging
import os
import secrets
import signal
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areno.engine.api import resolve_device
from areno.engine.cluster import (
    ClusterLayout,
    LayoutError,
    estimate_memory,
    layout_from_config,
    scheduler_for,
    validate_memory,
)
from areno.engine.config import ArenoConfig, resolve_dtypes
from areno.engine.host import apply_host_settings
from areno.errors import ConfigError, RunFailure
from areno.launch.scheduler import RoleSpec, WorkerDiedError
from areno.launch.storage import check_shared_storage
from areno.models.config import ModelConfig
from areno.models.hf_io import read_config
from areno.models.tp_plan import check_tp_size
from areno.recipes import get_recipe
from areno.sync.stream import StreamSyncConfig
from areno.train import checkpoint
from areno.train.context_parallel import check_context_parallel

logger = logging.getLogger(__name__)

__all__ = [
    "PartitionedCluster",
    "WorkerLostError",
    "gather_fail_fast",
    "is_partitioned",
    "kv_tokens_for",
]


class WorkerLostError(RunFailure):
    """A worker of the partitioned world died; its world cannot be re-formed in place."""


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


def kv_tokens_for(config: ArenoConfig) -> int:
    """KV-cache tokens a rollout replica holds: the configured blocks, else every concurrent
    sequence at a nominal prompt plus its full completion."""
    r = config.rollout
    if r.kv_blocks:
        return r.kv_blocks * r.block_size
    return r.max_concurrent * r.n_samples * (PROMPT_TOKENS_EST + r.max_new_tokens)


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


def _sync_config(config: ArenoConfig):
    dtype_name = resolve_dtypes(config, _device_type(config)).rollout
    wire = None if dtype_name == "float32" else getattr(torch, dtype_name)
    return StreamSyncConfig(
        bucket_bytes=config.cluster.sync_bucket_bytes, timeout_s=config.cluster.sync_timeout_s, wire_dtype=wire
    )


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
                "or a '+' allocation_mode; without them the engine runs colocated"
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
        heads, MLP or vocabulary (``areno.models.tp_plan.check_tp_size``)."""
        if model_config.vision is not None and layout.rollout_tp > 1:  # its rollout engine loads whole
            raise LayoutError(
                f"cluster.rollout_tp={layout.rollout_tp} (or allocation_mode t{layout.rollout_tp}): a vision-language "
                "model's rollout engine runs without tensor parallelism; set cluster.rollout_tp=1"
            )
        for what, size in (("cluster.train_tp", layout.train_tp), ("cluster.rollout_tp", layout.rollout_tp)):
            try:
                check_tp_size(model_config, size)
            except ValueError as e:
                raise LayoutError(f"{what} (or allocation_mode t{size}): {e}") from None
        try:
            check_context_parallel(model_config, layout.train_cp)
        except ConfigError as e:
            raise LayoutError(f"allocation_mode c{layout.train_cp}: {e}") from None

    def check_memory(self, layout: ClusterLayout, model_dir: Path) -> None:
        """LayoutError when some device cannot hold what the layout puts on it (``estimate_memory``
        against ``device_capacity``, default each GPU's total memory; nothing checked on CPU)."""
        cfg = self.config
        cuda = layout.cuda
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
                kv_tokens=kv_tokens_for(cfg),
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
        logger.info("partitioned topology: %s", layout.describe())
        if self.scheduler is None:
            self.scheduler = scheduler_for(cfg.cluster, layout, log_dir=str(self.run_dir / "workers"))
        args = (cfg, layout, str(model_dir))
        # every request carries this key, also on loopback: an unkeyed server trusts every local user
        self.api_key = secrets.token_urlsafe(32)
        self.scheduler.create_roles(
            [
                RoleSpec(
                    role="train",
                    worker_cls="areno.engine.workers:TrainWorker",
                    n=layout.n_train,
                    args=args,
                    devices=list(layout.train_devices) if layout.cuda else None,
                    world="areno",
                ),
                RoleSpec(
                    role="rollout",
                    worker_cls="areno.engine.workers:RolloutWorker",
                    n=layout.n_rollout,
                    args=args,
                    kwargs={"api_key": self.api_key},
                    devices=list(layout.rollout_devices) if layout.cuda else None,
                    world="areno",
                ),
            ]
        )
        self._launched = True
        # checkpoints (DCP, written by the training ranks) and exports go under run_dir: every node must see it
        check_shared_storage([str(self.run_dir)], self.scheduler)

    def replica_urls(self) -> list[str]:
        """The URL of each rollout replica's server (its TP group's leader)."""
        urls = self.scheduler.call("rollout", "url")
        return [urls[r - self.layout.n_train] for r in self.layout.replica_leaders()]

    def check_workers(self) -> None:
        """WorkerLostError (one line) naming the first dead worker. A dead rollout replica only
        loses its in-flight HTTP requests, which the client re-sends to another replica (the
        episode, run here, is neither lost nor duplicated); but the policy sync needs every rank
        of the world, which cannot be re-formed around a new process in place."""
        for role in ("train", "rollout"):
            dead = self.dead_workers(role, timeout_s=60)
            if dead:
                raise WorkerLostError(next(iter(dead.values())))

    def dead_workers(self, role: str, timeout_s: float) -> dict[int, str]:
        """``index -> why`` for each worker of ``role`` whose process is gone (a worker too busy to
        answer within ``timeout_s`` counts as alive)."""
        dead = {}
        for i, (handle, future) in enumerate(zip(self.scheduler.workers(role), self.scheduler.submit(role, "pid"))):
            try:
                future.result(timeout=timeout_s)
            except WorkerDiedError:
                saved = checkpoint.latest_complete(self.run_dir / "checkpoints") is not None
                again = (
                    "go on from its last checkpoint with resume=auto" if saved else "start it again (no checkpoint yet)"
                )
                dead[i] = (
                    f"{handle.name} (pid {handle.pid}) died; the distributed world cannot be re-formed in "
                    f"place: {again} (log: {handle.log_path})"
                )
            except concurrent.futures.TimeoutError:
                pass
        return dead

    def stop(self, role: str) -> None:
        """Shut ``role``'s workers down (a failure is logged: tearing down anyway); the scheduler
        too once every role is stopped."""
        if self.scheduler is None:
            return
        if role in self.scheduler.roles and role not in self._stopped:
            try:
                self.scheduler.call(role, "shutdown")
            except Exception as e:  # noqa: BLE001 - tearing down anyway
                logger.warning("partitioned engine: %s shutdown failed: %s", role, e)
        self._stopped.add(role)
        if self._stopped.issuperset(self.ROLES):
            self.scheduler.shutdown()


def gather_fail_fast(futures: list) -> list:
    """Results of worker futures in order; the first worker error is raised at once (the other
    workers may then be stuck in a collective with it: the engine must be shut down)."""
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]
