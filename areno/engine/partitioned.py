"""PartitionedArenoEngine: training and rollout on separate workers of one distributed world (seed 000).

The controller (the Trainer's process) starts, through the scheduler ``cluster.scheduler`` names
(local subprocesses, Ray actors or a SLURM job: ``areno.engine.cluster.scheduler_for``), ``n_train`` training
workers (``TrainWorker``: the recipe's roles on ``FSDP2TrainBackend`` over the training sub-mesh)
and ``n_rollout`` rollout workers (``RolloutWorker``: a ``RolloutEngine`` behind the token-level
HTTP server on 127.0.0.1), all in ONE torch.distributed world (gloo on CPU, NCCL on GPU) with
separate groups (``areno.engine.cluster``).

    generate_rollout   WorkflowExecutor (here) -> MultiServerRolloutClient -> HTTP /generate on each
                       rollout replica, round-robin over those a HealthMonitor holds healthy (a dead
                       replica's requests go to the others), each request under
                       rollout.request_timeout_s; the rollout engines keep their policy until a sync
                       completes
    step               the TokenBatch goes to every training worker; RecipeRunner on each
    update_weights     StreamTransport: training DP rows -> relay rollout rank -> every rollout rank,
                       bucketed, all-or-nothing commit; bracketed by executor pause/resume; the
                       version bumps only when the sync completed on every rank; its
                       ``policy_sync_*`` figures ride with the next step's metrics

η > 0 runs the everlasting pool (``executor.wait_batch``); η = 0 is synchronous.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from areno.engine.api import (
    ArenoEngine,
    build_role_backends,
    prepare_model_dir,
    resolve_recipe,
    rollout_engine_config,
    warm_up_rollout_engine,
)
from areno.engine.cluster import (
    ClusterLayout,
    LayoutError,
    build_groups,
    estimate_memory,
    layout_from_config,
    validate_memory,
)
from areno.engine.config import ArenoConfig
from areno.errors import RunFailure
from areno.faults import fault_point
from areno.rollout.client import MultiServerRolloutClient
from areno.rollout.health import HealthMonitor
from areno.train import checkpoint
from areno.types import RolloutBatch

logger = logging.getLogger(__name__)

__all__ = [
    "PartitionedArenoEngine",
    "RolloutWorker",
    "TrainWorker",
    "WorkerLostError",
    "is_partitioned",
    "kv_tokens_for",
]


class WorkerLostError(RunFailure):
    """A worker of the partitioned world died; its world cannot be re-formed in place."""


PROMPT_TOKENS_EST = 256
"""Prompt tokens per sequence assumed by the KV-cache estimate."""


def is_partitioned(config: ArenoConfig) -> bool:
    """True when the config asks for the partitioned topology (what ArenoBackend checks):
    device lists or a ``+`` allocation_mode, and an online recipe (offline recipes such as the
    pipeline's sft warm start have no rollout side and run colocated)."""
    from areno.recipes import get_recipe

    c = config.cluster
    asked = c.train_devices is not None or c.rollout_devices is not None or "+" in (c.allocation_mode or "")
    return asked and get_recipe(config.train.algorithm).online


def kv_tokens_for(config: ArenoConfig, block_size: int = 16) -> int:
    """KV-cache tokens a rollout replica holds: the configured blocks, else every concurrent
    sequence at a nominal prompt plus its full completion."""
    r = config.rollout
    if r.kv_blocks:
        return r.kv_blocks * block_size
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
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: no packet is sent
        return probe.getsockname()[0]


def _device_type(config: ArenoConfig) -> str:
    from areno.engine.api import resolve_device

    return resolve_device(config.cluster.device).type


def apply_process_settings(config: ArenoConfig) -> None:
    """A worker process's own settings: torch's CPU threads and Python's thread switch interval."""
    if config.cluster.cpu_threads:
        torch.set_num_threads(config.cluster.cpu_threads)
    if config.cluster.switch_interval_s:
        sys.setswitchinterval(config.cluster.switch_interval_s)


def _init_world(config: ArenoConfig) -> str:
    """Join the world (env from the scheduler); returns the device type."""
    import faulthandler
    import signal

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: stacks to the worker log
    device_type = _device_type(config)
    apply_process_settings(config)
    if device_type == "cuda":
        torch.cuda.set_device(0)  # the scheduler gave this worker exactly its device
    if not dist.is_initialized():
        # The world is gloo even on GPU: overlapping device lists put two ranks on one GPU, which
        # an NCCL communicator must never hold. NCCL lives in the subgroups (build_groups and the
        # stream transport's data plane), whose members are on distinct GPUs by construction.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.cluster.collective_timeout_s))
    return device_type


def _sync_config(config: ArenoConfig):
    from areno.sync.stream import StreamSyncConfig

    dtype_name = config.model.rollout_dtype
    wire = getattr(torch, dtype_name) if dtype_name not in ("auto", "float32") else None
    if dtype_name == "auto" and _device_type(config) == "cuda":
        wire = torch.bfloat16
    return StreamSyncConfig(bucket_bytes=64 << 20, timeout_s=600.0, wire_dtype=wire)


# =========================================================================== workers
class TrainWorker:
    """One training rank: the recipe's roles on FSDP2 over the training sub-mesh, and the sender
    side of the policy stream. Built by the scheduler in its own process."""

    def __init__(self, config: ArenoConfig, layout: ClusterLayout, model_dir: str) -> None:
        from areno.recipes.runner import RecipeRunner
        from areno.sync.base import NamedTensorSource
        from areno.sync.stream import StreamTransport
        from areno.train import FSDP2TrainBackend

        self.config = cfg = config
        device_type = _init_world(cfg)
        self.groups = build_groups(layout, device_type)  # collective: same order on every rank
        torch.manual_seed(cfg.train.seed)
        recipe = resolve_recipe(cfg)
        backends = build_role_backends(
            cfg,
            recipe,
            Path(model_dir),
            lambda c: FSDP2TrainBackend(
                dataclasses.replace(
                    c, device=device_type, tp_size=layout.train_tp, dp_replicate_size=layout.train_dp_replicate
                ),
                mesh=self.groups.train_mesh,
                group=self.groups.train_group,
            ),
        )
        self.runner = RecipeRunner(recipe, backends, num_minibatches=cfg.train.num_minibatches)
        synced = self.runner.roles_to_sync()
        self.policy = synced[0] if synced else recipe.roles[0].name
        self.transport = StreamTransport(
            topology=layout.stream_topology(),
            config=_sync_config(cfg),
            source=NamedTensorSource(backends[self.policy].named_weights),
            device=torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu",
            backend="nccl" if device_type == "cuda" else None,
        )

    def pid(self) -> int:
        return os.getpid()

    def step(self, batch_bytes: bytes, pass_order: list[int] | None = None) -> dict[str, float]:
        """``batch_bytes``: a pickled TokenBatch (plain pickle: the scheduler's connection would
        otherwise pass tensors as shared-memory handles, which only work between relatives);
        ``pass_order``: a later pass over the previous rollout (``RecipeRunner.step``)."""
        return self.runner.step(pickle.loads(batch_bytes), pass_order=pass_order)

    def sync(self, version: int) -> dict[str, float]:
        return self.transport.sync(version).as_metrics()

    def export_hf(self, path: str) -> None:
        self.runner.backends[self.policy].export_hf(path)

    def save_role(self, path: str, role: str, extra_state: dict) -> None:
        self.runner.backends[role].save_checkpoint(path, extra_state=extra_state)

    def load_role(self, path: str, role: str) -> dict:
        return self.runner.backends[role].load_checkpoint(path)

    def trainable_roles(self) -> list[str]:
        return [n for n, b in self.runner.backends.items() if b.cfg.trainable]

    def shutdown(self) -> None:
        for backend in self.runner.backends.values():
            backend.shutdown()


class RolloutWorker:
    """One rollout rank: a RolloutEngine served over HTTP on 127.0.0.1 and the receiving side of
    the policy stream (it keeps generating with its current policy until a sync commits)."""

    def __init__(
        self, config: ArenoConfig, layout: ClusterLayout, model_dir: str, *, api_key: str | None = None
    ) -> None:
        """``api_key``: required by the server for every request but /health; a worker that may sit
        on another node than the controller (Ray, SLURM) binds all interfaces and must have one."""
        import uvicorn
        from transformers import AutoTokenizer

        from areno.launch.scheduler import free_port
        from areno.models.hf_io import load_model
        from areno.rollout.engine import RolloutEngine
        from areno.rollout.server import create_app
        from areno.sync.base import ShardSpec, engine_receiver
        from areno.sync.stream import StreamTransport

        self.config = cfg = config
        device_type = _init_world(cfg)
        self.groups = build_groups(layout, device_type)
        device = f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu"
        dtype_name = cfg.model.rollout_dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if device_type == "cuda" else "float32"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model, model_config = load_model(model_dir, dtype=getattr(torch, dtype_name), device=device)
        blocks = cfg.rollout.kv_blocks
        if not blocks and layout.overlapping:  # a shared GPU: only the KV memory the check allowed
            blocks = -(-kv_tokens_for(cfg) // 16)
        self.engine = RolloutEngine(
            model,
            model_config,
            config=rollout_engine_config(cfg, device=device, dtype=dtype_name, num_blocks=blocks),
            eos_token_ids=[tokenizer.eos_token_id],
            tokenizer=tokenizer,
        )
        warm_up_rollout_engine(self.engine, cfg)
        specs = {
            n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype)
            for n, t in self.engine.weight_tensors().items()
        }
        # Asynchronous: a staged commit is applied in the background at the engine's next step
        # boundary, so the sync (and the trainer waiting on it) does not wait for a k-step decode loop.
        self.receiver = engine_receiver(
            self.engine,
            specs,
            commit=cfg.cluster.sync_commit,
            deferred=cfg.rollout.max_head_offpolicyness > 0 and cfg.cluster.sync_commit == "staged",
        )
        self.transport = StreamTransport(
            topology=layout.stream_topology(),
            config=_sync_config(cfg),
            receiver=self.receiver,
            device=device,
            backend="nccl" if device_type == "cuda" else None,
        )
        from areno.rollout.server import check_bind

        self.host = bind_host(cfg)
        check_bind(self.host, api_key)  # beyond loopback only with a key
        self.advertised = advertised_address(self.host)
        self.app = create_app(self.engine, tokenizer=tokenizer, api_key=api_key)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self.server.run, name="areno-rollout-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rollout worker: HTTP server on 127.0.0.1:{self.port} did not start")
            time.sleep(0.02)

    def url(self) -> str:
        return f"http://{self.advertised}:{self.port}"

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        self.receiver.wait_committed(timeout_s=self.transport.config.timeout_s)  # a deferred commit applying
        return self.engine.version

    def engine_stats(self) -> dict[str, float]:
        """The engine's counters (``RolloutEngine.stats``, with the clock its ``busy_s`` was read
        on), for the controller's per-step rollout-engine metrics."""
        return {k: float(v) for k, v in self.engine.stats().items() if isinstance(v, (int, float))}

    def sync(self, version: int) -> dict[str, float]:
        # No CUDA-graph capture beside the sync's NCCL work on this GPU (steps needing a new graph
        # meanwhile run eagerly); an asynchronous run syncs while the engine generates.
        t0 = time.perf_counter()
        with self.engine.hold_graph_captures():
            t1 = time.perf_counter()  # an ongoing capture finished
            metrics = self.transport.sync(version).as_metrics()
        t2 = time.perf_counter()
        self.app.state.client.wake()
        metrics["policy_sync_phase_hold_captures_s"] = t1 - t0
        metrics["policy_sync_phase_wake_s"] = time.perf_counter() - t2
        return metrics

    def join_checkpoint(self, path: str, load: bool) -> None:
        """Take part in the training checkpoint's world collectives with nothing to write or read:
        the same sequence as ``areno.train.checkpoint.save`` (barrier, DCP save, barrier) / ``load``
        (DCP load), whose DCP plans and barriers span the default group."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if load:
            dcp.load({}, checkpoint_id=path)
        else:
            dist.barrier()
            dcp.save({}, checkpoint_id=path)
            dist.barrier()

    def shutdown(self) -> None:
        try:
            self.receiver.wait_committed(timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask the caller's error
            logger.warning("rollout worker shutdown: %s", exc)
        self.server.should_exit = True
        self._thread.join(timeout=10)


# =========================================================================== client
# =========================================================================== controller
class PartitionedArenoEngine(ArenoEngine):
    """ArenoEngine's public methods over separate training and rollout workers (see module doc)."""

    layout: ClusterLayout
    scheduler: Any

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
        (default: each visible GPU's total memory; no check on CPU)."""
        super().__init__(config, run_dir)
        self.scheduler = scheduler
        self._device_capacity = device_capacity
        self.runner = None
        self._lost_lock = threading.Lock()
        self._lost_seen: tuple[float, dict[str, str]] = (float("-inf"), {})
        """``lost_replicas``' last answer and when it was taken."""

    # ----------------------------------------------------------------------------- set-up
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
                "PartitionedArenoEngine needs cluster.train_devices + cluster.rollout_devices "
                "or a '+' allocation_mode; without them use the colocated ArenoEngine"
            )
        if layout.rollout_tp != 1:
            raise LayoutError(
                f"rollout TP {layout.rollout_tp}: the partitioned engine serves rollout TP 1 "
                "replicas (rollout DP = number of rollout devices); use rollout t1"
            )
        layout.relays()  # routing error (no relay on another device) before launch
        return layout

    def check_memory(self, layout: ClusterLayout, model_dir: Path) -> None:
        """LayoutError when some device cannot hold what the layout puts on it (``estimate_memory``
        against ``device_capacity``, default each GPU's total memory; nothing checked on CPU)."""
        from areno.models.hf_io import read_config

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
            rollout_dtype = (
                cfg.model.rollout_dtype if cfg.model.rollout_dtype != "auto" else ("bfloat16" if cuda else "float32")
            )
            est = estimate_memory(
                layout,
                model_config,
                train_dtype=cfg.model.dtype if cfg.model.dtype != "auto" else "float32",
                rollout_dtype=rollout_dtype,
                kv_tokens=kv_tokens_for(cfg),
            )
            validate_memory(layout, est, capacity)

    def initialize(self) -> None:
        from transformers import AutoTokenizer

        from areno.data.datasets import build_splits
        from areno.data.tasks import PromptStream
        from areno.engine.cluster import scheduler_for
        from areno.launch.scheduler import RoleSpec
        from areno.launch.storage import check_shared_storage

        cfg = self.config
        self.recipe = resolve_recipe(cfg)
        if not self.recipe.online:
            raise ValueError(
                f"recipe {cfg.train.algorithm!r} trains offline: the partitioned topology is for online "
                "RL; unset cluster.train_devices/rollout_devices to run it colocated"
            )
        self.layout = layout = self.plan_layout()
        train_rows, self.eval_rows = build_splits(cfg.data)
        self.train_stream = PromptStream(train_rows, seed=cfg.data.seed)
        self.device = torch.device("cpu")  # the controller holds no model
        model_dir = prepare_model_dir(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                f"model.path: the tokenizer in {model_dir} has no eos_token: set one in tokenizer_config.json"
            )
        self.check_memory(layout, model_dir)
        logger.info("partitioned topology: %s", layout.describe())
        if self.scheduler is None:
            self.scheduler = scheduler_for(cfg.cluster, layout, log_dir=str(self.run_dir / "workers"))
        args = (cfg, layout, str(model_dir))
        # workers on other nodes (ray, slurm) serve beyond loopback: every request carries this key
        api_key = secrets.token_urlsafe(32) if bind_host(cfg) != "127.0.0.1" else None
        self.scheduler.create_roles(
            [
                RoleSpec(
                    role="train",
                    worker_cls="areno.engine.partitioned:TrainWorker",
                    n=layout.n_train,
                    args=args,
                    devices=list(layout.train_devices) if layout.cuda else None,
                    world="areno",
                ),
                RoleSpec(
                    role="rollout",
                    worker_cls="areno.engine.partitioned:RolloutWorker",
                    n=layout.n_rollout,
                    args=args,
                    kwargs={"api_key": api_key},
                    devices=list(layout.rollout_devices) if layout.cuda else None,
                    world="areno",
                ),
            ]
        )
        # checkpoints (DCP, written by the training ranks) and exports go under run_dir: every node must see it
        check_shared_storage([str(self.run_dir)], self.scheduler)
        urls = self.scheduler.call("rollout", "url")
        replica_urls = [urls[r - layout.n_train] for r in layout.replica_leaders()]
        self.health = HealthMonitor(replica_urls, api_key=api_key).start()
        self.client = MultiServerRolloutClient(
            replica_urls,
            api_key=api_key,
            request_timeout_s=cfg.rollout.request_timeout_s,
            health=self.health,
            lost=self.lost_replicas,
        )
        self.executor = self._build_executor()
        self.asynchronous = cfg.rollout.max_head_offpolicyness > 0

    # ----------------------------------------------------------------------------- the loop
    def generate_rollout(self, rollout_id: int) -> RolloutBatch:
        rollout = super().generate_rollout(rollout_id)
        rollout.metrics.update(self.health.metrics())
        rollout.metrics.update(self._engine_metrics())
        return rollout

    def _engine_metrics(self) -> dict[str, float]:
        """Per step, from every rollout worker's engine counters since the previous step: busy
        fraction (time in steps that ran a batch over wall time; 1 - its idle fraction), generated
        tokens/s, preemptions, KV usage."""
        try:
            now = self.scheduler.call("rollout", "engine_stats")
        except Exception as exc:  # noqa: BLE001 - a lost replica is handled by check_workers / the client
            logger.debug("rollout engine stats unavailable: %s", exc)
            self._last_engine_stats = None
            return {}
        last, self._last_engine_stats = getattr(self, "_last_engine_stats", None), now
        if last is None or len(last) != len(now):
            return {}
        busy, tokens, wall = [], 0.0, []
        for a, b in zip(last, now):
            dt = max(b["clock_s"] - a["clock_s"], 1e-9)
            wall.append(dt)
            busy.append((b["busy_s"] - a["busy_s"]) / dt)
            tokens += b["generated_tokens"] - a["generated_tokens"]

        def deltas(key: str) -> list[float]:  # each replica's counter since the previous step
            return [b.get(key, 0) - a.get(key, 0) for a, b in zip(last, now)]

        out = {f"rollout/engine_{i}_busy_frac": v for i, v in enumerate(busy)}
        out.update(
            {
                "rollout/engine_busy_frac": sum(busy) / len(busy),
                "rollout/engine_generated_tokens_per_s": tokens / (sum(wall) / len(wall)),
                "rollout/engine_preemptions": sum(deltas("num_preemptions")),
                # prefill work (prompts, and re-prefill of requests recomputed after a sync) and the
                # engine steps that carried it (prefill and mixed steps run without CUDA graphs)
                "rollout/engine_prefill_tokens": sum(deltas("prefill_tokens")),
                "rollout/engine_mixed_steps": sum(deltas("mixed_steps")),
                "rollout/engine_steps": sum(deltas("steps")),
                # host round trips (a k-step decode loop is one) and decode steps run eagerly because
                # their graph was being captured or captures were held by a policy sync
                "rollout/engine_round_trips": sum(deltas("sampling_round_trips")),
                "rollout/engine_graph_deferred_steps": sum(deltas("cuda_graph_deferred_steps")),
                "rollout/engine_kv_usage_max": max(b["kv_usage"] for b in now),
                # CUDA graphs captured during the step (each a pause of the engine's decode loop)
                "rollout/engine_graph_captures": sum(deltas("cuda_graphs_captured")),
                "rollout/engine_graph_capture_s": max(deltas("cuda_graph_capture_s")),
            }
        )
        return out

    def step(self, rollout: RolloutBatch) -> dict[str, float]:
        results = self.scheduler.call("train", "step", pickle.dumps(rollout.batch), rollout.pass_order)
        metrics = {f"train/{k}": v for k, v in results[0].items()}
        metrics.update(self._pending_sync_metrics)
        self._pending_sync_metrics = {}
        return metrics

    def update_weights(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.check_workers()
        t_check = time.perf_counter() - t0
        version = self.version + 1
        if self.asynchronous:
            self.executor.pause()
        try:
            futures = self.scheduler.submit("train", "sync", version) + self.scheduler.submit(
                "rollout", "sync", version
            )
            results = gather_fail_fast(futures)
        finally:
            if self.asynchronous:
                # every rollout engine committed (all-or-nothing) or none did
                self.executor.set_version(version if all(results_ok(futures)) else self.version)
                self.executor.resume()
        self.version = version
        n_train = len(self.scheduler.workers("train"))
        # a training rank's figures, but generation stopped as long as the slowest rollout commit;
        # where the time went: the training rank's phases, the slowest rollout rank's per phase
        # (policy_sync_rollout_phase_*), and the controller's own (worker check, whole call)
        rollout_phases = {
            k.replace("policy_sync_phase_", "policy_sync_rollout_phase_"): max(r.get(k, 0.0) for r in results[n_train:])
            for k in results[n_train]
            if k.startswith("policy_sync_phase_")
        }
        self._pending_sync_metrics = {
            **results[0],
            **rollout_phases,
            "policy_sync_generation_paused_s": max(r["policy_sync_generation_paused_s"] for r in results[n_train:]),
            "policy_sync_controller_check_s": t_check,
            "policy_sync_controller_s": time.perf_counter() - t0,
        }
        return {}

    def check_workers(self) -> None:
        """WorkerLostError (one line) naming the first dead worker. A dead rollout replica only
        loses its in-flight HTTP requests, which the client re-sends to another replica (the
        episode, run here, is neither lost nor duplicated); but the policy sync needs every rank
        of the world, which cannot be re-formed around a new process in place."""
        for role in ("train", "rollout"):
            dead = self._dead_workers(role, timeout_s=60)
            if dead:
                raise WorkerLostError(next(iter(dead.values())))

    def _dead_workers(self, role: str, timeout_s: float) -> dict[int, str]:
        """``index -> why`` for each worker of ``role`` whose process is gone (a worker too busy to
        answer within ``timeout_s`` counts as alive)."""
        import concurrent.futures

        from areno.launch.scheduler import WorkerDiedError

        dead = {}
        for i, (handle, future) in enumerate(zip(self.scheduler.workers(role), self.scheduler.submit(role, "pid"))):
            try:
                future.result(timeout=timeout_s)
            except WorkerDiedError:
                dead[i] = (
                    f"{handle.name} (pid {handle.pid}) died; the distributed world cannot be re-formed in "
                    f"place: restart the run from its last checkpoint (log: {handle.log_path})"
                )
            except concurrent.futures.TimeoutError:
                pass
        return dead

    LOST_CHECK_EVERY_S = 1.0
    """``lost_replicas`` asks the workers at most this often (every waiting request calls it)."""

    def lost_replicas(self) -> dict[str, str]:
        """The rollout client's ``lost``: ``url -> why`` for each replica one of whose ranks died
        (a TP replica cannot serve without all of them, and the world cannot take a new process),
        so requests fail with the cause instead of waiting ``rollout.request_timeout_s`` for a
        recovery that cannot come."""
        with self._lost_lock:
            checked_at, lost = self._lost_seen
            if time.monotonic() - checked_at >= self.LOST_CHECK_EVERY_S:
                dead = self._dead_workers("rollout", timeout_s=5)
                n_train = self.layout.n_train
                lost = {}
                for url, group in zip(self.client.urls, self.layout.rollout_tp_groups()):
                    why = next((dead[r - n_train] for r in group if r - n_train in dead), None)
                    if why is not None:
                        lost[url] = why
                self._lost_seen = (time.monotonic(), lost)
            return lost

    # ----------------------------------------------------------------------------- state
    def save(self, path: Path, trainer_state: dict) -> None:
        self.check_workers()
        state = {**trainer_state, **self.resume_state()}  # data cursor incl. the async pool's untrained samples
        tmp = checkpoint.staging_dir(path)
        for role in self.scheduler.call("train", "trainable_roles")[0]:
            # DCP's collectives span the world: rollout ranks join with nothing to write
            gather_fail_fast(
                self.scheduler.submit("train", "save_role", str(tmp / role), role, state)
                + self.scheduler.submit("rollout", "join_checkpoint", str(tmp / role), False)
            )
        self.export_policy(tmp / "hf")
        fault_point("checkpoint_write", int(trainer_state.get("rollout_id", -1)) + 1)
        checkpoint.commit(tmp, path)  # COMPLETE inside, then one rename: path exists only when whole

    def load(self, path: Path) -> dict:
        self.check_loadable()
        state = {}
        for role in self.scheduler.call("train", "trainable_roles")[0]:
            results = gather_fail_fast(
                self.scheduler.submit("train", "load_role", str(path / role), role)
                + self.scheduler.submit("rollout", "join_checkpoint", str(path / role), True)
            )
            state = results[0]
        self._restore(state)
        return state

    def export_policy(self, path: Path) -> None:
        self.scheduler.call("train", "export_hf", str(path))
        self.tokenizer.save_pretrained(path)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.stop()
        if getattr(self, "health", None) is not None:
            self.health.stop()
        if self.scheduler is not None:
            for role in ("rollout", "train"):
                if role in self.scheduler.roles:
                    try:
                        self.scheduler.call(role, "shutdown")
                    except Exception as e:  # noqa: BLE001 - tearing down anyway
                        logger.warning("partitioned engine: %s shutdown failed: %s", role, e)
            self.scheduler.shutdown()
        self.close_reward()


def results_ok(futures) -> list[bool]:
    return [f.done() and f.exception() is None for f in futures]


def gather_fail_fast(futures: list) -> list:
    """Results of worker futures in order; the first worker error is raised at once (the other
    workers may then be stuck in a collective with it: the engine must be shut down)."""
    import concurrent.futures

    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]
